"""The synchronous client against a real server: every RPC, errors, retries,
heartbeats and context managers."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
import uuid

import grpc
import pytest

import deltagym
from deltagym import Client, actions, env_service_pb2 as es, errors
from deltagym.client import Sandbox

from .conftest import LEASE_TTL


def wait_ledger(fn, ok, timeout=15.0):
    """Polls fn until ok(result): the ledger records asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        r = fn()
        if ok(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_list_envs(client: Client):
    envs = {e.spec.name: e for e in client.list_envs()}
    assert envs["shell"].spec.workdir == "/work"
    assert envs["shell"].spec.pool_size == 2


def test_reset_step_actions(client: Client):
    with client.reset("shell", seed=11, options={"WHO": "py"}) as sb:
        assert isinstance(sb, Sandbox)
        assert sb.id and sb.episode_id and sb.start_checkpoint_id
        assert "seed=11 who=py" in sb.observation.reset.hook.stdout.decode()
        assert sb.observation.reset.task.startswith("Write 42")
        r = sb.exec("echo out; echo err >&2; exit 3")
        assert (r.observation.exec.stdout, r.observation.exec.stderr, r.observation.exec.exit_code) == (b"out\n", b"err\n", 3)
        assert r.step_index == 0 and r.episode_id == sb.episode_id
        r = sb.run(["cat"], stdin=b"via stdin")
        assert r.observation.exec.stdout == b"via stdin"
        assert sb.exec("pwd").observation.exec.stdout == b"/work\n"
        assert sb.write_file("/work/notes.txt", "abc").observation.write_file.size == 3
        assert sb.write_file("/work/notes.txt", "def", append=True).observation.write_file.size == 6
        assert sb.exec("cat notes.txt").observation.exec.stdout == b"abcdef"
        rf = sb.read_file("/work/notes.txt", offset=1, max_bytes=3).observation.read_file
        assert (rf.content, rf.size, rf.truncated) == (b"bcd", 6, True)
        # A persistent session keeps shell state between steps.
        sb.exec("cd /tmp && V=kept", session="main")
        assert sb.exec("echo $(pwd) $V", session="main").observation.exec.stdout == b"/tmp kept\n"
        # A str action is a shell command.
        assert client.step(sb.id, "echo str").observation.exec.stdout == b"str\n"
        sb.write_file("/work/answer.txt", "42")
        r = sb.submit()
        assert r.terminated and r.reward == 1.0
        assert dict(r.observation.submit.components) == {"correct": 1.0}
        with pytest.raises(deltagym.FailedPrecondition):
            sb.exec("true")


def test_checkpoint_restore_evaluate(client: Client):
    with client.reset("shell") as sb:
        sb.write_file("/work/answer.txt", "42")
        ck = sb.checkpoint()
        assert ck.checkpoint_id and ck.depth >= 1
        assert sb.evaluate().reward == 1.0
        fs_ck = sb.checkpoint(durable=True, process_mode=deltagym.env_pb2.PROCESS_MODE_FILESYSTEM)
        assert fs_ck.durable and fs_ck.parent_id and fs_ck.checkpoint_id != ck.checkpoint_id
        sb.write_file("/work/answer.txt", "7")
        ev = sb.evaluate()
        assert ev.reward == 0.0 and dict(ev.components) == {"correct": 0.0}
        old = sb.episode_id
        rr = sb.restore(ck.checkpoint_id)
        assert rr.episode_id != old and sb.episode_id == rr.episode_id
        assert sb.read_file("/work/answer.txt").observation.read_file.content == b"42"
        # A step may checkpoint the state after it.
        r = sb.exec("echo 1 > one", checkpoint=True)
        assert r.checkpoint_id
        client.release_checkpoint(r.checkpoint_id)
        with pytest.raises(deltagym.NotFound):
            sb.restore(r.checkpoint_id)
        # A step may restore first, in the same call: a new episode starts at the checkpoint.
        sb.write_file("/work/answer.txt", "7")
        old = sb.episode_id
        r = sb.step(actions.read_file("/work/answer.txt"), restore=ck.checkpoint_id)
        assert r.observation.read_file.content == b"42"
        assert r.episode_id != old and sb.episode_id == r.episode_id
        with pytest.raises(deltagym.NotFound):
            sb.step("true", restore="ck-does-not-exist")
        assert sb.read_file("/work/answer.txt").observation.read_file.content == b"42"
        # fresh_entropy: each restore writes a new seed for programs to read.
        seeds = set()
        for _ in range(3):
            sb.restore(ck.checkpoint_id, fresh_entropy=True)
            seeds.add(sb.read_file("/run/deltagym/fork-seed").observation.read_file.content)
        assert len(seeds) == 3


def test_relative_paths_use_workdir(client: Client):
    with client.reset("shell") as sb:
        sb.write_file("rel.txt", "x")
        assert sb.exec("cat /work/rel.txt").observation.exec.stdout == b"x"


def test_fork_get_list_sandboxes(client: Client):
    gid = f"g-{uuid.uuid4().hex[:8]}"
    with client.reset("shell", run="fork-run") as sb:
        sb.write_file("/work/state", "parent")
        kids = sb.fork(3, group_id=gid)
        try:
            assert len(kids) == 3 and len({k.id for k in kids}) == 3
            for k in kids:
                assert k.read_file("/work/state").observation.read_file.content == b"parent"
            kids[0].write_file("/work/state", "child0")
            assert kids[1].read_file("/work/state").observation.read_file.content == b"parent"
            info = client.get_sandbox(kids[0].id)
            assert info.sandbox_id == kids[0].id and info.env == "shell" and info.group_id == gid
            assert info.state == deltagym.env_pb2.SANDBOX_STATE_READY
            listed = {s.sandbox_id for s in client.list_sandboxes(group_id=gid)}
            assert listed == {k.id for k in kids}
            # Fork from a checkpoint, too.
            ck = sb.checkpoint().checkpoint_id
            with client.fork(checkpoint_id=ck, n=1)[0] as k2:
                assert k2.read_file("/work/state").observation.read_file.content == b"parent"
        finally:
            for k in kids:
                k.close()
        assert client.list_sandboxes(group_id=gid) == []


def test_fork_idempotency_key(client: Client):
    with client.reset("shell") as sb:
        key = uuid.uuid4().hex
        a = client.fork(sandbox_id=sb.id, n=2, idempotency_key=key)
        b = client.fork(sandbox_id=sb.id, n=2, idempotency_key=key)
        try:
            assert [k.id for k in a] == [k.id for k in b]
        finally:
            for k in a + b:
                k.close()


def test_reset_idempotency_key(client: Client):
    key = uuid.uuid4().hex
    a = client.reset("shell", idempotency_key=key)
    b = client.reset("shell", idempotency_key=key)
    try:
        assert a.id == b.id and a.episode_id == b.episode_id
    finally:
        a.close()
        b.close()


def test_step_stream(client: Client):
    with client.reset("shell") as a, client.reset("shell") as b:
        reqs = [es.StepRequest(sandbox_id=sb.id, action=actions.command(f"echo {sb.id} {i}"))
                for i in range(3) for sb in (a, b)]
        reqs.append(es.StepRequest(sandbox_id="sb-unknown", action=actions.command("true")))
        reqs.append(es.StepRequest(sandbox_id=a.id, action=actions.Action()))
        out = client.step_stream(reqs)
        assert len(out) == len(reqs)
        for req, r in zip(reqs[:6], out[:6], strict=False):
            assert isinstance(r, es.StepResponse), r
            assert r.observation.exec.stdout.decode() == req.action.exec.command[5:] + "\n"
        assert isinstance(out[6], deltagym.NotFound)
        assert isinstance(out[7], deltagym.InvalidArgument)
        # Steps for one sandbox keep their order.
        assert [r.step_index for r in out[0:6:2]] == [0, 1, 2]


def test_close_is_idempotent_and_context_manager(client: Client):
    with client.reset("shell") as sb:
        sid = sb.id
    assert sb.closed
    sb.close()
    client.close_sandbox(sid)  # closing a closed sandbox succeeds
    with pytest.raises(deltagym.DeltagymError) as ei:
        client.step(sid, "true")
    assert isinstance(ei.value, (deltagym.NotFound, deltagym.FailedPrecondition))


def test_client_close_closes_sandboxes(server):
    c = Client(server.addr)
    sb = c.reset("shell")
    c.close()
    c.close()
    assert sb.closed
    with Client(server.addr) as c2:
        assert sb.id in c2.heartbeat([sb.id]).unknown_sandbox_ids


def test_heartbeat_keeps_lease(server):
    with Client(server.addr) as live, Client(server.addr, heartbeat=False) as idle:
        a = live.reset("shell")
        b = idle.reset("shell")
        hb = live.heartbeat([a, "sb-nope"])
        assert [lease.sandbox_id for lease in hb.leases] == [a.id] and list(hb.unknown_sandbox_ids) == ["sb-nope"]
        # Wait past the lease TTL: the handle's heartbeats keep a alive, b is reaped.
        time.sleep(LEASE_TTL * 2)
        assert a.exec("echo alive").observation.exec.stdout == b"alive\n"
        assert not a.lost
        with pytest.raises(deltagym.DeltagymError) as ei:
            b.exec("true")
        assert isinstance(ei.value, (deltagym.NotFound, deltagym.FailedPrecondition))


def test_error_mapping(client: Client):
    with pytest.raises(deltagym.NotFound) as ei:
        client.step("sb-does-not-exist", "true")
    e = ei.value
    assert isinstance(e, deltagym.DeltagymError)
    assert e.code == grpc.StatusCode.NOT_FOUND and "sb-does-not-exist" in e.message and e.method == "Step"
    with pytest.raises(deltagym.NotFound):
        client.get_sandbox("sb-does-not-exist")
    with pytest.raises(deltagym.NotFound):
        client.reset("no-such-env")
    with client.reset("shell") as sb:
        with pytest.raises(deltagym.InvalidArgument) as ei:
            sb.step(actions.Action())  # no kind set
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(deltagym.InvalidArgument):
            sb.step(actions.Action(exec=deltagym.action_pb2.ExecAction(argv=["ls"], session="s")))
        with pytest.raises(deltagym.NotFound):
            sb.restore("ck-does-not-exist")
    assert errors.from_code(8, "x").__class__ is deltagym.ResourceExhausted
    assert errors.from_code(10, "x").__class__ is errors.Aborted
    assert errors.from_code(16, "x").__class__ is deltagym.Unauthenticated


def test_unavailable_is_retried_only_when_safe():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    policy = deltagym.RetryPolicy(max_attempts=4, initial_backoff=0.2, max_backoff=0.2, multiplier=1.0)
    with Client(f"127.0.0.1:{port}", retry=policy) as c:
        t = time.monotonic()
        with pytest.raises(deltagym.Unavailable):
            c.list_envs()
        retried = time.monotonic() - t
        t = time.monotonic()
        with pytest.raises(deltagym.Unavailable):
            c.step("sb-x", "true")
        once = time.monotonic() - t
    # Three backoffs of 0.1-0.2 s each for the read; none for Step.
    assert retried >= 0.3, retried
    assert once < 0.3, once


def test_address_from_environment(server, monkeypatch):
    monkeypatch.setenv("DELTAGYM_ADDR", server.addr)
    with Client() as c:
        assert c.addr == server.addr
        assert c.list_envs()
    monkeypatch.delenv("DELTAGYM_ADDR")
    assert Client(heartbeat=False).addr == "127.0.0.1:8080"


def test_register_env_and_import_image(client: Client, server):
    name = f"img-{uuid.uuid4().hex[:8]}"
    # The server reads images only below its import root, <data>/imports by default.
    shutil.copytree(server.data / "images/default/rootfs", server.data / "imports" / name, symlinks=True)
    with pytest.raises(deltagym.InvalidArgument, match="import root"):
        client.import_image(name, str(server.data / "images/default/rootfs"), format=es.IMAGE_FORMAT_ROOTFS_DIR)
    imp = client.import_image(name, name, format=es.IMAGE_FORMAT_ROOTFS_DIR)
    assert imp.name == name and imp.digest.startswith("sha256:") and imp.layer_count >= 1
    env = f"reg-{uuid.uuid4().hex[:8]}"
    info = client.register_env({"name": env, "image": name, "task": "t", "verifier": "echo 0.5", "pool_size": 1})
    assert info.spec.name == env
    with pytest.raises(deltagym.AlreadyExists):
        client.register_env({"name": env, "image": name, "task": "t"})
    with pytest.raises(deltagym.InvalidArgument):
        client.register_env({"name": "Bad Name!", "image": name})
    with client.reset(env) as sb:
        assert sb.observation.reset.task == "t"
        assert sb.evaluate().reward == 0.5
    with pytest.raises(deltagym.InvalidArgument):
        client.import_image("x", "/does/not/exist")


# --- LedgerService ------------------------------------------------------------


def test_ledger_trajectory_episodes_tree_rewards(client: Client, server):
    server.require_ledger()
    run = f"run-{uuid.uuid4().hex[:8]}"
    gid = f"grp-{uuid.uuid4().hex[:8]}"
    with client.reset("shell", seed=5, run=run, group_id=gid) as sb:
        sb.exec("echo a")
        ck = sb.checkpoint().checkpoint_id
        sb.write_file("/work/answer.txt", "42")
        sb.submit()
        ep = sb.episode_id
    tr = wait_ledger(lambda: client.get_trajectory(ep), lambda t: len(t.steps) == 3 and t.episode.end_time.seconds > 0)
    assert tr.episode.episode_id == ep and tr.episode.run == run and tr.episode.group_id == gid
    assert tr.episode.seed == 5 and tr.episode.total_reward == 1.0
    assert [s.step_index for s in tr.steps] == [0, 1, 2]
    assert tr.steps[0].action.exec.command == "echo a"
    assert tr.steps[0].observation.exec.stdout == b"a\n"
    assert tr.steps[2].terminated and tr.steps[2].reward == 1.0
    eps = wait_ledger(lambda: list(client.iter_episodes(run=run, page_size=1)), lambda e: len(e) == 1)
    assert [e.episode_id for e in eps] == [ep]
    assert client.list_episodes(group_id=gid).episodes[0].episode_id == ep
    nodes = wait_ledger(lambda: client.get_checkpoint_tree(run=run), lambda n: ck in {x.checkpoint_id for x in n})
    assert ck in {n.checkpoint_id for n in nodes}
    assert ck in {n.checkpoint_id for n in client.get_checkpoint_tree(episode_id=ep)}
    client.report_reward(ep, "judge", 0.25, source="test")
    got = wait_ledger(lambda: client.get_trajectory(ep).episode.rewards, lambda r: len(r) == 1)
    assert [(r.name, r.value, r.source) for r in got] == [("judge", 0.25, "test")]
    adv = client.get_group_advantages(gid, reward_source="test")
    assert [(a.episode_id, a.reward) for a in adv.advantages] == [(ep, 0.25)]
    with pytest.raises(deltagym.NotFound):
        client.get_trajectory("ep_does_not_exist")


class _Forwarder:
    """A TCP forwarder to the server that starts listening only when told:
    until then, connections to its port are refused (gRPC UNAVAILABLE)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.sock: socket.socket | None = None
        self.stop = threading.Event()

    def listen(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen()
        self.sock.settimeout(0.1)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop.set()
        if self.sock:
            self.sock.close()


def test_retry_reaches_a_server_that_comes_up(server):
    fwd = _Forwarder(server.addr)
    policy = deltagym.RetryPolicy(max_attempts=12, initial_backoff=0.1, max_backoff=0.5)
    try:
        with Client(f"127.0.0.1:{fwd.port}", retry=policy) as c:
            with pytest.raises(deltagym.Unavailable):
                c.step("sb-x", "true")  # not retried: fails while nothing listens
            timer = threading.Timer(0.5, fwd.listen)
            timer.start()
            try:
                t = time.monotonic()
                assert "shell" in {e.spec.name for e in c.list_envs()}  # retried until the port opens
                assert time.monotonic() - t >= 0.3
                # Reset is retried with one idempotency key: one sandbox, however many attempts.
                with c.reset("shell") as sb:
                    assert sb.exec("echo via-forwarder").observation.exec.stdout == b"via-forwarder\n"
            finally:
                timer.cancel()
                timer.join()
    finally:
        fwd.close()
