"""GRPO group rollout with a scripted policy.

Forks 8 rollouts from one reset state, runs them concurrently, lets the
env's verifier score each (submit), and prints the group-relative advantages
the ledger computed. Run against `make run` (env "shell"):

    python examples/grpo_group.py [--env shell] [--size 8]
"""

import argparse
import asyncio

from deltagym import actions
from deltagym.aio import AsyncSandbox
from deltagym.grpo import Rollout, run_group


def policy(r: Rollout):
    """Even rollouts answer 42 (right for the shell env), odd ones guess wrong."""
    if len(r.steps) == 0:
        answer = 42 if r.index % 2 == 0 else 40 + r.index
        return actions.command(f"echo {answer} > /work/answer.txt")
    if len(r.steps) == 1:
        return "cat /work/answer.txt"
    return None  # stop: run_group submits, and the verifier scores the answer


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="shell")
    ap.add_argument("--size", type=int, default=8)
    args = ap.parse_args()
    async with await AsyncSandbox.create(args.env, seed=7) as root:
        group = await run_group(root.client, root.handle, policy, size=args.size, max_steps=4)
    print(f"group {group.group_id}: mean={group.advantages.mean:.3f} std={group.advantages.std:.3f} "
          f"counted={group.advantages.counted_count}")
    for r in group.rollouts:
        print(f"  rollout {r.index} episode {r.episode_id} reward={r.reward:.1f} advantage={group.advantage(r):+.3f}")


if __name__ == "__main__":
    asyncio.run(main())
