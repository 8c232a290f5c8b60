"""The asyncio client against a real server: every RPC, concurrency, errors."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import deltagym
from deltagym import AsyncClient, actions, env_service_pb2 as es


def run(coro):
    return asyncio.run(coro)


def test_async_env_service(server):
    async def main():
        async with AsyncClient(server.addr) as c:
            assert "shell" in {e.spec.name for e in await c.list_envs()}
            async with await c.reset("shell", seed=3, options={"WHO": "aio"}) as sb:
                assert "seed=3 who=aio" in sb.observation.reset.hook.stdout.decode()
                assert (await sb.exec("echo hi")).observation.exec.stdout == b"hi\n"
                assert (await sb.run(["echo", "argv"])).observation.exec.stdout == b"argv\n"
                await sb.write_file("/work/answer.txt", "42")
                assert (await sb.read_file("/work/answer.txt")).observation.read_file.content == b"42"
                ck = (await sb.checkpoint()).checkpoint_id
                assert (await sb.evaluate()).reward == 1.0
                await sb.exec("rm /work/answer.txt")
                assert (await sb.evaluate()).reward == 0.0
                await sb.restore(ck)
                assert (await sb.evaluate()).reward == 1.0
                await sb.exec("rm /work/answer.txt")
                r = await sb.step(actions.read_file("/work/answer.txt"), restore=ck)
                assert r.observation.read_file.content == b"42" and sb.episode_id == r.episode_id
                gid = uuid.uuid4().hex
                kids = await sb.fork(2, group_id=gid)
                assert {s.sandbox_id for s in await c.list_sandboxes(group_id=gid)} == {k.id for k in kids}
                assert (await c.get_sandbox(kids[0].id)).group_id == gid
                hb = await c.heartbeat(kids)
                assert {lease.sandbox_id for lease in hb.leases} == {k.id for k in kids}
                # Concurrent steps on several sandboxes.
                outs = await asyncio.gather(*(k.exec(f"echo {i}") for i, k in enumerate(kids)))
                assert [o.observation.exec.stdout for o in outs] == [b"0\n", b"1\n"]
                res = await c.step_stream([es.StepRequest(sandbox_id=k.id, action=actions.command("cat /work/answer.txt"))
                                           for k in kids])
                assert [r.observation.exec.stdout for r in res] == [b"42", b"42"]
                for k in kids:
                    await k.close()
                    await k.close()
                async with (await c.fork(checkpoint_id=ck, n=1))[0] as k:
                    assert (await k.submit()).reward == 1.0
                    with pytest.raises(deltagym.FailedPrecondition):
                        await k.exec("true")
                await c.release_checkpoint(ck)
                r = await sb.submit()
                assert r.terminated and r.reward == 1.0
            assert sb.closed
    run(main())


def test_async_errors(server):
    async def main():
        async with AsyncClient(server.addr) as c:
            with pytest.raises(deltagym.NotFound) as ei:
                await c.step("sb-nope", "true")
            assert ei.value.method == "Step"
            with pytest.raises(deltagym.NotFound):
                await c.reset("no-such-env")
            async with await c.reset("shell") as sb:
                with pytest.raises(deltagym.InvalidArgument):
                    await sb.step(actions.Action())
    run(main())


def test_async_heartbeat_keeps_lease(server):
    from .conftest import LEASE_TTL

    async def main():
        async with AsyncClient(server.addr) as c, await c.reset("shell") as sb:
            await asyncio.sleep(LEASE_TTL * 2)
            assert not sb.lost
            assert (await sb.exec("echo alive")).observation.exec.stdout == b"alive\n"
    run(main())


def test_async_ledger(server):
    server.require_ledger()

    async def main():
        async with AsyncClient(server.addr) as c:
            run_name = f"arun-{uuid.uuid4().hex[:8]}"
            async with await c.reset("shell", run=run_name) as sb:
                await sb.exec("echo x", checkpoint=True)
                ep = sb.episode_id
            deadline = time.monotonic() + 15
            while True:
                eps = [e async for e in c.iter_episodes(run=run_name)]
                tr = await c.get_trajectory(ep)
                if eps and len(tr.steps) == 1 and tr.episode.end_time.seconds > 0:
                    break
                assert time.monotonic() < deadline, "ledger did not record the episode"
                await asyncio.sleep(0.05)
            assert [e.episode_id for e in eps] == [ep]
            assert (await c.list_episodes(run=run_name)).episodes[0].episode_id == ep
            assert tr.steps[0].checkpoint_id
            nodes = await c.get_checkpoint_tree(episode_id=ep)
            assert tr.steps[0].checkpoint_id in {n.checkpoint_id for n in nodes}
            assert (await c.get_checkpoint_tree(run=run_name))
            await c.report_reward(ep, "score", 2.0, source="aio")
            gid = tr.episode.group_id
            if gid:
                adv = await c.get_group_advantages(gid, reward_source="aio")
                assert ep in {a.episode_id for a in adv.advantages}
    run(main())
