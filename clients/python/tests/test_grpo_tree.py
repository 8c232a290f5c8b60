"""Group rollouts (8 concurrent episodes) with ledger advantages, and the tree search helper."""

from __future__ import annotations

import asyncio
import math

from deltagym import AsyncClient, Client
from deltagym.grpo import run_group
from deltagym.tree import SearchTree


def test_group_of_8_concurrent_rollouts(server):
    server.require_ledger()
    started = []

    async def policy(r):
        if not r.steps:
            started.append(r.index)
            # Every rollout waits until all 8 have started: they run concurrently.
            for _ in range(400):
                if len(started) == 8:
                    break
                await asyncio.sleep(0.01)
            answer = "42" if r.index < 3 else "0"
            return f"echo {answer} > /work/answer.txt"
        return None

    async def main():
        async with AsyncClient(server.addr) as c:
            async with await c.reset("shell", seed=1) as root:
                g = await run_group(c, root, policy, size=8, max_steps=3)
            assert len(started) == 8
            assert len({r.sandbox.id for r in g.rollouts}) == 8
            assert [r.reward for r in g.rollouts] == [1.0] * 3 + [0.0] * 5
            assert all(r.terminated for r in g.rollouts)
            adv = g.advantages
            assert adv.counted_count == 8 and math.isclose(adv.mean, 3 / 8)
            assert adv.std > 0
            for r in g.rollouts:
                a = g.advantage(r)
                # (reward - mean) / std, up to the server's small epsilon.
                assert math.isclose(a, (r.reward - adv.mean) / adv.std, rel_tol=1e-3), (a, r.reward)
            assert all(r.sandbox.closed for r in g.rollouts)
            assert await c.list_sandboxes(group_id=g.group_id) == []
    asyncio.run(main())


def test_search_tree_expand_backtrack(server):
    with Client(server.addr) as c, c.reset("shell") as sb:
        tree = SearchTree(sb)
        kids = tree.expand(tree.root, ["echo 41 > /work/answer.txt", "echo 42 > /work/answer.txt"])
        assert [k.depth for k in kids] == [1, 1] and all(k.checkpoint_id for k in kids)
        for k in kids:
            tree.backpropagate(k, tree.evaluate(k))
        assert [k.value for k in kids] == [0.0, 1.0] and tree.root.visits == 2
        grand = tree.expand(kids[1], ["echo extra >> /work/log"])
        assert grand[0].path() == [tree.root, kids[1], grand[0]]
        tree.backtrack(kids[0])
        assert sb.exec("cat /work/answer.txt; ls /work").observation.exec.stdout == b"41\nanswer.txt\n"
        tree.backtrack(grand[0])
        assert sb.exec("cat /work/log").observation.exec.stdout == b"extra\n"
        tree.backtrack(tree.root)
        assert sb.exec("ls /work").observation.exec.stdout == b""
        assert tree.select() is grand[0]  # unvisited leaves come first under UCT
        tree.backpropagate(grand[0], tree.evaluate(grand[0]))
        assert tree.best_leaf() is grand[0]
        assert len(list(tree.nodes())) == 4
        tree.release()
