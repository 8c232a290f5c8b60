"""Group rollouts for GRPO: fork G sandboxes from one state, step them
concurrently, let the verifier score each, and read the group-relative
advantages back from the ledger.

    async with AsyncClient() as c:
        root = await c.reset("shell", seed=0)
        group = await run_group(c, root, policy, size=8, max_steps=4)
        for r in group.rollouts:
            print(r.episode_id, r.reward, group.advantage(r))

A policy is a function (sync or async) of a Rollout that returns the next
action (an Action, or a str run as a shell command), or None to stop.
Episodes that stop without terminating are submitted, so that every episode
of the group gets the verifier's reward.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es, ledger_service_pb2 as ls
from .actions import submit
from .aio import AsyncClient, AsyncSandbox, AsyncSandboxHandle

__all__ = ["GroupResult", "Policy", "Rollout", "run_group", "wait_advantages"]


@dataclass
class Rollout:
    """One episode of a group, as the policy sees it while it runs."""

    index: int
    sandbox: AsyncSandboxHandle
    episode_id: str
    steps: list[es.StepResponse] = field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


Policy = Callable[[Rollout], action_pb2.Action | str | Awaitable[action_pb2.Action | str | None] | None]


@dataclass
class GroupResult:
    """A finished group: its rollouts and the ledger's advantages."""

    group_id: str
    checkpoint_id: str
    rollouts: list[Rollout]
    advantages: ls.GetGroupAdvantagesResponse

    def advantage(self, rollout: Rollout | str) -> float:
        """The advantage of a rollout (or an episode ID)."""
        eid = rollout if isinstance(rollout, str) else rollout.episode_id
        for a in self.advantages.advantages:
            if a.episode_id == eid:
                return a.advantage
        raise KeyError(f"episode {eid} not in group {self.group_id}")

    def by_episode(self) -> dict[str, ls.GroupAdvantage]:
        return {a.episode_id: a for a in self.advantages.advantages}


async def run_group(
    client: AsyncClient,
    source: AsyncSandboxHandle | AsyncSandbox | str,
    policy: Policy,
    *,
    size: int = 8,
    max_steps: int = 16,
    group_id: str | None = None,
    run: str = "",
    fresh_entropy: bool = True,
    reward_source: str = "",
    keep: bool = False,
    advantages_timeout: float = 30.0,
) -> GroupResult:
    """Forks `size` rollouts from source (a sandbox's current state or a
    checkpoint ID), runs policy on all of them concurrently for at most
    max_steps each, submits those that did not terminate, and returns the
    group's advantages from the ledger. The forked sandboxes are closed
    unless keep is set."""
    gid = group_id or f"grpo-{uuid.uuid4().hex[:12]}"
    if isinstance(source, str):
        kids = await client.fork(checkpoint_id=source, n=size, group_id=gid, run=run, fresh_entropy=fresh_entropy)
    else:
        kids = await client.fork(sandbox_id=source.id, n=size, group_id=gid, run=run, fresh_entropy=fresh_entropy)
    rollouts = [Rollout(index=i, sandbox=k, episode_id=k.episode_id) for i, k in enumerate(kids)]
    try:
        await asyncio.gather(*(_roll(r, policy, max_steps) for r in rollouts))
        adv = await wait_advantages(client, gid, [r.episode_id for r in rollouts], reward_source=reward_source,
                                    timeout=advantages_timeout)
    finally:
        if not keep:
            await asyncio.gather(*(k.close() for k in kids), return_exceptions=True)
    ck = kids[0].start_checkpoint_id if kids else ""
    return GroupResult(group_id=gid, checkpoint_id=ck, rollouts=rollouts, advantages=adv)


async def _roll(r: Rollout, policy: Policy, max_steps: int) -> None:
    for _ in range(max_steps):
        act = policy(r)
        if inspect.isawaitable(act):
            act = await act
        if act is None:
            break
        _record(r, await r.sandbox.step(act))
        if r.done:
            return
    if not r.done:
        _record(r, await r.sandbox.step(submit()))


def _record(r: Rollout, resp: es.StepResponse) -> None:
    r.steps.append(resp)
    r.reward += resp.reward
    r.terminated = resp.terminated
    r.truncated = resp.truncated
    r.episode_id = resp.episode_id or r.episode_id


async def wait_advantages(client: AsyncClient, group_id: str, episode_ids: list[str], *, reward_source: str = "",
                          timeout: float = 30.0) -> ls.GetGroupAdvantagesResponse:
    """Fetches the group's advantages, polling until the ledger has recorded
    every episode of episode_ids as finished (it records asynchronously)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        adv = await client.get_group_advantages(group_id, reward_source=reward_source)
        seen = {a.episode_id: a for a in adv.advantages}
        if all(e in seen and "running" not in seen[e].reason for e in episode_ids):
            return adv
        if time.monotonic() > deadline:
            missing = [e for e in episode_ids if e not in seen or "running" in seen[e].reason]
            raise TimeoutError(f"ledger has not recorded episodes {missing} of group {group_id} after {timeout}s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)
