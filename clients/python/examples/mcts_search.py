"""MCTS-style search over checkpoints.

Searches for the answer the shell env's verifier wants by trying candidate
answers from checkpoints: each tree node is a checkpoint, expanding a node
tries actions from its state, the verifier (Evaluate) scores leaves, and the
sandbox backtracks to the best node found before submitting. Run against
`make run` (env "shell"):

    python examples/mcts_search.py [--env shell] [--iterations 6]
"""

import argparse
import sys

import deltagym
from deltagym.tree import SearchTree


def candidates(depth: int):
    # Level 0 picks the tens digit, level 1 the units digit.
    if depth == 0:
        return [f"printf {t} > /work/answer.txt" for t in range(3, 6)]
    return [f"printf {u} >> /work/answer.txt" for u in range(1, 4)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="shell")
    ap.add_argument("--iterations", type=int, default=6)
    args = ap.parse_args()
    with deltagym.Sandbox.create(args.env, seed=1) as sb:
        tree = SearchTree(sb)
        for _ in range(args.iterations):
            leaf = tree.select()
            if leaf.depth < 2 and not leaf.done:
                for kid in tree.expand(leaf, candidates(leaf.depth)):
                    tree.backpropagate(kid, tree.evaluate(kid))
            else:
                tree.backpropagate(leaf, tree.evaluate(leaf))
        best = tree.best_leaf()
        tree.backtrack(best)
        answer = sb.files.read("/work/answer.txt")
        result = sb.submit()
        print(f"explored {sum(1 for _ in tree.nodes())} nodes; best path: "
              + " | ".join(n.action.exec.command for n in best.path()[1:]))
        print(f"answer {answer!r} reward {result.reward}")
        tree.release()
        return 0 if result.reward > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
