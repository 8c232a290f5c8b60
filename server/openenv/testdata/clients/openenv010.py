"""openenv 0.10.0's clients, unchanged, against a deltagym env served at /openenv/{env}.

Usage: python openenv010.py BASE_URL [TOKEN]   (BASE_URL like http://127.0.0.1:PORT/openenv/shell)

Flows: AutoEnv + sync GenericEnvClient (reset, exec, write/read, state, checkpoint, restore,
evaluate, submit, reset again); async GenericEnvClient with 3 concurrent sessions forked from
one checkpoint by reset(checkpoint_id=…, group_id=…); MCPToolClient (session, tools/list,
tools/call); bad actions → VALIDATION_ERROR on a socket that stays usable; raw frames →
INVALID_JSON, UNKNOWN_TYPE, and `close` ends the session; with a token, requests without it
(or with a wrong one) are refused. Prints one JSON line; exits 1 on any mismatch.
"""

import asyncio
import contextlib
import json
import uuid

import websockets.sync.client
from openenv import AutoEnv, GenericEnvClient
from openenv.core import MCPToolClient
from openenv.core.utils import convert_to_ws_url

from oecommon import (
    SCRATCH, Mismatch, Report, act_checkpoint, act_command, act_evaluate, act_read, act_restore,
    act_write, args, bearer, check, expect_error, ids, meta, number, ongoing, prefixed, stdout,
)

TOOLS = {"bash", "write_file", "read_file", "submit", "checkpoint", "restore"}


def sync_flow(r, url, token):
    """AutoEnv from the URL (its health probe sends no headers: the /t/<token>/ prefix), sync."""
    client = AutoEnv.from_env("deltagym", base_url=prefixed(url, token), skip_install=True)
    check(isinstance(client, GenericEnvClient), "AutoEnv gives a GenericEnvClient", type(client))
    f = SCRATCH + "/oe010_sync.txt"
    with client.sync() as env:
        first = env.reset()
        ongoing(first, "reset")
        sid, ep = ids(first.observation)
        r.saw(first.observation)
        start_ckpt = meta(first.observation).get("checkpoint_id")
        check(isinstance(start_ckpt, str) and start_ckpt, "reset: metadata.checkpoint_id", start_ckpt)
        r.ok("sync reset")

        res = env.step(act_command("echo hi"))
        ongoing(res, "exec")
        check(stdout(res, "exec") == "hi\n", "exec: stdout is the command's output, as text", res.observation)
        check(ids(res.observation) == (sid, ep), "exec: same sandbox and episode", meta(res.observation))
        check(number(res.reward) or res.reward is None, "exec: reward is a number or null", res.reward)
        r.ok("sync exec")

        ongoing(env.step(act_write(f, "one")), "write_file")
        res = env.step(act_read(f))
        ongoing(res, "read_file")
        check(res.observation.get("content") == "one", "read_file: content as text", res.observation)
        r.ok("sync write_file/read_file")

        state = env.state()
        check(state.get("episode_id") == ep, "state: episode_id", state)
        check(state.get("step_count") == 3, "state: step_count counts the steps", state)
        r.ok("sync state")

        res = env.step(act_checkpoint())
        ongoing(res, "checkpoint")
        ckpt = meta(res.observation).get("checkpoint_id")
        check(isinstance(ckpt, str) and ckpt and ckpt != start_ckpt, "checkpoint: a new checkpoint_id", ckpt)
        env.step(act_command("echo two > " + f))
        check(stdout(env.step(act_command("cat " + f)), "cat") == "two\n", "the file changed after the checkpoint")
        res = env.step(act_restore(ckpt))
        ongoing(res, "restore")
        rsid, rep = ids(res.observation)
        check(rsid == sid, "restore: same sandbox", rsid)
        check(rep != ep, "restore: starts a new episode", rep)
        check(stdout(env.step(act_command("cat " + f)), "cat") == "one", "restore: the file is as checkpointed")
        r.ok("sync checkpoint/restore")

        res = env.step(act_command("echo three > " + f, checkpoint=True))
        ongoing(res, "exec with checkpoint")
        ckpt2 = meta(res.observation).get("checkpoint_id")
        check(isinstance(ckpt2, str) and ckpt2 and ckpt2 not in (ckpt, start_ckpt),
              "checkpoint: true on a command returns a new checkpoint_id", ckpt2)
        r.ok("sync checkpoint on a command")

        res = env.step(act_evaluate())
        ongoing(res, "evaluate")
        check(number(res.reward), "evaluate: reward is a number", res.reward)
        r.ok("sync evaluate")

        res = env.step(act_command("submit"))
        check(res.done is True, "submit: done", res.done)
        m = meta(res.observation)
        check(m.get("terminated") is True and m.get("truncated") is False, "submit: terminated, not truncated", m)
        check(number(res.reward), "submit: reward is a number", res.reward)
        r.ok("sync submit")

        again = env.reset()
        ongoing(again, "second reset")
        asid, aep = ids(again.observation)
        check(asid == sid, "second reset: the socket keeps its sandbox", asid)
        check(aep not in (ep, rep), "second reset: a new episode", aep)
        res = env.step(act_command("cat " + f))
        check(res.observation.get("exit_code") not in (0, None), "second reset: back at the start (no file)",
              res.observation)
        r.ok("sync reset after submit")


def bad_actions(r, url, headers):
    """Invalid actions answer VALIDATION_ERROR; the socket and the episode go on."""
    with GenericEnvClient(base_url=url, headers=headers).sync() as env:
        r.saw(env.reset().observation)
        f = SCRATCH + "/oe010_bad.txt"
        bad = [
            ({}, "no command"),
            ({"command": ""}, "empty command alone"),
            ({"command": 7}, "command not a string"),
            ({"command": "", "write_file": {"path": f, "content": "x"}, "read_file": {"path": f}},
             "two actions at once"),
        ]
        for action, what in bad:
            expect_error(lambda a=action: env.step(a), "VALIDATION_ERROR", what)
        state = env.state()
        check(state.get("step_count") == 0, "rejected actions are not steps", state)
        check(stdout(env.step(act_command("echo ok")), "exec") == "ok\n", "the socket works after errors")
        r.ok("bad actions -> VALIDATION_ERROR")


async def async_flow(r, url, headers):
    """The async client; 3 concurrent sessions forked from one checkpoint."""
    f = SCRATCH + "/oe010_fork.txt"
    async with contextlib.AsyncExitStack() as stack:
        parent = await stack.enter_async_context(GenericEnvClient(base_url=url, headers=headers))
        res = await parent.reset()
        ongoing(res, "async reset")
        psid, pep = ids(res.observation)
        r.saw(res.observation)
        await parent.step(act_write(f, "parent"))
        res = await parent.step(act_checkpoint())
        ckpt = meta(res.observation).get("checkpoint_id")
        check(isinstance(ckpt, str) and ckpt, "async checkpoint: checkpoint_id", ckpt)
        state = await parent.state()
        # A checkpoint alone is no step: one step (the write) so far.
        check(state.get("episode_id") == pep and state.get("step_count") == 1, "async state", state)
        r.ok("async reset/step/state/checkpoint")

        group = "oe010-" + uuid.uuid4().hex[:8]
        kids = [GenericEnvClient(base_url=url, headers=headers) for _ in range(3)]
        for k in kids:
            await stack.enter_async_context(k)
        starts = await asyncio.gather(*(k.reset(checkpoint_id=ckpt, group_id=group) for k in kids))
        kid_ids = []
        for s in starts:
            ongoing(s, "forked reset")
            kid_ids.append(ids(s.observation))
            r.saw(s.observation)
        sids = {s for s, _ in kid_ids}
        eps = {e for _, e in kid_ids}
        check(len(sids) == 3 and psid not in sids, "forks: 3 sandboxes of their own", kid_ids)
        check(len(eps) == 3 and pep not in eps, "forks: 3 episodes of their own", kid_ids)
        outs = await asyncio.gather(*(k.step(act_command("cat " + f)) for k in kids))
        check([stdout(o, "cat") for o in outs] == ["parent"] * 3, "forks start at the checkpoint")
        await asyncio.gather(*(k.step(act_write(f, "child-%d" % i)) for i, k in enumerate(kids)))
        outs = await asyncio.gather(*(k.step(act_read(f)) for k in kids))
        got = [o.observation.get("content") for o in outs]
        check(got == ["child-%d" % i for i in range(3)], "forks are isolated from each other", got)
        res = await parent.step(act_command("cat " + f))
        check(stdout(res, "cat") == "parent", "the parent is untouched by its forks", res.observation)
        r.ok("3 concurrent forks via reset(checkpoint_id, group_id)")


def mcp_flow(r, url, headers):
    """MCPToolClient: HTTP /mcp session, tools/list, tools/call; WS attached with ?session_id=."""
    f = SCRATCH + "/oe010_mcp.txt"
    with MCPToolClient(base_url=url, headers=headers).sync() as m:
        first = m.reset()
        check(isinstance(first.observation.metadata, dict) and first.observation.metadata.get("sandbox_id"),
              "mcp reset: metadata.sandbox_id", first.observation.metadata)
        r.sandboxes.add(first.observation.metadata["sandbox_id"])
        tools = m.list_tools()
        names = {t.name for t in tools}
        check(TOOLS <= names, "tools/list offers the actions as tools", sorted(names))
        for t in tools:
            check(isinstance(t.input_schema, dict) and t.input_schema.get("type") == "object",
                  "tool %s: an object input schema" % t.name, t.input_schema)
        r.ok("mcp tools/list")

        out = m.call_tool("bash", command="echo mcp")
        check(isinstance(out, dict) and out.get("stdout") == "mcp\n", "bash tool: stdout", out)
        check(out.get("metadata", {}).get("sandbox_id") == first.observation.metadata["sandbox_id"],
              "tools act on the session's sandbox", out)
        m.call_tool("write_file", path=f, content="m1")
        out = m.call_tool("read_file", path=f)
        check(out.get("content") == "m1", "read_file tool: content", out)
        out = m.call_tool("checkpoint")
        ckpt = out.get("metadata", {}).get("checkpoint_id")
        check(isinstance(ckpt, str) and ckpt, "checkpoint tool: checkpoint_id", out)
        m.call_tool("bash", command="echo m2 > " + f)
        m.call_tool("restore", checkpoint_id=ckpt)
        out = m.call_tool("read_file", path=f)
        check(out.get("content") == "m1", "restore tool: the file is as checkpointed", out)
        try:
            m.call_tool("no_such_tool")
        except RuntimeError as e:
            check("no_such_tool" in str(e), "unknown tool: a JSON-RPC error", str(e))
        else:
            raise Mismatch("unknown tool: no error")
        out = m.call_tool("submit")
        check(out.get("metadata", {}).get("terminated") is True, "submit tool: terminated", out)
        r.ok("mcp tools/call: bash, write_file, read_file, checkpoint, restore, submit")


def raw_frames(r, url, headers):
    """Frames no client sends on purpose: bad JSON, unknown types; `close` ends the session."""
    ws_url = convert_to_ws_url(url) + "/ws"
    with websockets.sync.client.connect(ws_url, additional_headers=headers, open_timeout=10) as ws:
        def ask(frame):
            ws.send(frame)
            return json.loads(ws.recv(timeout=60))

        for frame, code in (("not json", "INVALID_JSON"), (json.dumps({"type": "bogus"}), "UNKNOWN_TYPE")):
            ans = ask(frame)
            check(ans.get("type") == "error" and ans.get("data", {}).get("code") == code,
                  "%r -> %s" % (frame, code), ans)
            check(isinstance(ans["data"].get("message"), str), "error frames carry a message", ans)
        ans = ask(json.dumps({"type": "reset", "data": {}}))
        check(ans.get("type") == "observation", "reset answers an observation frame", ans)
        data = ans.get("data", {})
        check(set(data) >= {"observation", "reward", "done"}, "observation frame fields", data)
        r.saw(data["observation"])
        ans = ask(json.dumps({"type": "state"}))
        check(ans.get("type") == "state" and ans["data"].get("step_count") == 0, "state frame", ans)
        ws.send(json.dumps({"type": "close"}))
        try:
            extra = ws.recv(timeout=10)
        except websockets.exceptions.ConnectionClosed:
            pass
        else:
            raise Mismatch("close: the server answered instead of closing: %r" % (extra,))
        r.ok("raw frames: INVALID_JSON, UNKNOWN_TYPE, close")


def refused(client, what):
    """client's connect must fail: the server refused it."""
    try:
        client.connect()
    except Exception as e:  # noqa: BLE001 — ConnectionError (upgrade) or httpx.HTTPStatusError (/mcp)
        return str(e)
    finally:
        client.close()
    raise Mismatch("%s: connected" % what)


def auth_refused(r, url, token):
    """With auth on: no token, or a wrong one, is refused on the upgrade and on /mcp."""
    for headers, what in ((None, "no token"), (bearer(token + "x"), "a wrong token")):
        err = refused(GenericEnvClient(base_url=url, headers=headers).sync(), "websocket with " + what)
        check(err.startswith("Failed to connect") and "401" in err, "websocket with %s: HTTP 401" % what, err)
    err = refused(GenericEnvClient(base_url=prefixed(url, token + "x")).sync(), "a wrong URL-prefix token")
    check("401" in err, "websocket with a wrong URL-prefix token: HTTP 401", err)
    err = refused(MCPToolClient(base_url=url).sync(), "/mcp without a token")
    check("401" in err, "/mcp without a token: HTTP 401", err)
    r.ok("auth: refused without the token")


def main(r):
    url, token = args(r)
    headers = bearer(token)
    sync_flow(r, url, token)
    bad_actions(r, url, headers)
    asyncio.run(async_flow(r, url, headers))
    mcp_flow(r, url, headers)
    raw_frames(r, url, headers)
    if token:
        auth_refused(r, url, token)


if __name__ == "__main__":
    Report("openenv 0.10.0").run(main)
