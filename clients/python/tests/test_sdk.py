"""The typed SDK (Sandbox, AsyncSandbox) against the real server the
conftest fixture starts. Tests of file, streaming, process, setup, lease
and error-reason features need a server with those features."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

import deltagym
from deltagym import errors
from deltagym.aio import AsyncSandbox


@pytest.fixture
def sb(server):
    with deltagym.Sandbox.create("shell", addr=server.addr, timeout=60) as s:
        yield s


def test_create_run_check(sb):
    assert sb.env == "shell" and sb.id and sb.episode_id and sb.start_checkpoint.id
    r = sb.run("echo hi; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("hi\n", "err\n", 0, True)
    assert r.step.episode_id == sb.episode_id and not r.step.setup and r.duration >= 0
    assert sb.run(["printf", "%s", "a b"]).stdout == "a b"
    assert sb.run("cat", stdin="piped").stdout == "piped"
    assert sb.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.run("echo $X", env={"X": "y"}).stdout == "y\n"
    with pytest.raises(errors.CommandExitError) as e:
        sb.run("exit 3", check=True)
    assert e.value.result.exit_code == 3
    t = sb.run("sleep 5", timeout=0.5)
    assert t.timed_out and not t.ok


def test_sessions_keep_state(sb):
    sb.run("cd /tmp && X=7", session="main")
    assert sb.run("echo $PWD $X", session="main").stdout == "/tmp 7\n"


def test_connect(server, sb):
    with deltagym.Sandbox.connect(sb.id, addr=server.addr) as other:
        assert other.env == "shell" and other.episode_id == sb.episode_id
        assert other.run("echo via-connect").stdout == "via-connect\n"
        other.detach()
    assert sb.is_alive()
    with pytest.raises(errors.SandboxNotFound):
        deltagym.Sandbox.connect("no-such-sandbox", addr=server.addr)


def test_episode_checkpoint_restore_fork(sb):
    sb.files.write("/work/answer.txt", "41\n")
    ck = sb.checkpoint()
    assert ck.id
    sb.files.write("/work/answer.txt", "42\n")
    assert sb.evaluate().reward == 1.0
    res = sb.submit()
    assert res.reward == 1.0 and res.step.terminated
    with pytest.raises(errors.FailedPrecondition):
        sb.run("true")
    r = sb.restore(ck)
    assert r.episode_id == sb.episode_id
    assert sb.files.read("/work/answer.txt") == "41\n"
    kids = sb.fork(2)
    try:
        assert all(k.files.read("/work/answer.txt") == "41\n" for k in kids)
    finally:
        for k in kids:
            k.close()
    more = deltagym.Sandbox.fork_from(ck, 1, client=sb.client)
    try:
        assert more[0].files.read("/work/answer.txt") == "41\n"
    finally:
        more[0].close()


def test_streaming(sb):
    got: list[str] = []
    r = sb.run("for i in 1 2 3; do echo $i; done; echo e >&2", on_stdout=got.append)
    assert "".join(got) == "1\n2\n3\n" and r.stdout == "1\n2\n3\n" and r.stderr == "e\n"
    with sb.stream("echo a; echo b >&2") as s:
        chunks = list(s)
        assert s.result.ok
    assert {c.stream for c in chunks} == {"stdout", "stderr"}


def test_files(tmp_path: Path, sb):
    assert sb.files.write("/work/f.txt", "hello") == 5
    assert sb.files.read("/work/f.txt") == "hello"
    assert sb.files.write("/work/f.txt", " world", append=True) == 11
    big = os.urandom(3 << 20)
    sb.files.write("/work/big.bin", big)
    assert sb.files.read_bytes("/work/big.bin") == big  # read in parts past the output cap
    assert sb.files.mkdir("/work/d/e") is True
    st = sb.files.stat("/work/f.txt")
    assert st is not None and st.type == "file" and st.size == 11
    assert sb.files.stat("/work/none") is None and not sb.files.exists("/work/none")
    names = [f.path for f in sb.files.list("/work")]
    assert "f.txt" in names and "d" in names
    with pytest.raises(errors.ActionFailed) as e:
        sb.files.read("/work/none")
    assert e.value.errno_name == "ENOENT"
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("print(1)\n")
    sb.files.upload(str(src), "/work/up")
    assert sb.files.read("/work/up/src/pkg/m.py") == "print(1)\n"
    paths = sb.files.download("/work/up/src", str(tmp_path / "back"))
    assert (tmp_path / "back/src/pkg/m.py").read_text() == "print(1)\n" and paths
    assert sb.files.remove("/work/d", recursive=True) >= 2


def test_download_of_hostile_trees(tmp_path: Path, sb):
    # The sandbox's own links come down as links when they stay inside...
    sb.run("mkdir -p /work/t/sub && echo x > /work/t/sub/f && ln -s sub/f /work/t/ok", check=True)
    sb.files.download("/work/t", str(tmp_path / "good"))
    assert (tmp_path / "good/t/ok").read_text() == "x\n" and os.path.islink(tmp_path / "good/t/ok")
    # ... and a link that leads out of the directory refuses the archive, writing nothing.
    for target in ("/etc/passwd", "../../../../etc/passwd"):
        sb.run(f"rm -rf /work/h && mkdir -p /work/h && echo y > /work/h/a && ln -s {target} /work/h/evil", check=True)
        out = tmp_path / "bad"
        with pytest.raises(errors.UnsafeArchiveError):
            sb.files.download("/work/h", str(out))
        assert not out.exists() or not any(out.iterdir())


def test_processes(sb):
    p = sb.processes.start("sleep 300")
    assert p.pid > 1
    assert any(x.pid == p.pid and "sleep" in " ".join(x.argv) for x in sb.processes.list())
    p.kill()
    sb.run("sleep 0.2")  # the killed process is reaped by the sandbox's init
    assert all(x.pid != p.pid or x.state == "Z" for x in sb.processes.list())
    with pytest.raises(errors.ActionFailed):
        sb.processes.kill(99999)


def test_interactive_process(sb):
    prompt = [r"> $"]
    p = sb.processes.start("""sh -c 'while printf "ask> "; read -r l; do echo "got $l"; done'""", stdin=True,
                           expect=prompt, timeout=10)
    assert p.result.running and p.result.matched == prompt[0] and p.result.stdout.startswith("ask")
    r = p.send("hello", expect=prompt, timeout=10)
    assert "got hello" in r.stdout and r.running
    stopped = p.interrupt(timeout=10)  # the loop dies of SIGINT: the step returns as it ends
    assert stopped is not None and not stopped.running and not p.running
    with pytest.raises(errors.ProcessEnded):
        p.send("into the shell?")


# A REPL that asks again after Ctrl-C (the trap runs once read returns) and ends at the end of its input.
REPL = """intr=0
trap 'intr=1; printf "interrupted\\nask> "' INT
printf 'ask> '
while :; do
  read -r l; s=$?
  if [ $s -eq 0 ]; then echo "got $l"; printf 'ask> '; elif [ $intr -eq 1 ]; then intr=0; else exit; fi
done
"""


def test_interrupt_waits_for_the_prompt(sb):
    sb.files.write("/tmp/repl.sh", REPL)
    p = sb.processes.start("sh /tmp/repl.sh", stdin=True, expect=[r"ask> $"], timeout=10)
    assert p.running and p.result.matched == "ask> $"
    back = p.interrupt(timeout=10)  # start's prompt: the program lives on and asks again
    assert back is not None and back.running and back.matched == "ask> $" and "interrupted" in back.stdout
    assert "got again" in p.send("again", timeout=10).stdout
    killed = p.interrupt(expect=(), timeout=1)  # no prompt to wait for: killed when the timeout passes
    assert killed is not None and not killed.running and not p.running
    with pytest.raises(errors.ProcessEnded):
        p.send("into the shell?")
    assert sb.run("echo still here", session=p.session).stdout == "still here\n"


def test_setup_steps(sb):
    with sb.setup():
        r = sb.run("echo setup")
        assert r.step.setup
    assert not sb.run("echo agent").step.setup
    with pytest.raises(errors.InvalidArgument):
        sb.client.step(sb.id, deltagym.actions.submit(), setup=True)  # a submit is never a setup step


def test_setup_threads(sb):
    results: dict[str, bool] = {}

    def other() -> None:
        results["other"] = sb.run("echo other").step.setup

    with sb.setup():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        results["mine"] = sb.run("echo mine").step.setup
    assert results == {"other": False, "mine": True}


def test_observation(server):
    with deltagym.Sandbox.create("shell", addr=server.addr, seed=7) as s:
        assert s.task == "Write 42 to /work/answer.txt, then submit."
        assert s.observation == s.task + "\nseed=7 who=nobody\n"  # the reset hook's output too


def test_lease(server):
    with deltagym.Sandbox.create("shell", addr=server.addr, lease_ttl=30) as s:
        first = s.lease_expires_at
        assert first is not None
        later = s.extend_lease(600)
        assert later is not None and later > first + 300
        info = s.describe()
        assert info.lease_expires_at is not None and info.lease_expires_at > first + 300
    with pytest.raises(errors.InvalidArgument):
        deltagym.Sandbox.create("shell", addr=server.addr, lease_ttl=10 ** 9)


def test_errors(server, sb):
    with pytest.raises(errors.EnvNotFound) as e:
        deltagym.Sandbox.create("no-such-env", addr=server.addr)
    assert e.value.reason == "ENV_NOT_FOUND"
    with pytest.raises(errors.CheckpointNotFound):
        sb.restore("no-such-checkpoint")
    reqs = [deltagym.env_service_pb2.StepRequest(sandbox_id="no-such-sandbox", action=deltagym.actions.command("true"))]
    (gone,) = sb.client.step_stream(reqs)
    assert isinstance(gone, errors.SandboxNotFound) and gone.reason == "SANDBOX_NOT_FOUND"
    with pytest.raises(errors.Timeout):
        sb.step("sleep 5", timeout=0.5)  # the call's deadline, shorter than the command


def test_async(server):
    async def main() -> None:
        async with await AsyncSandbox.create("shell", addr=server.addr, timeout=60) as s:
            assert (await s.run("echo hi")).stdout == "hi\n"
            got: list[str] = []

            async def cb(text: str) -> None:
                got.append(text)

            await s.run("echo a; echo b", on_stdout=cb)
            assert "".join(got) == "a\nb\n"
            assert await s.files.write("/work/x", "1") == 1
            assert await s.files.read("/work/x") == "1"
            ck = await s.checkpoint()
            kids = await s.fork(1)
            assert await kids[0].files.read("/work/x") == "1"
            await kids[0].close()
            await s.restore(ck)

    asyncio.run(main())
