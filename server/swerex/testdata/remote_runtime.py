"""Drives a deltagym sandbox with swe-rex's own RemoteRuntime, unchanged.

Usage: python remote_runtime.py HOST_URL TOKEN WORKDIR
HOST_URL is http://HOST:PORT/swerex/SANDBOX_ID. Exits non-zero, saying why, on the first
behaviour that is not SWE-ReX's.
"""

import asyncio
import os
import sys
from pathlib import Path

from swerex.exceptions import (
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime


async def raises(exc, coro, contains=""):
    try:
        got = await coro
    except exc as e:
        assert contains in str(e), f"{type(e).__name__} says {str(e)!r}, not {contains!r}"
        return e
    raise AssertionError(f"expected {exc.__name__}, got {got!r}")


async def sessions(rt):
    await rt.create_session(CreateBashSessionRequest())
    await raises(SessionExistsError, rt.create_session(CreateBashSessionRequest()), "already exists")

    async def run(cmd, **kw):
        return await rt.run_in_session(BashAction(command=cmd, **kw))

    # cd and exports persist.
    await run("cd /tmp && export FOO=bar")
    obs = await run("pwd; echo $FOO")
    assert obs.output == "/tmp\nbar\n" and obs.exit_code == 0, obs
    assert obs.expect_string == "SHELLPS1PREFIX", obs
    # Exit codes and checks.
    obs = await run("(exit 3)", check="silent")
    assert obs.exit_code == 3, obs
    obs = await run("false", check="ignore")
    assert obs.exit_code is None, obs
    await raises(NonZeroExitCodeError, run("echo out; false", error_msg="it failed"), "it failed: Command 'echo out; false' failed with exit code 1")
    # A timeout raises, and the session goes on.
    await raises(CommandTimeoutError, run("sleep 30", timeout=0.5), "timeout after 0.5 seconds")
    obs = await run("echo alive; pwd")
    assert obs.output == "alive\n/tmp\n", obs

    # An interactive program reads the session's input: expect, input, interrupt, quit.
    obs = await run("python3 -i -q", is_interactive_command=True, expect=[">>> "], timeout=20)
    assert obs.expect_string == ">>> " and obs.exit_code == 0, obs
    await run("x = 6 * 7", is_interactive_command=True, expect=[">>> "], timeout=10)
    obs = await run("print(x)", is_interactive_command=True, expect=[">>> "], timeout=10)
    assert obs.output == "42", obs
    await raises(CommandTimeoutError, run("import time; time.sleep(100)", is_interactive_command=True, expect=[">>> "], timeout=0.5))
    obs = await rt.run_in_session(BashInterruptAction(expect=[">>> "], timeout=2))
    assert "KeyboardInterrupt" in obs.output and obs.expect_string == ">>> ", obs
    obs = await run("print(x + 1)", is_interactive_command=True, expect=[">>> "], timeout=10)
    assert obs.output == "43", obs
    obs = await run("exit()", is_interactive_quit=True, timeout=10)
    assert obs.expect_string == "SHELLPS1PREFIX", obs
    obs = await run("echo back in $(pwd)")
    assert obs.output == "back in /tmp\n", obs

    await rt.close_session(CloseBashSessionRequest())
    await raises(SessionDoesNotExistError, run("echo gone"), "does not exist")
    # A session of the same name starts afresh.
    await rt.create_session(CreateBashSessionRequest(session="second"))
    obs = await rt.run_in_session(BashAction(command="pwd; echo ${FOO:-unset}", session="second"))
    assert obs.output == "/work\nunset\n", obs


async def files(rt, workdir):
    await rt.write_file(WriteFileRequest(path="/work/notes/a.txt", content="hello\nwörld\n"))
    got = await rt.read_file(ReadFileRequest(path="/work/notes/a.txt"))
    assert got.content == "hello\nwörld\n", got
    await raises(FileNotFoundError, rt.read_file(ReadFileRequest(path="/work/missing.txt")), "No such file")
    await raises(ValueError, rt.read_file(ReadFileRequest(path="notes/a.txt")), "not an absolute path")

    src = Path(workdir) / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a.txt").write_text("A\n")
    (src / "sub" / "b.sh").write_text("#!/bin/sh\necho B\n")
    os.chmod(src / "sub" / "b.sh", 0o755)
    await rt.upload(UploadRequest(source_path=str(src), target_path="/work/up"))
    single = Path(workdir) / "single.txt"
    single.write_text("one file\n")
    await rt.upload(UploadRequest(source_path=str(single), target_path="/work/single/copy.txt"))

    r = await rt.execute(Command(command="cd /work/up && find . | sort && sub/b.sh && cat /work/single/copy.txt", shell=True))
    assert r.stdout == ".\n./a.txt\n./empty\n./sub\n./sub/b.sh\nB\none file\n" and r.exit_code == 0, r


async def execute(rt):
    r = await rt.execute(Command(command=["echo", "hi"]))
    assert r.stdout == "hi\n" and r.stderr == "" and r.exit_code == 0, r
    r = await rt.execute(Command(command="echo $GREETING >&2; pwd; exit 4", shell=True, env={"GREETING": "hey"}, cwd="/tmp"))
    assert r.stdout == "/tmp\n" and r.stderr == "hey\n" and r.exit_code == 4, r
    r = await rt.execute(Command(command="echo a; echo b >&2", shell=True, merge_output_streams=True))
    assert sorted(r.stdout.splitlines()) == ["a", "b"] and r.stderr == "", r
    await raises(NonZeroExitCodeError, rt.execute(Command(command=["false"], check=True)), "Command ['false'] failed with exit code 1")
    await raises(FileNotFoundError, rt.execute(Command(command=["no-such-program"])))
    await raises(CommandTimeoutError, rt.execute(Command(command=["sleep", "30"], timeout=0.5)), "Timeout (0.5s)")


async def main(host, token, workdir):
    rt = RemoteRuntime(host=host, port=None, auth_token=token, timeout=10)
    assert (await rt.is_alive()).is_alive
    await sessions(rt)
    await files(rt, workdir)
    await execute(rt)
    await rt.close()
    # The client's is_alive turns the server's exception into its answer.
    alive = await rt.is_alive()
    assert not alive.is_alive and "sandbox closed" in alive.message, alive
    await raises(SwerexException, rt.execute(Command(command=["true"])), "sandbox closed")
    bad = RemoteRuntime(host=host, port=None, auth_token="wrong", timeout=10)
    await raises(PermissionError, bad.execute(Command(command=["true"])), "missing or wrong token")
    print("ok")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
