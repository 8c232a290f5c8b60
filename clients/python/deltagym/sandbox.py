"""deltagym.Sandbox: a leased sandbox with typed results.

    import deltagym

    with deltagym.Sandbox.create("shell") as sb:
        print(sb.run("echo hi").stdout)
        sb.files.write("/work/answer.txt", "42\\n")
        ck = sb.checkpoint()
        print(sb.submit().reward)
        sb.restore(ck)
"""

from __future__ import annotations

import builtins
import dataclasses
import signal as _signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from . import _convert as cv, _ops as ops
from ._base import ProcessBase, SandboxBase
from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2 as es
from .client import Client, SandboxHandle
from .errors import CommandExitError, NotFound, from_code
from .types import (
    Checkpoint,
    CommandResult,
    Evaluation,
    FileInfo,
    OutputChunk,
    ProcessInfo,
    Restored,
    SandboxInfo,
    StepResult,
    SubmitResult,
    UploadResult,
)

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["CommandStream", "Files", "Process", "ProcessMode", "Processes", "Sandbox"]

ProcessMode = Literal["filesystem", "template", "criu"]
"""How a checkpoint captures processes (EnvSpec.process_mode)."""

_PROCESS_MODES = {
    "filesystem": env_pb2.PROCESS_MODE_FILESYSTEM,
    "template": env_pb2.PROCESS_MODE_TEMPLATE,
    "criu": env_pb2.PROCESS_MODE_CRIU,
}

OutputCallback = Callable[[str], Any]
"""A callback of run(): called with each piece of output's text as it arrives."""


def to_process_mode(mode: str | None) -> env_pb2.ProcessMode | None:
    """The ProcessMode of a mode name, None for the env's own."""
    if mode is None:
        return None
    try:
        return _PROCESS_MODES[mode]
    except KeyError:
        raise ValueError(f"process_mode must be one of {sorted(_PROCESS_MODES)}, not {mode!r}") from None


class _Owner:
    """A Client that Sandboxes made it for share (a sandbox and its forks):
    closed when the last of them closes."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._n = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self._n += 1

    def release(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self.client.close()


class Sandbox(SandboxBase[SandboxHandle]):
    """A leased sandbox: commands, files, processes, checkpoints, with typed
    results. Make one with Sandbox.create (a fresh episode of an env),
    Sandbox.connect (attach to a live sandbox by ID) or Sandbox.fork_from
    (copies of a checkpoint). A background thread renews the lease until
    close(); `with` closes it.

    Every method takes timeout= (seconds): the call's deadline, by default
    the sandbox's (create's timeout=, else the client's). A deadline that
    passes raises deltagym.errors.Timeout. Every acting method takes
    setup= (see setup()).

    Attributes:
        id: the sandbox ID.
        env: the env's catalog name.
        episode_id: the current episode (a restore starts a new one).
        task: the task text Reset gave (a fork's parent's; "" when connected or forked from a checkpoint).
        start_checkpoint: the checkpoint the first episode started from.
        timeout: the default call deadline, None for none.
        client: the low-level Client the sandbox calls through.
        files: file operations (Files).
        processes: process operations (Processes).
    """

    def __init__(self, handle: SandboxHandle, *, timeout: float | None = None, task: str = "",
                 owner: _Owner | None = None) -> None:
        self._h = handle
        self.client = handle.client
        self.timeout = timeout if timeout is not None else handle.client.timeout
        self.task = task
        self.start_checkpoint = Checkpoint(id=handle.start_checkpoint_id, env=handle.env)
        self._owner = owner
        if owner is not None:
            owner.acquire()
        self._closed = False
        self.files = Files(self)
        self.processes = Processes(self)

    # --- making -------------------------------------------------------------------------------

    @staticmethod
    def _client(client: Client | None, addr: str | None, token: str | None, cluster: Cluster | None = None,
                id: str = "") -> tuple[Client, _Owner | None]:
        if cluster is not None:
            only_one(client, addr, token)
            return cluster.client_for(id), None
        if client is not None:
            return client, None
        c = Client(addr, token=token)
        return c, _Owner(c)

    @classmethod
    def create(cls, env: str = "shell", *, seed: int | None = None, options: Mapping[str, Any] | None = None,
               run: str = "", group_id: str = "", lease_ttl: float | None = None, timeout: float | None = None,
               addr: str | None = None, token: str | None = None, client: Client | None = None,
               cluster: Cluster | None = None) -> Sandbox:
        """Leases a warm sandbox of env and starts an episode.

        Args:
            env: the env's catalog name.
            seed: the episode's seed (the env's task may depend on it).
            options: Reset options of the env.
            run: the run the episode belongs to (ledger).
            group_id: the group the episode belongs to (ledger; GRPO).
            lease_ttl: seconds the sandbox lives without a call or heartbeat; default the server's.
            timeout: the default deadline of this sandbox's calls, and of this one.
            addr: host:port; default $DELTAGYM_ADDR, else 127.0.0.1:8080.
            token: bearer token; default $DELTAGYM_TOKEN, $DELTAGYM_TOKEN_FILE, or the server's data dir.
            client: a Client to call through (not closed by close()); default a new one this sandbox owns.
            cluster: a deltagym.Cluster to place the sandbox on, on its least-loaded node
                (instead of addr, token and client); the sandbox calls through that node's client.
        """
        if cluster is not None:
            only_one(client, addr, token)
            h = cluster.reset(env, seed=seed, options=options, run=run, group_id=group_id, lease_ttl=lease_ttl,
                              timeout=ops.deadline(None, timeout if timeout is not None else cluster.timeout))
            assert h.reset_response is not None
            return cls(h, timeout=timeout, task=cv.reset_task(h.reset_response))
        c, owner = cls._client(client, addr, token)
        try:
            h = c.reset(env, seed=seed, options=options, run=run, group_id=group_id, lease_ttl=lease_ttl,
                        timeout=ops.deadline(None, timeout if timeout is not None else c.timeout))
        except BaseException:
            if owner is not None:
                c.close()
            raise
        assert h.reset_response is not None
        return cls(h, timeout=timeout, task=cv.reset_task(h.reset_response), owner=owner)

    @classmethod
    def connect(cls, sandbox_id: str, *, timeout: float | None = None, addr: str | None = None,
                token: str | None = None, client: Client | None = None, cluster: Cluster | None = None) -> Sandbox:
        """Attaches to a live sandbox by ID (made by another process or
        client) and renews its lease from here on. close() closes the
        sandbox; detach() lets go of it and leaves it running.
        SandboxNotFound when there is no such sandbox. With cluster, the
        calls go to the node the ID names."""
        c, owner = cls._client(client, addr, token, cluster, sandbox_id)
        try:
            info = c.get_sandbox(sandbox_id, timeout=timeout if timeout is not None else c.timeout)
        except BaseException:
            if owner is not None:
                c.close()
            raise
        # The lease's time left bounds its TTL from below: heartbeats at a third of it keep it.
        c._saw_lease(info.lease_expire_time)
        h = SandboxHandle(c, info.sandbox_id, env=info.env, episode_id=info.episode_id,
                          start_checkpoint_id=info.start_checkpoint_id)
        h.saw_lease(info.lease_expire_time)
        return cls(h, timeout=timeout, owner=owner)

    @classmethod
    def fork_from(cls, checkpoint: Checkpoint | str, n: int = 1, *, group_id: str = "", run: str = "",
                  fresh_entropy: bool = False, lease_ttl: float | None = None, timeout: float | None = None,
                  addr: str | None = None, token: str | None = None,
                  client: Client | None = None, cluster: Cluster | None = None) -> list[Sandbox]:
        """Creates n sandboxes at a checkpoint, each in a new episode. They
        share one client (this call's, or one made for them, closed with
        the last of them; with cluster, the client of the node holding
        the checkpoint, where they all are). fresh_entropy gives each
        fresh random state. Their env is the checkpoint's: a Checkpoint
        from checkpoint() knows it; for a checkpoint ID, the first child's
        description tells it."""
        c, owner = cls._client(client, addr, token, cluster, _checkpoint_id(checkpoint))
        hs: list[SandboxHandle] = []
        try:
            dl = timeout if timeout is not None else c.timeout
            if cluster is not None:  # the cluster counts them placed on the checkpoint's node
                hs = cluster.fork(_checkpoint_id(checkpoint), n, group_id=group_id, run=run,
                                  fresh_entropy=fresh_entropy, lease_ttl=lease_ttl, timeout=dl)
            else:
                hs = c.fork(checkpoint_id=_checkpoint_id(checkpoint), n=n, group_id=group_id, run=run,
                            fresh_entropy=fresh_entropy, lease_ttl=lease_ttl, timeout=dl)
            if hs and c._lease_ttl is None:
                # A fork's answer has no lease time: one heartbeat learns the TTL the heartbeats keep to.
                c.heartbeat(hs, timeout=timeout if timeout is not None else c.timeout)
            env = checkpoint.env if isinstance(checkpoint, Checkpoint) else ""
            if hs and not env:
                # A fork's answer has no env: the first child's description has it.
                env = (c.get_sandbox(hs[0].id, timeout=timeout if timeout is not None else c.timeout)).env
            for h in hs:
                h.env = env
        except BaseException:
            for h in hs:
                h.detach()
            if owner is not None:
                c.close()
            raise
        kids = [cls(h, timeout=timeout, owner=owner) for h in hs]
        if owner is not None and not kids:
            c.close()
        return kids

    def _step(self, action: action_pb2.Action, setup: bool, deadline: float | None,
              checkpoint: bool = False, wait_for_digest: bool = False,
              dedupe: bool = False) -> es.StepResponse:
        return self._send(ops.step_request(self.id, action, setup, checkpoint, wait_for_digest, dedupe), deadline)

    def _send(self, req: es.StepRequest, deadline: float | None) -> es.StepResponse:
        resp: es.StepResponse = self.client._call_once("Step", self.client._env.Step, req, deadline)
        self._saw_step(resp)
        return resp

    def _act(self, action: action_pb2.Action, kind: str, setup: bool | None, timeout: float | None) -> Any:
        s = self._setup(setup)
        x, _ = cv.observation(self._step(action, s, self._deadline(timeout)), kind, s)
        return x

    # --- commands -------------------------------------------------------------------------------

    def run(self, cmd: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
            session: str | None = None, check: bool = False, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None, setup: bool | None = None,
            checkpoint: bool = False) -> CommandResult:
        """Runs a command and returns its result.

        Args:
            cmd: a str runs as `/bin/sh -c cmd` (or in the session); a sequence is argv, without a shell.
            timeout: the command's timeout in seconds (default the env's step timeout); the
                call's deadline is that plus a margin.
            cwd: working directory (default the env's, or the session's).
            env: variables added to the env's environment.
            stdin: written to the command's standard input, which is then closed.
            session: a persistent shell session (created on first use) to run in.
            check: raise CommandExitError when the command fails (non-zero, timed out, killed).
            on_stdout: called with standard output's text as it arrives (uses StreamStep).
            on_stderr: called with standard error's text as it arrives (uses StreamStep).
            setup: a setup step (default: what setup() says).
            checkpoint: take a checkpoint after the step (result.step.checkpoint_id).

        Raises ActionFailed when the sandbox cannot start the command (an
        argv program that is missing), a DeltagymError when the call fails.
        """
        if on_stdout is not None or on_stderr is not None:
            with self.stream(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, session=session,
                             setup=setup, checkpoint=checkpoint) as s:
                for chunk in s:
                    cb = on_stdout if chunk.stream == "stdout" else on_stderr
                    if cb is not None and chunk.text:
                        cb(chunk.text)
                result = s.result
        else:
            s_ = self._setup(setup)
            req = ops.exec_request(self._h.id, s_, checkpoint, cmd, timeout, cwd, env, stdin, session)
            result = cv.exec_response(self._send(req, self._command_deadline(timeout)), s_)
        if check and not result.ok:
            raise CommandExitError(result, cmd)
        return result

    def stream(self, cmd: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
               env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
               session: str | None = None, setup: bool | None = None,
               checkpoint: bool = False) -> CommandStream:
        """Runs a command with its output streamed (StreamStep): iterate the
        returned CommandStream for OutputChunks as they come, then read
        its result. Arguments as for run(). Leaving the `with` block before
        the end cancels the call, which cuts the command short."""
        s = self._setup(setup)
        req = ops.exec_request(self.id, s, checkpoint, cmd, timeout, cwd, env, stdin, session)
        return CommandStream(self, req, s, self._command_deadline(timeout))

    def step(self, action: action_pb2.Action | str, *, checkpoint: bool = False, setup: bool | None = None,
             checkpoint_wait_for_digest: bool = False, checkpoint_dedupe: bool = False,
             timeout: float | None = None) -> StepResult:
        """Performs one raw action (a deltagym.actions builder's Action, or a
        str run as a shell command). An action the sandbox refused is a
        StepResult with error set, not an exception. checkpoint takes a
        checkpoint after the step (result.step.checkpoint_id);
        checkpoint_wait_for_digest and checkpoint_dedupe are checkpoint()'s
        wait_for_digest and dedupe for it (result.step.checkpoint_digest,
        result.step.checkpoint_deduplicated)."""
        from .actions import coerce

        s = self._setup(setup)
        act = coerce(action)
        if act.WhichOneof("kind") == "submit":
            s = False
        dl = self._deadline(timeout)
        if act.WhichOneof("kind") == "exec" and act.exec.timeout_seconds > 0 and timeout is None:
            dl = ops.command_deadline(act.exec.timeout_seconds, self.timeout)
        return cv.step_result(self._step(act, s, dl, checkpoint, checkpoint_wait_for_digest, checkpoint_dedupe), s)

    # --- episode --------------------------------------------------------------------------------

    def submit(self, answer: str | None = None, *, timeout: float | None = None) -> SubmitResult:
        """Ends the episode: the env's verifier runs and gives the reward. Never a setup step."""
        from .actions import submit

        return cv.submit_result(self._step(submit(answer), False, self._deadline(timeout)))

    def evaluate(self, *, timeout: float | None = None) -> Evaluation:
        """Runs the verifier on the sandbox's state without changing it or ending the episode."""
        return cv.evaluation(self.client.evaluate(self.id, timeout=self._deadline(timeout)))

    def checkpoint(self, *, durable: bool = False, process_mode: ProcessMode | None = None,
                   wait_for_digest: bool = False, dedupe: bool = False, timeout: float | None = None) -> Checkpoint:
        """Saves the sandbox's whole state (files and processes) as an
        immutable checkpoint. durable saves every process as a CRIU image
        before answering (Checkpoint.not_durable says why one could not
        be); process_mode overrides the env's. wait_for_digest answers once
        the checkpoint's state digest is computed, with it
        (Checkpoint.digest: equal digests, equal states). dedupe, which
        implies it, answers with an existing checkpoint of the env holding
        the same state, when there is one, instead of keeping a second copy:
        Checkpoint.id is then that checkpoint's and deduplicated is set."""
        r = self.client.checkpoint(self.id, durable=durable, process_mode=to_process_mode(process_mode),
                                   wait_for_digest=wait_for_digest, dedupe=dedupe,
                                   timeout=self._deadline(timeout))
        return dataclasses.replace(cv.checkpoint(r), env=self.env)

    def restore(self, checkpoint: Checkpoint | str, *, fresh_entropy: bool = False,
                timeout: float | None = None) -> Restored:
        """Puts the sandbox back at a checkpoint; a new episode starts there."""
        r = self.client.restore(self.id, _checkpoint_id(checkpoint), fresh_entropy=fresh_entropy,
                                timeout=self._deadline(timeout))
        self._h.episode_id = r.episode_id
        return cv.restored(r)

    def fork(self, n: int = 1, *, group_id: str = "", run: str = "", fresh_entropy: bool = False,
             lease_ttl: float | None = None, timeout: float | None = None) -> list[Sandbox]:
        """Creates n sandboxes at this sandbox's current state, each in a new
        episode, calling through this sandbox's client (kept open until the
        last of them closes)."""
        hs = self.client.fork(sandbox_id=self.id, n=n, group_id=group_id, run=run, fresh_entropy=fresh_entropy,
                              lease_ttl=lease_ttl, timeout=self._deadline(timeout))
        for h in hs:
            h.env = self.env
        return [Sandbox(h, timeout=self.timeout, task=self.task, owner=self._owner) for h in hs]

    def describe(self, *, timeout: float | None = None) -> SandboxInfo:
        """The server's description of the sandbox."""
        info = cv.sandbox_info(self.client.get_sandbox(self.id, timeout=self._deadline(timeout)))
        if info.lease_expires_at is not None:
            self._h.lease_expires_at = info.lease_expires_at
        return info

    def is_alive(self, *, timeout: float | None = None) -> bool:
        """Whether the server still has the sandbox, open (its episode may have ended)."""
        if self._closed:
            return False
        try:
            return self.describe(timeout=timeout).state != "closed"
        except NotFound:
            return False

    def extend_lease(self, ttl: float | None = None, *, timeout: float | None = None) -> float | None:
        """Renews the lease now; with ttl, the lease's TTL becomes ttl seconds
        from now on (longer or shorter), and the heartbeats follow it.
        Returns the new expiry (Unix seconds). SandboxNotFound when the
        sandbox is gone."""
        resp = self.client.heartbeat([self.id], lease_ttl=ttl, timeout=self._deadline(timeout))
        if self.id in resp.unknown_sandbox_ids:
            raise from_code(5, f"sandbox {self.id} is gone (closed, or its lease ran out)", "Heartbeat",
                            reason="SANDBOX_NOT_FOUND", metadata={"sandbox_id": self.id})
        if ttl is not None:
            self._h.lease_ttl = ttl
        for lease in resp.leases:
            if lease.sandbox_id == self.id:
                self._h.saw_lease(lease.expire_time)
        return self._h.lease_expires_at

    def close(self, *, timeout: float | None = None) -> None:
        """Closes the sandbox (ends its episode and frees it) and, when this
        sandbox made its client, the client once its forks are closed too.
        Idempotent; a sandbox already gone closes quietly."""
        if self._closed:
            return
        self._closed = True
        try:
            self._h.close(timeout=ops.deadline(timeout, self.timeout))
        except NotFound:
            pass  # reaped or closed elsewhere: what close asks for holds
        finally:
            if self._owner is not None:
                self._owner.release()

    def detach(self) -> None:
        """Lets go of the sandbox without closing it: the heartbeats stop and
        it lives on until its lease runs out (Sandbox.connect takes it up)."""
        if self._closed:
            return
        self._closed = True
        self._h.detach()
        if self._owner is not None:
            self._owner.release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def only_one(client: object, addr: str | None, token: str | None) -> None:
    """Refuses a cluster= given with what names one server (client=, addr=, token=)."""
    given = [f"{n}=" for n, v in (("client", client), ("addr", addr), ("token", token)) if v is not None]
    if given:
        raise ValueError(f"cluster= calls through the cluster's nodes (and with its token): drop {', '.join(given)}")


def _checkpoint_id(checkpoint: Checkpoint | str) -> str:
    cid = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
    if not isinstance(cid, str) or not cid:
        raise ValueError("checkpoint must be a Checkpoint or a non-empty checkpoint ID")
    return cid


class CommandStream:
    """A command's output as it comes (Sandbox.stream): iterate it for
    OutputChunks; result is the CommandResult once the command ended.
    A context manager: leaving it early cancels the call, which cuts the
    command short."""

    def __init__(self, sb: Sandbox, req: es.StepRequest, setup: bool, deadline: float | None) -> None:
        self._sb = sb
        self._setup = setup
        self._call = sb.client.stream_step(req, timeout=deadline)
        self._dec = cv.ChunkDecoder()
        self._result: CommandResult | None = None
        self._done = False

    def __enter__(self) -> CommandStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[OutputChunk]:
        return self

    def __next__(self) -> OutputChunk:
        while not self._done:
            try:
                msg = next(self._call)
            except StopIteration:
                self._done = True
                raise from_code(2, "the stream ended without the step's response", "StreamStep") from None
            except BaseException:
                self._done = True
                raise
            kind = msg.WhichOneof("event")
            if kind == "output":
                return self._dec.chunk(msg.output)
            if kind == "step":
                self._done = True
                self._sb._saw_step(msg.step)
                self._result = cv.exec_response(msg.step, self._setup)
        raise StopIteration

    @property
    def result(self) -> CommandResult:
        """The command's result; reading it before the end reads (and drops) the rest of the output."""
        for _ in self:
            pass
        if self._result is None:
            raise from_code(2, "the stream ended without the step's response", "StreamStep")
        return self._result

    def close(self) -> None:
        """Cancels the call when the command has not ended."""
        if not self._done:
            self._done = True
            self._call.cancel()


class Files:
    """File operations inside the sandbox (Sandbox.files). Paths are
    absolute or relative to the env's working directory, and cannot
    escape the sandbox. Each operation is one step of the episode (a large
    read, several); each takes setup= and timeout=. An operation the
    sandbox's state refuses (a missing file to read, a directory to
    write) raises ActionFailed with its errno."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb

    def read_bytes(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> bytes:
        """The whole file, read in parts when larger than one read may return."""
        out = bytearray()
        while True:
            x = self._sb._act(ops.read_action(path, len(out)), "read_file", setup, timeout)
            out += x.content
            if not x.truncated or not x.content:
                return bytes(out)

    def read(self, path: str, *, encoding: str = "utf-8", errors: str = "replace", setup: bool | None = None,
             timeout: float | None = None) -> str:
        """The whole file as text."""
        return self.read_bytes(path, setup=setup, timeout=timeout).decode(encoding, errors)

    def write(self, path: str, data: str | bytes, *, mode: int | None = None, append: bool = False,
              setup: bool | None = None, timeout: float | None = None) -> int:
        """Creates, replaces or (append) extends a file; mode is a new file's
        permission bits (default 0644). Returns the file's size after."""
        x = self._sb._act(ops.write_action(path, data, mode, append), "write_file", setup, timeout)
        return int(x.size)

    def list(self, path: str = ".", depth: int = 1, *, setup: bool | None = None,
             timeout: float | None = None) -> builtins.list[FileInfo]:
        """The entries of a directory (depth levels down), sorted by path,
        paths relative to it; links are listed, not followed."""
        x = self._sb._act(ops.list_action(path, depth), "list_dir", setup, timeout)
        return [cv.file_info(f) for f in x.entries]

    def stat(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> FileInfo | None:
        """A path's FileInfo (of a final link itself), None when it does not exist."""
        x = self._sb._act(ops.stat_action(path), "stat", setup, timeout)
        return cv.file_info(x.info) if x.exists else None

    def exists(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> bool:
        """Whether the path exists."""
        return self.stat(path, setup=setup, timeout=timeout) is not None

    def remove(self, path: str, *, recursive: bool = False, setup: bool | None = None,
               timeout: float | None = None) -> int:
        """Removes a file, a link or (recursive) a directory with everything
        in it. Returns how many paths went; a missing path is 0."""
        x = self._sb._act(ops.remove_action(path, recursive), "remove", setup, timeout)
        return int(x.removed)

    def mkdir(self, path: str, *, parents: bool = True, mode: int | None = None, setup: bool | None = None,
              timeout: float | None = None) -> bool:
        """Creates a directory (and its missing parents, by default).
        Returns whether it was created (False: it existed)."""
        x = self._sb._act(ops.mkdir_action(path, parents, mode), "make_dir", setup, timeout)
        return bool(x.created)

    def upload_tar(self, data: bytes, remote_dir: str, *, setup: bool | None = None,
                   timeout: float | None = None) -> UploadResult:
        """Unpacks a tar archive (plain or gzip, at most 64 MiB) into
        remote_dir, created when missing. The server refuses entries that
        would land outside it, devices and FIFOs."""
        x = self._sb._act(ops.upload_action(data, remote_dir), "upload", setup, timeout)
        return cv.upload_result(x)

    def upload(self, local_path: str, remote_dir: str, *, setup: bool | None = None,
               timeout: float | None = None) -> UploadResult:
        """Copies a local file or directory into remote_dir, as `cp -r
        local_path remote_dir/` would (a directory "src" lands as
        remote_dir/src), packed as a tar archive in memory."""
        return self.upload_tar(ops.pack(local_path), remote_dir, setup=setup, timeout=timeout)

    def download_tar(self, remote_path: str, *, setup: bool | None = None, timeout: float | None = None) -> bytes:
        """A file or directory packed as a tar archive, entries named below
        its base name ("src/", "src/a.py" ...); at most 64 MiB."""
        x = self._sb._act(ops.download_action(remote_path), "download", setup, timeout)
        return bytes(x.tar)

    def download(self, remote_path: str, local_dir: str, *, setup: bool | None = None,
                 timeout: float | None = None) -> builtins.list[str]:
        """Copies a file or directory of the sandbox into local_dir (as
        local_dir/<base name>) and returns the local paths written. The
        archive, and what local_dir holds, are checked first: an entry that
        is absolute, has a '..' part, is a device or FIFO, is named twice,
        lies below a link, or a link whose target is absolute or climbs
        above its own depth raises UnsafeArchiveError and nothing is
        written; no write follows a link (the SDK README's Files section
        has the rules)."""
        return ops.extract(self.download_tar(remote_path, setup=setup, timeout=timeout), local_dir)


class Process(ProcessBase):
    """A process started by Sandbox.processes.start.

    Attributes:
        pid: its pid inside the sandbox (0 for an interactive one, which lives in its session).
        session: the session of an interactive process, else "".
        result: the result of the step that started it.
        expect: the patterns given to processes.start, which send and interrupt wait for by default.
        running: whether it runs, as far as this client saw (see ProcessBase.running).
    """

    def __init__(self, sb: Sandbox, pid: int, session: str, result: CommandResult,
                 expect: Sequence[str] = ()) -> None:
        super().__init__(pid, session, result, expect)
        self._sb = sb

    def send(self, text: str, *, expect: Sequence[str] | None = None, timeout: float | None = None,
             setup: bool | None = None) -> CommandResult:
        """Writes text and a newline to an interactive process and returns its
        output: when one of the expect patterns (regular expressions;
        default the ones given to processes.start, () for none) matches,
        when the process ends, or at the timeout (the process runs on).
        ProcessEnded when an earlier step saw the process end: the text
        would go to the session's shell."""
        action = self._send_action(text, expect, timeout)
        s = self._sb._setup(setup)
        return self._saw(cv.exec_response(self._sb._step(action, s, self._sb._command_deadline(timeout)), s))

    def interrupt(self, *, expect: Sequence[str] | None = None, setup: bool | None = None,
                  timeout: float | None = None) -> CommandResult | None:
        """Sends SIGINT (Ctrl-C). To an interactive process through its
        session, and returns the output it gave: when one of the expect
        patterns (default the ones given to processes.start, () for none)
        matches, such as the prompt a REPL shows again after Ctrl-C, or
        when the process ends. When the timeout (default the env's step
        timeout) passes with no match, what the session runs is killed
        (SIGKILL). To a background process as a signal, returning None."""
        if not self.session:
            self.kill(_signal.SIGINT, setup=setup, timeout=timeout)
            return None
        action = self._interrupt_action(expect, timeout)
        s = self._sb._setup(setup)
        return self._saw(cv.exec_response(self._sb._step(action, s, self._sb._command_deadline(timeout)), s))

    def kill(self, signal: int = _signal.SIGKILL, *, group: bool = False, setup: bool | None = None,
             timeout: float | None = None) -> None:
        """Sends a signal (default SIGKILL) to the process, or its process group."""
        if not self.pid:
            raise ValueError("this process's pid is unknown (an interactive one): use interrupt()")
        self._sb.processes.kill(self.pid, signal, group=group, setup=setup, timeout=timeout)
        self._killed = self._killed or signal == _signal.SIGKILL


class Processes:
    """Processes inside the sandbox (Sandbox.processes)."""

    def __init__(self, sb: Sandbox) -> None:
        self._sb = sb
        self._n = 0
        self._lock = threading.Lock()

    def _session(self, session: str | None) -> str:
        if session:
            return session
        with self._lock:
            self._n += 1
            return f"proc-{self._n}"

    def start(self, cmd: str | Sequence[str], *, session: str | None = None, stdin: bool = False,
              cwd: str | None = None, env: Mapping[str, str] | None = None, expect: Sequence[str] | None = None,
              timeout: float | None = None, setup: bool | None = None) -> Process:
        """Starts a process and returns at once. Without stdin, it runs in
        the background (its output discarded; captured by checkpoints like
        any process) and Process.pid is its pid. With stdin, it runs as an
        interactive command in a session (named, or "proc-<n>"), and
        Process.send writes to it (its stderr comes with its stdout);
        start returns when one of expect (regular expressions, RE2)
        matches, when the program ends, or at the timeout (default the
        env's step timeout), which leaves it running: give a prompt to
        expect, or a short timeout."""
        s = self._sb._setup(setup)
        if not stdin:
            action = ops.exec_action(cmd, cwd=cwd, env=env, session=session, background=True)
            r = cv.exec_response(self._sb._step(action, s, self._sb._deadline(timeout)), s)
            return Process(self._sb, r.pid, "", r)
        if not isinstance(cmd, str):
            raise TypeError("an interactive process's cmd is a str, typed into its session")
        name = self._session(session)
        if cwd or env:
            raise ValueError("an interactive process takes no cwd or env: cd or export in its session first")
        action = ops.interactive_action(name, cmd, expect=expect or (), timeout=timeout)
        r = cv.exec_response(self._sb._step(action, s, self._sb._command_deadline(timeout)), s)
        return Process(self._sb, 0, name, r, expect or ())

    def list(self, *, setup: bool | None = None, timeout: float | None = None) -> builtins.list[ProcessInfo]:
        """The processes running in the sandbox (its init excluded), by pid."""
        x = self._sb._act(ops.list_processes_action(), "list_processes", setup, timeout)
        return [cv.process_info(p) for p in x.processes]

    def kill(self, pid: int, signal: int = _signal.SIGKILL, *, group: bool = False, setup: bool | None = None,
             timeout: float | None = None) -> None:
        """Sends a signal (default SIGKILL) to a process of the sandbox, or
        with group to its process group. ActionFailed (ESRCH) when there is
        no such process in the sandbox."""
        self._sb._act(ops.signal_action(pid, int(signal), group), "signal", setup, timeout)

