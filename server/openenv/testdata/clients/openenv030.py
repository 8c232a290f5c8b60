"""openenv-core 0.3.0's clients, unchanged, against a deltagym env served at /openenv/{env}.

Usage: python openenv030.py BASE_URL [TOKEN]   (BASE_URL like http://127.0.0.1:PORT/openenv/shell)

0.3.0 sends no headers: the token travels in the /t/<token>/ URL prefix. Flows: AutoEnv + sync
GenericEnvClient (reset, exec, write/read, state, checkpoint, restore, evaluate, submit); the
async client (reset, step, state); with a token, the plain URL and a wrong prefix are refused.
Prints one JSON line; exits 1 on any mismatch.
"""

import asyncio

from openenv import AutoEnv, GenericEnvClient

from oecommon import (
    SCRATCH, Mismatch, Report, act_checkpoint, act_command, act_evaluate, act_read, act_restore,
    act_write, args, check, ids, meta, number, ongoing, prefixed, stdout,
)


def sync_flow(r, base):
    client = AutoEnv.from_env("deltagym", base_url=base, skip_install=True)
    check(isinstance(client, GenericEnvClient), "AutoEnv gives a GenericEnvClient", type(client))
    f = SCRATCH + "/oe030.txt"
    with client.sync() as env:
        first = env.reset()
        ongoing(first, "reset")
        sid, ep = ids(first.observation)
        r.saw(first.observation)
        r.ok("sync reset")

        res = env.step(act_command("echo hi"))
        ongoing(res, "exec")
        check(stdout(res, "exec") == "hi\n", "exec: stdout is the command's output, as text", res.observation)
        check(ids(res.observation) == (sid, ep), "exec: same sandbox and episode", meta(res.observation))
        ongoing(env.step(act_write(f, "one")), "write_file")
        res = env.step(act_read(f))
        check(res.observation.get("content") == "one", "read_file: content as text", res.observation)
        r.ok("sync exec, write_file, read_file")

        state = env.state()
        check(state.get("episode_id") == ep and state.get("step_count") == 3, "state", state)
        r.ok("sync state")

        ckpt = meta(env.step(act_checkpoint()).observation).get("checkpoint_id")
        check(isinstance(ckpt, str) and ckpt, "checkpoint: checkpoint_id", ckpt)
        env.step(act_command("echo two > " + f))
        res = env.step(act_restore(ckpt))
        ongoing(res, "restore")
        check(ids(res.observation)[0] == sid, "restore: same sandbox", meta(res.observation))
        check(stdout(env.step(act_command("cat " + f)), "cat") == "one", "restore: the file is as checkpointed")
        r.ok("sync checkpoint/restore")

        res = env.step(act_evaluate())
        ongoing(res, "evaluate")
        check(number(res.reward), "evaluate: reward is a number", res.reward)
        res = env.step(act_command("submit"))
        check(res.done is True and meta(res.observation).get("terminated") is True, "submit: done, terminated",
              meta(res.observation))
        check(number(res.reward), "submit: reward is a number", res.reward)
        r.ok("sync evaluate, submit")


async def async_flow(r, base):
    async with GenericEnvClient(base_url=base) as env:
        res = await env.reset()
        ongoing(res, "async reset")
        _, ep = ids(res.observation)
        r.saw(res.observation)
        res = await env.step(act_command("echo async"))
        check(stdout(res, "exec") == "async\n", "async exec", res.observation)
        state = await env.state()
        check(state.get("episode_id") == ep and state.get("step_count") == 1, "async state", state)
    r.ok("async reset/step/state")


def refused(base, what):
    env = GenericEnvClient(base_url=base).sync()
    try:
        env.connect()
    except ConnectionError as e:
        check("401" in str(e), "%s: HTTP 401" % what, str(e))
        return
    finally:
        env.close()
    raise Mismatch("%s: connected" % what)


def main(r):
    url, token = args(r)
    base = prefixed(url, token)
    sync_flow(r, base)
    asyncio.run(async_flow(r, base))
    if token:
        refused(url, "no token")
        refused(prefixed(url, token + "x"), "a wrong URL-prefix token")
        r.ok("auth: refused without the token")


if __name__ == "__main__":
    Report("openenv-core 0.3.0").run(main)
