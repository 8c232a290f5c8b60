"""Unit tests of the typed SDK against the in-process fake server
(tests/fake_server.py): no deltagym server, no root."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
import os
import pickle
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import deltagym
from deltagym import _common, _convert, _ops, errors, raw
from deltagym.aio import AsyncSandbox
from deltagym.types import CommandResult, StepInfo

from .fake_server import FakeServer


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.stop()


@pytest.fixture
def sb(fake: FakeServer) -> Iterator[deltagym.Sandbox]:
    with deltagym.Sandbox.create("shell", addr=fake.addr, token="t", timeout=10) as s:
        yield s


def _tar(*entries: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for e in entries:
            if e.isreg():
                e.size = len(data)
                tf.addfile(e, io.BytesIO(data))
            else:
                tf.addfile(e)
    return buf.getvalue()


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type = kind
    t.linkname = link
    t.mode = 0o4755 if kind == tarfile.REGTYPE else 0o755
    return t


def test_create_run_typed(sb: deltagym.Sandbox) -> None:
    assert sb.task == "write 42" and sb.env == "shell" and sb.start_checkpoint.id == "ck-start"
    assert sb.observation == "write 42\nthe answer goes in /work/answer.txt\n"  # the task and the reset hook's output
    assert sb.lease_expires_at is not None
    r = sb.run("echo hi")
    assert isinstance(r, deltagym.CommandResult)
    assert (r.stdout, r.stdout_bytes, r.exit_code, r.ok, r.duration) == ("hi\n", b"hi\n", 0, True, 0.25)
    assert r.step.index == 1 and r.step.episode_id == sb.episode_id and r.step.steps_left == -1
    assert r.step.info == {"elapsed": 0.5, "count": 3, "flag": True, "who": "x"}
    assert not r.step.setup
    assert sb.run(["echo", "argv"]).stdout == "argv\n"


def test_check_raises_command_exit_error(sb: deltagym.Sandbox) -> None:
    r = sb.run("fail")
    assert not r.ok and r.exit_code == 1 and r.stderr == "boom\n"
    with pytest.raises(errors.CommandExitError) as e:
        sb.run("exit 3", check=True)
    assert e.value.result.exit_code == 3 and isinstance(e.value, errors.SandboxError)
    assert not isinstance(e.value, errors.DeltagymError)


def test_command_exit_error_says_what_failed(sb: deltagym.Sandbox) -> None:
    with pytest.raises(errors.CommandExitError) as e:
        sb.run("fail", check=True)
    assert str(e.value) == "command 'fail' exited with 1; stderr: boom\n" and e.value.command == "fail"
    long = "spew " + "x" * 300
    with pytest.raises(errors.CommandExitError) as e:
        sb.run(long, check=True)
    msg = str(e.value)
    assert msg.startswith("command '" + long[:197] + "...' exited with 2; stderr: ...")
    assert msg.endswith("noise\nlast words\n") and len(msg) < 200 + 500 + 60
    assert e.value.command == long  # the whole command stays on the error
    with pytest.raises(errors.CommandExitError) as e:
        sb.run(["spew", "it's"], check=True)
    assert e.value.command == "spew 'it'\"'\"'s'"
    with pytest.raises(errors.CommandExitError) as e:
        sb.run("hang", check=True)
    assert str(e.value) == "command 'hang' timed out after 1.5s; stdout: waiting\n"
    with pytest.raises(errors.CommandExitError) as e:
        sb.run("killed", check=True)
    assert str(e.value) == "command 'killed' was killed by signal 9 (SIGKILL)"


def test_action_error_raises_action_failed(sb: deltagym.Sandbox) -> None:
    with pytest.raises(errors.ActionFailed) as e:
        sb.run(["nosuchprogram"])
    assert e.value.errno_name == "ENOENT" and e.value.errno == 2
    res = sb.step(deltagym.actions.argv(["nosuchprogram"]))
    assert res.error is not None and res.error.errno_name == "ENOENT" and res.kind == ""


def test_error_reasons(sb: deltagym.Sandbox) -> None:
    with pytest.raises(errors.RateLimited) as e:
        sb.run("ratelimit")
    assert e.value.retry_after == 2.5 and e.value.reason == "RATE_LIMITED"
    assert e.value.metadata == {"retry_after_seconds": "2.5"} and isinstance(e.value, errors.ResourceExhausted)
    with pytest.raises(errors.NoCapacity):
        sb.run("nocapacity")
    with pytest.raises(errors.EpisodeEnded):
        sb.run("ended")
    with pytest.raises(errors.NotFound) as nf:  # an unknown reason: the status code's class
        sb.run("weird")
    assert type(nf.value) is errors.NotFound and nf.value.reason == "SOMETHING_NEW" and nf.value.metadata == {"k": "v"}
    with pytest.raises(errors.Internal) as inn:  # a reason of another status code does not change the class
        sb.run("mismatch")
    assert type(inn.value) is errors.Internal
    with pytest.raises(errors.CheckpointNotFound) as ck:
        sb.restore("nope")
    assert ck.value.metadata == {"checkpoint_id": "nope"}


def test_unknown_sandbox_and_env(fake: FakeServer) -> None:
    with pytest.raises(errors.SandboxNotFound) as e:
        deltagym.Sandbox.connect("missing", addr=fake.addr, token="t")
    assert e.value.metadata == {"sandbox_id": "missing"}
    with pytest.raises(errors.EnvNotFound):
        deltagym.Sandbox.create("nope", addr=fake.addr, token="t")


def test_timeout_is_timeout(sb: deltagym.Sandbox) -> None:
    with pytest.raises(errors.Timeout) as e:
        sb.step("block", timeout=0.3)
    assert isinstance(e.value, errors.DeadlineExceeded)
    assert sb.run("echo still").stdout == "still\n"


def test_command_deadline_has_margin(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    sb.run("echo a", timeout=100)
    sb.files.write("f", "x", timeout=2)
    long_, short = fake.service.deadlines[-2:]
    assert long_ is not None and long_ > 100  # the command's timeout plus the margin
    assert short is not None and short < 2.5 and long_ < 131


def test_setup_context_threads(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    inside = threading.Event()
    other_done = threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        inside.wait(10)
        seen["other"] = sb.run("echo other").step.setup
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with sb.setup():
        inside.set()
        assert other_done.wait(10)  # the other thread stepped while this one was in setup
        r = sb.run("echo setup")
        assert r.step.setup
        assert not sb.run("echo forced", setup=False).step.setup
        assert not sb.submit().step.setup  # never setup
    t.join()
    assert seen["other"] is False
    assert not sb.run("echo after").step.setup
    assert fake.service.setups.count(True) == 1


def test_setup_context_asyncio_tasks(fake: FakeServer) -> None:
    async def main() -> tuple[bool, bool, bool]:
        async with await AsyncSandbox.create("shell", addr=fake.addr, token="t") as sb:
            started = asyncio.Event()
            release = asyncio.Event()

            async def outside() -> bool:
                await started.wait()
                r = (await sb.run("echo out")).step.setup
                release.set()
                return r

            t = asyncio.create_task(outside())
            with sb.setup():
                child = asyncio.create_task(sb.run("echo child"))  # made inside: inherits setup
                started.set()
                await release.wait()
                mine = (await sb.run("echo mine")).step.setup
            return await t, (await child).step.setup, mine

    other, child, mine = asyncio.run(main())
    assert (other, child, mine) == (False, True, True)


def test_setup_async_with(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    async def main() -> list[bool]:
        async with await AsyncSandbox.create("shell", addr=fake.addr, token="t") as a:
            started = asyncio.Event()
            release = asyncio.Event()

            async def outside() -> bool:
                await started.wait()
                r = (await a.run("echo out")).step.setup
                release.set()
                return r

            t = asyncio.create_task(outside())
            ctx = a.setup()
            async with ctx:
                started.set()
                await release.wait()  # the other task ran its step meanwhile, not as setup
                inside = (await a.run("echo in")).step.setup
                async with ctx:  # the same context entered again, nested
                    nested = (await a.run("echo nested")).step.setup
                still = (await a.run("echo still")).step.setup
            after = (await a.run("echo after")).step.setup
            async with sb.setup():  # a Sandbox's too
                sync_inside = sb.run("echo sync").step.setup
            return [await t, inside, nested, still, after, sync_inside, sb.run("echo out").step.setup]

    assert asyncio.run(main()) == [False, True, True, True, False, True, False]


def test_streaming_callbacks_and_iterator(sb: deltagym.Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    r = sb.run("stream", on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "one\ncafé\n" and err == ["err\n"]
    assert out[-2:] == ["caf", "é\n"]  # the split character comes whole with the chunk that ends it
    assert r.stdout == "one\ncafé\n" and r.step.index >= 1
    with sb.stream("stream") as s:
        chunks = list(s)
        assert s.result.ok
    assert [c.stream for c in chunks] == ["stdout", "stderr", "stdout", "stdout"]
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == "one\ncafé\n".encode()


def test_async_streaming_async_callback(fake: FakeServer) -> None:
    async def main() -> tuple[list[str], str]:
        got: list[str] = []

        async def cb(text: str) -> None:
            await asyncio.sleep(0)
            got.append(text)

        async with await AsyncSandbox.create("shell", addr=fake.addr, token="t") as sb:
            r = await sb.run("stream", on_stdout=cb)
            async with sb.stream("stream") as s:
                texts = [c.text async for c in s]
                assert (await s.result()).ok
            return got, "".join(texts) + r.stdout

    got, joined = asyncio.run(main())
    assert "".join(got) == "one\ncafé\n" and joined.startswith("one\nerr\ncafé\n")


def test_files(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    assert sb.files.write("/w/a.txt", "hello, a longer text") == 20
    assert sb.files.read("/w/a.txt") == "hello, a longer text"  # three reads of READ_CAP bytes
    assert sb.files.write("/w/a.txt", b"!", append=True) == 21
    assert sb.files.read_bytes("/w/a.txt").endswith(b"!")
    st = sb.files.stat("/w/a.txt")
    assert st is not None and st.type == "file" and st.size == 21 and st.mode == 0o644
    assert sb.files.stat("/w/none") is None and not sb.files.exists("/w/none") and sb.files.exists("/w/a.txt")
    assert [f.path for f in sb.files.list("/w")] == ["a.txt"]
    assert sb.files.mkdir("/w/d") is True
    with pytest.raises(errors.ActionFailed):
        sb.files.read("/w/none")
    assert sb.files.remove("/w/a.txt") == 1 and sb.files.remove("/w/a.txt") == 0


def test_upload_and_download(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("print(1)\n")
    up = sb.files.upload(str(src), "/work")
    assert up.files == 3 and up.size == 9
    sbx = fake.service.sandboxes[sb.id]
    assert sbx.files["/work/src/pkg/m.py"] == b"print(1)\n"

    fake.service.tars["/work/src"] = _tar(_entry("src", tarfile.DIRTYPE), _entry("src/a.txt"),
                                          _entry("src/l", tarfile.SYMTYPE, "a.txt"),
                                          _entry("src/h", tarfile.LNKTYPE, "src/a.txt"))
    out = tmp_path / "out"
    paths = sb.files.download("/work/src", str(out))
    assert sorted(os.path.relpath(p, out) for p in paths) == ["src", "src/a.txt", "src/h", "src/l"]
    assert (out / "src/a.txt").read_bytes() == b"x" and os.readlink(out / "src/l") == "a.txt"
    assert (out / "src/a.txt").stat().st_mode & 0o7777 == 0o755  # setuid dropped


@pytest.mark.parametrize("entries", [
    [_entry("../evil")],
    [_entry("/etc/evil")],
    [_entry("a/../../evil")],
    [_entry("dev", tarfile.CHRTYPE)],
    [_entry("fifo", tarfile.FIFOTYPE)],
    [_entry("l", tarfile.SYMTYPE, "/etc")],
    [_entry("l", tarfile.SYMTYPE, "../..")],
    [_entry("l", tarfile.SYMTYPE, "x"), _entry("l/evil")],  # a write through the archive's own link
    [_entry("p", tarfile.SYMTYPE, "q/r"), _entry("q", tarfile.SYMTYPE, "."), _entry("r", tarfile.SYMTYPE, "..")],
    [_entry("s", tarfile.SYMTYPE, "d"), _entry("d", tarfile.SYMTYPE, "e/.."), _entry("e", tarfile.SYMTYPE, "..")],
    [_entry("h", tarfile.LNKTYPE, "/etc/passwd")],
    [_entry("h", tarfile.LNKTYPE, "notinarchive")],
])
def test_download_refuses_unsafe_archives(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox,
                                          entries: list[tarfile.TarInfo]) -> None:
    fake.service.tars["/x"] = _tar(*entries)
    out = tmp_path / "out"
    with pytest.raises(errors.UnsafeArchiveError):
        sb.files.download("/x", str(out))
    assert not out.exists() or not any(out.iterdir())  # nothing written
    assert not (tmp_path / "evil").exists()


def test_download_refuses_links_on_disk(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "src")
    fake.service.tars["/y"] = _tar(_entry("src/a.txt"))
    with pytest.raises(errors.UnsafeArchiveError):
        sb.files.download("/y", str(out))
    assert not (outside / "a.txt").exists()


def _reachable_outside(root: Path) -> list[str]:
    """The paths below root (links not followed) that resolve outside it."""
    real = os.path.realpath(root)
    bad = []
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            r = os.path.realpath(os.path.join(d, n))
            if r != real and not r.startswith(real + os.sep):
                bad.append(os.path.relpath(os.path.join(d, n), root))
    return bad


def _download(fake: FakeServer, sb: deltagym.Sandbox, out: Path, *entries: tarfile.TarInfo) -> list[str]:
    fake.service.tars["/t"] = _tar(*entries)
    return sb.files.download("/t", str(out))


def test_download_links_stay_inside_across_archives(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox) -> None:
    out = tmp_path / "out"
    with pytest.raises(errors.UnsafeArchiveError):  # climbs through d/b, which a later archive could make a link
        _download(fake, sb, out, _entry("a", tarfile.SYMTYPE, "d/b/../.."))
    assert not out.exists() or not any(out.iterdir())
    # Links that obey the rule, some dangling, then an archive that fills in their names with links.
    _download(fake, sb, out, _entry("d", tarfile.DIRTYPE), _entry("d/e", tarfile.DIRTYPE),
              _entry("x", tarfile.SYMTYPE, "d/b/c"), _entry("d/e/up", tarfile.SYMTYPE, "../../d/b"),
              _entry("d/e/f", tarfile.SYMTYPE, "../b/c/c/c"))
    _download(fake, sb, out, _entry("d", tarfile.DIRTYPE), _entry("d/b", tarfile.SYMTYPE, ".."),
              _entry("c", tarfile.SYMTYPE, "d/b"))
    assert os.path.realpath(out / "x") == os.path.realpath(out)  # x -> d/b/c = ../c -> d/b -> ..
    assert _reachable_outside(out) == []
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("entries", [
    [_entry("L", tarfile.SYMTYPE, "."), _entry("a", tarfile.SYMTYPE, "l/..")],  # one name on a case-insensitive disk
    [_entry("L", tarfile.SYMTYPE, "sub"), _entry("l/f")],
    [_entry("L", tarfile.SYMTYPE, "x"), _entry("l", tarfile.SYMTYPE, "y")],
    [_entry("A"), _entry("a", tarfile.DIRTYPE)],
    [_entry("d", tarfile.DIRTYPE), _entry("d/l", tarfile.SYMTYPE, "../..")],  # above its depth
    [_entry("l", tarfile.SYMTYPE, "")],
    [_entry("a"), _entry("a", tarfile.DIRTYPE)],  # a file, then a directory of its name
    [_entry("a", tarfile.DIRTYPE), _entry("a")],
    [_entry("a"), _entry("a/b")],
    [_entry("a"), _entry("a")],
    [_entry("a"), _entry("h", tarfile.LNKTYPE, "a"), _entry("h/b")],
    [_entry("l", tarfile.SYMTYPE, "x"), _entry("l", tarfile.SYMTYPE, "y")],
])
def test_download_refuses_conflicting_names(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox,
                                            entries: list[tarfile.TarInfo]) -> None:
    out = tmp_path / "out"
    with pytest.raises(errors.UnsafeArchiveError):
        _download(fake, sb, out, *entries)
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_download_accepts_links_within_their_depth(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox) -> None:
    out = tmp_path / "out"
    paths = _download(fake, sb, out, _entry("d", tarfile.DIRTYPE), _entry("d", tarfile.DIRTYPE), _entry("d/e/f"),
                      _entry("d/e/up", tarfile.SYMTYPE, "../../d/./e//f"), _entry("self", tarfile.SYMTYPE, "."),
                      _entry("Readme"), _entry("README"))
    assert sorted(os.path.relpath(p, out) for p in paths) == ["README", "Readme", "d", "d/e/f", "d/e/up", "self"]
    assert (out / "d/e/up").read_bytes() == b"x" and _reachable_outside(out) == []


def test_download_refuses_what_is_in_the_way_on_disk(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "f").write_text("mine")
    (out / "dir").mkdir()
    for entries in ([_entry("ok"), _entry("f/a")], [_entry("ok"), _entry("dir")],
                    [_entry("ok"), _entry("dir", tarfile.SYMTYPE, "f")], [_entry("ok"), _entry("f", tarfile.DIRTYPE)]):
        with pytest.raises(errors.UnsafeArchiveError):
            _download(fake, sb, out, *entries)
        assert sorted(os.listdir(out)) == ["dir", "f"] and not any((out / "dir").iterdir())
    assert (out / "f").read_text() == "mine"


def test_download_replaces_links_and_hard_links_with_new_files(tmp_path: Path, fake: FakeServer,
                                                               sb: deltagym.Sandbox) -> None:
    outside = tmp_path / "outside"
    outside.write_text("keep")
    outside.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "l")
    os.link(outside, out / "h")
    paths = _download(fake, sb, out, _entry("l"), _entry("h"))
    assert len(paths) == 2 and (out / "l").read_bytes() == b"x" and not (out / "l").is_symlink()
    assert (out / "h").read_bytes() == b"x" and (out / "h").stat().st_mode & 0o777 == 0o755
    assert outside.read_text() == "keep" and outside.stat().st_mode & 0o777 == 0o600


def test_download_sets_modes_by_descriptor(tmp_path: Path, fake: FakeServer, sb: deltagym.Sandbox,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_chmod(*a: object, **k: object) -> None:
        raise AssertionError("a mode set by path may follow a link swapped in after the open")

    monkeypatch.setattr(os, "chmod", no_chmod)
    out = tmp_path / "out"
    d = _entry("d", tarfile.DIRTYPE)
    d.mode = 0o500
    _download(fake, sb, out, d, _entry("d/f"))
    assert (out / "d").stat().st_mode & 0o777 == 0o700 and (out / "d/f").stat().st_mode & 0o7777 == 0o755


def test_download_removes_links_out_through_a_link_on_disk(tmp_path: Path, fake: FakeServer,
                                                           sb: deltagym.Sandbox) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "mine")  # the caller's own link
    with pytest.raises(errors.UnsafeArchiveError):
        _download(fake, sb, out, _entry("f"), _entry("ok", tarfile.SYMTYPE, "f"), _entry("l", tarfile.SYMTYPE, "mine"))
    assert sorted(os.listdir(out)) == ["f", "mine"] and os.readlink(out / "mine") == str(outside)
    assert _reachable_outside(out) == ["mine"] and not any(outside.iterdir())


def test_processes(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    p = sb.processes.start("sleep 100")
    assert p.pid == 42 and p.session == ""
    ps = sb.processes.list()
    assert ps[0].pid == 7 and ps[0].argv == ("sleep", "100") and ps[0].started_ago == 2.0
    p.kill()
    sb.processes.kill(7, 15, group=True)
    assert fake.service.signals == [(42, 9, False), (7, 15, True)]


def test_interactive_process(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    p = sb.processes.start("repl", stdin=True, expect=[r"> $"], timeout=5)
    assert p.session == "proc-1" and p.pid == 0 and p.result.running and p.result.matched == "> $"
    r = p.send("hello", expect=[r"> $"])
    assert r.stdout == "got hello\n> " and r.running
    x = fake.service.execs[-1]
    assert (x.command, x.session, x.interactive, list(x.expect), x.interrupt) == ("hello", "proc-1", True, ["> $"], False)
    back = p.interrupt()  # waits for start's patterns: the prompt shown again
    assert back is not None and back.running and back.matched == "> $" and p.running
    x = fake.service.execs[-1]
    assert (x.command, x.interactive, x.interrupt, list(x.expect)) == ("", True, True, ["> $"])
    assert p.send("again").stdout == "got again\n> " and list(fake.service.execs[-1].expect) == ["> $"]
    with pytest.raises(TypeError):
        p.send("x", expect="> ")  # type: ignore[arg-type]
    stopped = p.interrupt(expect=(), timeout=1)  # nothing to wait for: killed at the timeout
    assert stopped is not None and not stopped.running and stopped.signal == 9 and not p.running
    n = len(fake.service.execs)
    with pytest.raises(errors.ProcessEnded) as ended:
        p.send("typed into the shell?")
    assert len(fake.service.execs) == n and ended.value.session == "proc-1" and "signal 9 (SIGKILL)" in str(ended.value)
    with pytest.raises(ValueError):
        p.kill()  # its pid is the session's business
    q = sb.processes.start("other", stdin=True, session="mine")
    assert q.session == "mine"
    assert q.send("exit").exit_code == 0 and not q.running
    with pytest.raises(errors.ProcessEnded, match="'mine' exited with 0"):
        q.send("more")
    n = len(fake.service.execs)
    with pytest.raises(errors.ProcessEnded):
        q.interrupt()  # the session may run another program by now: not this handle's Ctrl-C
    assert len(fake.service.execs) == n
    bg = sb.processes.start("sleep 100")
    assert bg.interrupt() is None  # a background process gets SIGINT as a signal
    assert fake.service.signals[-1] == (42, 2, False) and bg.running
    bg.kill()
    assert not bg.running


def test_episode_calls(sb: deltagym.Sandbox) -> None:
    ck = sb.checkpoint(durable=True, process_mode="criu")
    assert ck.id == "ck-1" and not ck.durable and ck.not_durable == ("kept as a frozen template",)
    assert ck.processes[0].method == "template"
    old = sb.episode_id
    r = sb.restore(ck)
    assert r.next_step_index == 3 and sb.episode_id == r.episode_id != old
    ev = sb.evaluate()
    assert (ev.reward, dict(ev.components), ev.output) == (0.5, {"a": 0.5}, "half")
    sub = sb.submit("42")
    assert sub.reward == 1.0 and sub.step.terminated and sub.components == {"answer": 1.0}
    info = sb.describe()
    assert info.state == "ready" and info.id == sb.id and info.lease_expires_at is not None
    assert sb.is_alive()
    at = sb.extend_lease(600)
    assert at is not None and sb.handle.lease_ttl == 600
    with pytest.raises(ValueError):
        sb.extend_lease(-1)
    with pytest.raises(ValueError):
        sb.checkpoint(process_mode="bogus")  # type: ignore[arg-type]


def test_fork_shares_owned_client(fake: FakeServer) -> None:
    parent = deltagym.Sandbox.create("shell", addr=fake.addr, token="t")
    kids = parent.fork(2)
    assert len(kids) == 2 and all(k.env == "shell" and k.task == parent.task for k in kids)
    assert all(k.observation == "" for k in kids)  # no Reset of their own
    parent.close()
    assert kids[0].run("echo alive").stdout == "alive\n"  # the shared client stays open
    assert not parent.is_alive()
    for k in kids:
        k.close()
    with pytest.raises(ValueError):
        deltagym.Sandbox.fork_from("", 1, addr=fake.addr, token="t")
    more = deltagym.Sandbox.fork_from(deltagym.Checkpoint(id="ck-1"), 2, addr=fake.addr, token="t")
    assert len(more) == 2 and [m.env for m in more] == ["shell", "shell"]  # told by the first child's description
    assert fake.service.described == [more[0].id]
    for m in more:
        m.close()


def test_fork_from_knows_the_env(fake: FakeServer, sb: deltagym.Sandbox) -> None:
    ck = sb.checkpoint()
    assert ck.env == "shell" and sb.start_checkpoint.env == "shell"
    kids = deltagym.Sandbox.fork_from(ck, 2, client=sb.client)
    assert [k.env for k in kids] == ["shell", "shell"] and fake.service.described == []  # the checkpoint knew
    assert kids[0].start_checkpoint.env == "shell"
    by_id = deltagym.Sandbox.fork_from(ck.id, 1, client=sb.client)
    assert by_id[0].env == "shell" and fake.service.described == [by_id[0].id]
    for k in kids + by_id:
        k.close()

    async def main() -> None:
        async with await AsyncSandbox.create("shell", addr=fake.addr, token="t", timeout=10) as a:
            ack = await a.checkpoint()
            assert ack.env == "shell"
            akids = await AsyncSandbox.fork_from(ack, 1, client=a.client)
            aby_id = await AsyncSandbox.fork_from(ack.id, 1, client=a.client)
            assert akids[0].env == aby_id[0].env == "shell" and fake.service.described[-1] == aby_id[0].id
            for k in akids + aby_id:
                await k.close()

    asyncio.run(main())


def test_connect_and_detach(fake: FakeServer) -> None:
    a = deltagym.Sandbox.create("shell", addr=fake.addr, token="t")
    a.detach()
    assert not fake.service.sandboxes[a.id].closed
    b = deltagym.Sandbox.connect(a.id, addr=fake.addr, token="t")
    assert b.env == "shell" and b.episode_id == a.episode_id and b.run("echo x").ok
    b.close()
    assert fake.service.sandboxes[a.id].closed
    b.close()  # idempotent
    with pytest.raises(errors.SandboxClosed):
        b.run("echo late")
    with pytest.raises(errors.SandboxClosed):
        b.files.read("/a")


def test_step_stream_errors_carry_reasons(sb: deltagym.Sandbox) -> None:
    reqs = [deltagym.env_service_pb2.StepRequest(sandbox_id=i, action=deltagym.actions.command("echo s"))
            for i in (sb.id, "gone")]
    ok, gone = sb.client.step_stream(reqs)
    assert not isinstance(ok, Exception) and ok.observation.exec.stdout == b"s\n"
    assert isinstance(gone, errors.SandboxNotFound) and gone.reason == "SANDBOX_NOT_FOUND"


def test_from_code_reasons() -> None:
    e = errors.from_code(5, "gone", "StepStream", reason="SANDBOX_NOT_FOUND")
    assert isinstance(e, errors.SandboxNotFound) and e.reason == "SANDBOX_NOT_FOUND"
    assert isinstance(errors.from_code(4, "late"), errors.Timeout)


def test_async_sandbox_files_and_errors(fake: FakeServer) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create("shell", addr=fake.addr, token="t", timeout=10) as sb:
            assert await sb.files.write("/a", "0123456789abc") == 13
            assert await sb.files.read("/a") == "0123456789abc"
            assert await sb.files.exists("/a")
            with pytest.raises(errors.RateLimited):
                await sb.run("ratelimit")
            with pytest.raises(errors.Timeout):
                await sb.step("block", timeout=0.3)
            kids = await sb.fork(1)
            assert (await kids[0].run("echo k")).stdout == "k\n"
            await kids[0].close()
            assert (await sb.checkpoint()).id == "ck-1"
            p = await sb.processes.start("repl", stdin=True, expect=[r"> $"])
            back = await p.interrupt()
            assert back is not None and back.matched == "> $" and p.running
            assert (await p.send("exit")).exit_code == 0 and not p.running
            with pytest.raises(errors.ProcessEnded):
                await p.send("more")
            with pytest.raises(errors.CommandExitError, match="command 'fail' exited with 1; stderr: boom"):
                await sb.run("fail", check=True)

    asyncio.run(main())


class _Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self) -> str:
        return "missing bearer token"


def test_token_found_above_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("DELTAGYM_TOKEN", "DELTAGYM_TOKEN_FILE", "DELTAGYM_DATA"):
        monkeypatch.delenv(k, raising=False)
    repo = tmp_path / "repo"
    deep = repo / "clients" / "python"
    deep.mkdir(parents=True)
    (repo / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git is a file
    (repo / ".data").mkdir()
    (repo / ".data" / "token").write_text("tok-repo\n")
    (tmp_path / ".data").mkdir()
    (tmp_path / ".data" / "token").write_text("tok-outside\n")
    monkeypatch.chdir(deep)
    looked = [str(deep / ".data/token"), str(repo / "clients/.data/token"), str(repo / ".data/token")]
    assert _common.token_files() == looked  # up to the checkout's root, not past it
    assert _common.resolve_token(None) == "tok-repo"
    (deep / ".data").mkdir()
    (deep / ".data" / "token").write_text("")  # an empty file is no token: the search goes on
    assert _common.resolve_token(None) == "tok-repo"
    (deep / ".data" / "token").write_text("tok-near\n")
    assert _common.resolve_token(None) == "tok-near"
    (deep / ".data" / "token").unlink()
    (repo / ".data" / "token").unlink()
    assert _common.resolve_token(None) == ""
    e = errors.from_rpc_error(_Refused(), "ListEnvs", sent_token=False)
    assert isinstance(e, errors.Unauthenticated) and "found no token" in e.message
    assert e.message.endswith("it looked in " + ", ".join(looked) + ")")
    assert "found no token" not in errors.from_rpc_error(_Refused(), "ListEnvs", sent_token=True).message
    monkeypatch.setenv("DELTAGYM_DATA", str(tmp_path / ".data"))
    assert _common.token_files() == [str(tmp_path / ".data/token")]
    assert _common.resolve_token(None) == "tok-outside"


def _info_value_reference(v: str) -> object:
    """StepInfo.info's parsing as its docstring states it, by trial:
    info_value must agree with it on every string."""
    if v in ("true", "false"):
        return v == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        f = float(v)
    except ValueError:
        return v
    return f if math.isfinite(f) else v


def test_info_value_parses_as_int_then_float() -> None:
    for v in ["true", "false", "True", "", " ", "0", "42", "-7", "+3", "007", "1_000", "1__0", " 12 ", "\u0661\u0662",
              "0.5", "-0.0", ".5", "5.", "1e3", "1E-2", "1_0.5", "inf", "-inf", "Infinity", "nan", "NaN", "1e400",
              "0x10", "abc", "12abc", "9" * 5000, "0" * 5000 + "1", "1.5e", "n", "e"]:
        got, want = _convert.info_value(v), _info_value_reference(v)
        assert (got, type(got)) == (want, type(want)), v


def test_exec_response_maps_every_field() -> None:
    r = raw.env_service_pb2.StepResponse(
        observation=raw.action_pb2.Observation(exec=raw.action_pb2.ExecResult(
            stdout=b"out\xff", stderr=b"err", exit_code=3, signal=9, timed_out=True, stdout_truncated=True,
            duration_seconds=1.5, pid=77, matched="\\$ ", running=True)),
        step_index=4, episode_id="ep", reward=0.25, terminated=True, truncated=True, checkpoint_id="ck",
        steps_left=6, info={"truncated_by": "max_steps", "server_seconds": "0.5", "n": "2", "ok": "true"})
    step = StepInfo(index=4, episode_id="ep", reward=0.25, terminated=True, truncated=True, truncated_by="max_steps",
                    checkpoint_id="ck", steps_left=6, setup=True,
                    info={"truncated_by": "max_steps", "server_seconds": 0.5, "n": 2, "ok": True})
    got = _convert.exec_response(r, True)
    assert got == CommandResult(
        stdout="out\ufffd", stderr="err", stdout_bytes=b"out\xff", stderr_bytes=b"err", exit_code=3, signal=9,
        timed_out=True, truncated=True, duration=1.5, pid=77, matched="\\$ ", running=True, step=step)
    # Made without the dataclass's __init__, it is the same frozen value.
    assert repr(got) == repr(dataclasses.replace(got)) and pickle.loads(pickle.dumps(got)) == got
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step.index = 5  # type: ignore[misc]
    r.observation.exec.Clear()
    r.ClearField("info")
    assert _convert.exec_response(r, False).step.info == {}
    r.observation.error.errno_name = "ENOENT"
    with pytest.raises(errors.ActionFailed):
        _convert.exec_response(r, False)
    r.observation.ClearField("error")
    r.observation.submit.output = "x"
    with pytest.raises(ValueError, match="answered a exec action with a submit observation"):
        _convert.exec_response(r, False)


def test_exec_request_is_exec_action_in_a_request() -> None:
    for cmd, kw in [(["true"], {}), ("echo hi", {"session": "main"}),
                    (("a", "b"), {"timeout": 2.5, "cwd": "/w", "env": {"A": "1"}, "stdin": "in"}),
                    ("cat", {"stdin": b"\x00raw"})]:
        for setup, checkpoint in [(False, False), (True, True)]:
            want = raw.env_service_pb2.StepRequest(sandbox_id="sb", action=_ops.exec_action(cmd, **kw),
                                                   setup=setup, checkpoint=checkpoint)
            got = _ops.exec_request("sb", setup, checkpoint, cmd, kw.get("timeout"), kw.get("cwd"), kw.get("env"),
                                    kw.get("stdin"), kw.get("session"))
            assert got == want, (cmd, kw)
    with pytest.raises(TypeError, match="sequence of str"):
        _ops.exec_request("sb", False, False, ["ls", b"-l"], None, None, None, None, None)  # type: ignore[list-item]


def test_maker_refuses_what_it_would_skip() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unslotted:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    for cls in (Unslotted, Checked):
        with pytest.raises(TypeError, match="not a slotted dataclass"):
            _convert._maker(cls)
