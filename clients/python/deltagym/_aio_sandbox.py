"""deltagym.aio.AsyncSandbox: the asyncio Sandbox, the same methods as
deltagym.Sandbox as coroutines.

    from deltagym.aio import AsyncSandbox

    async with await AsyncSandbox.create("shell") as sb:
        print((await sb.run("echo hi")).stdout)
        async for chunk in sb.stream("for i in 1 2 3; do echo $i; done"):
            print(chunk.text, end="")
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import signal as _signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _convert as cv, _ops as ops
from ._base import ProcessBase, SandboxBase
from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .aio import AsyncClient, AsyncSandboxHandle
from .errors import CommandExitError, NotFound, from_code
from .sandbox import ProcessMode, _checkpoint_id, only_one, to_process_mode
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
    from ._aio_cluster import AsyncCluster

__all__ = ["AsyncCommandStream", "AsyncFiles", "AsyncProcess", "AsyncProcesses", "AsyncSandbox"]

AsyncOutputCallback = Callable[[str], Any]
"""A callback of AsyncSandbox.run(): a function or a coroutine function, called with each piece of output's text."""


class _AsyncOwner:
    """A Client that Sandboxes made it for share (a sandbox and its forks):
    closed when the last of them closes."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._n = 0

    def acquire(self) -> None:
        self._n += 1

    async def release(self) -> None:
        self._n -= 1
        if self._n == 0:
            await self.client.close()


class AsyncSandbox(SandboxBase[AsyncSandboxHandle]):
    """The asyncio Sandbox: what deltagym.Sandbox is, with every call a
    coroutine. `async with` closes it; an asyncio task renews the lease;
    run()'s callbacks may be coroutine functions; stream() is iterated
    with `async for` and its result awaited. Attributes as Sandbox's, with
    client an AsyncClient, files AsyncFiles and processes AsyncProcesses.
    """

    def __init__(self, handle: AsyncSandboxHandle, *, timeout: float | None = None, task: str = "",
                 owner: _AsyncOwner | None = None) -> None:
        self._h = handle
        self.client = handle.client
        self.timeout = timeout if timeout is not None else handle.client.timeout
        self.task = task
        self.start_checkpoint = Checkpoint(id=handle.start_checkpoint_id, env=handle.env)
        self._owner = owner
        if owner is not None:
            owner.acquire()
        self._closed = False
        self.files = AsyncFiles(self)
        self.processes = AsyncProcesses(self)

    # --- making -------------------------------------------------------------------------------

    @staticmethod
    async def _client(client: AsyncClient | None, addr: str | None, token: str | None,
                      cluster: AsyncCluster | None = None, id: str = "") -> tuple[AsyncClient, _AsyncOwner | None]:
        if cluster is not None:
            only_one(client, addr, token)
            return await cluster.client_for(id), None
        if client is not None:
            return client, None
        c = AsyncClient(addr, token=token)
        return c, _AsyncOwner(c)

    @classmethod
    async def create(cls, env: str = "shell", *, seed: int | None = None, options: Mapping[str, Any] | None = None,
               run: str = "", group_id: str = "", lease_ttl: float | None = None, timeout: float | None = None,
               addr: str | None = None, token: str | None = None, client: AsyncClient | None = None,
               cluster: AsyncCluster | None = None) -> AsyncSandbox:
        """As deltagym.Sandbox.create, awaited (cluster: a deltagym.aio.AsyncCluster)."""
        if cluster is not None:
            only_one(client, addr, token)
            h = await cluster.reset(env, seed=seed, options=options, run=run, group_id=group_id, lease_ttl=lease_ttl,
                                    timeout=ops.deadline(None, timeout if timeout is not None else cluster.timeout))
            assert h.reset_response is not None
            return cls(h, timeout=timeout, task=cv.reset_task(h.reset_response))
        c, owner = await cls._client(client, addr, token)
        try:
            h = await c.reset(env, seed=seed, options=options, run=run, group_id=group_id, lease_ttl=lease_ttl,
                        timeout=ops.deadline(None, timeout if timeout is not None else c.timeout))
        except BaseException:
            if owner is not None:
                await c.close()
            raise
        assert h.reset_response is not None
        return cls(h, timeout=timeout, task=cv.reset_task(h.reset_response), owner=owner)

    @classmethod
    async def connect(cls, sandbox_id: str, *, timeout: float | None = None, addr: str | None = None,
                token: str | None = None, client: AsyncClient | None = None,
                cluster: AsyncCluster | None = None) -> AsyncSandbox:
        """As deltagym.Sandbox.connect, awaited."""
        c, owner = await cls._client(client, addr, token, cluster, sandbox_id)
        try:
            info = await c.get_sandbox(sandbox_id, timeout=timeout if timeout is not None else c.timeout)
        except BaseException:
            if owner is not None:
                await c.close()
            raise
        # The lease's time left bounds its TTL from below: heartbeats at a third of it keep it.
        c._saw_lease(info.lease_expire_time)
        h = AsyncSandboxHandle(c, info.sandbox_id, env=info.env, episode_id=info.episode_id,
                               start_checkpoint_id=info.start_checkpoint_id)
        h.saw_lease(info.lease_expire_time)
        return cls(h, timeout=timeout, owner=owner)

    @classmethod
    async def fork_from(cls, checkpoint: Checkpoint | str, n: int = 1, *, group_id: str = "", run: str = "",
                  fresh_entropy: bool = False, lease_ttl: float | None = None, timeout: float | None = None,
                  addr: str | None = None, token: str | None = None,
                  client: AsyncClient | None = None, cluster: AsyncCluster | None = None) -> list[AsyncSandbox]:
        """As deltagym.Sandbox.fork_from, awaited."""
        c, owner = await cls._client(client, addr, token, cluster, _checkpoint_id(checkpoint))
        hs: list[AsyncSandboxHandle] = []
        try:
            dl = timeout if timeout is not None else c.timeout
            if cluster is not None:  # the cluster counts them placed on the checkpoint's node
                hs = await cluster.fork(_checkpoint_id(checkpoint), n, group_id=group_id, run=run,
                                        fresh_entropy=fresh_entropy, lease_ttl=lease_ttl, timeout=dl)
            else:
                hs = await c.fork(checkpoint_id=_checkpoint_id(checkpoint), n=n, group_id=group_id, run=run,
                                  fresh_entropy=fresh_entropy, lease_ttl=lease_ttl, timeout=dl)
            if hs and c._lease_ttl is None:
                # A fork's answer has no lease time: one heartbeat learns the TTL the heartbeats keep to.
                await c.heartbeat(hs, timeout=timeout if timeout is not None else c.timeout)
            env = checkpoint.env if isinstance(checkpoint, Checkpoint) else ""
            if hs and not env:
                # A fork's answer has no env: the first child's description has it.
                env = (await c.get_sandbox(hs[0].id, timeout=timeout if timeout is not None else c.timeout)).env
            for h in hs:
                h.env = env
        except BaseException:
            for h in hs:
                await h.detach()
            if owner is not None:
                await c.close()
            raise
        kids = [cls(h, timeout=timeout, owner=owner) for h in hs]
        if owner is not None and not kids:
            await c.close()
        return kids

    async def _step(self, action: action_pb2.Action, setup: bool, deadline: float | None,
                    checkpoint: bool = False, wait_for_digest: bool = False, dedupe: bool = False) -> es.StepResponse:
        return await self._send(ops.step_request(self.id, action, setup, checkpoint, wait_for_digest, dedupe), deadline)

    async def _send(self, req: es.StepRequest, deadline: float | None) -> es.StepResponse:
        resp: es.StepResponse = await self.client._call("Step", self.client._env.Step, req, False, deadline)
        self._saw_step(resp)
        return resp

    async def _act(self, action: action_pb2.Action, kind: str, setup: bool | None, timeout: float | None) -> Any:
        s = self._setup(setup)
        x, _ = cv.observation(await self._step(action, s, self._deadline(timeout)), kind, s)
        return x

    # --- commands -------------------------------------------------------------------------------

    async def run(self, cmd: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
            session: str | None = None, check: bool = False, on_stdout: AsyncOutputCallback | None = None,
            on_stderr: AsyncOutputCallback | None = None, setup: bool | None = None,
            checkpoint: bool = False) -> CommandResult:
        """As deltagym.Sandbox.run, awaited."""
        if on_stdout is not None or on_stderr is not None:
            async with self.stream(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, session=session,
                                   setup=setup, checkpoint=checkpoint) as s:
                async for chunk in s:
                    cb = on_stdout if chunk.stream == "stdout" else on_stderr
                    if cb is not None and chunk.text:
                        r = cb(chunk.text)
                        if inspect.isawaitable(r):
                            await r
                result = await s.result()
        else:
            s_ = self._setup(setup)
            req = ops.exec_request(self.id, s_, checkpoint, cmd, timeout, cwd, env, stdin, session)
            result = cv.exec_response(await self._send(req, self._command_deadline(timeout)), s_)
        if check and not result.ok:
            raise CommandExitError(result, cmd)
        return result

    def stream(self, cmd: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
               env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
               session: str | None = None, setup: bool | None = None,
               checkpoint: bool = False) -> AsyncCommandStream:
        """Runs a command with its output streamed (StreamStep): `async for`
        the returned AsyncCommandStream for OutputChunks as they come, then
        await its result(). Arguments as for run(). Leaving an `async with`
        block before the end cancels the call, which cuts the command short."""
        s = self._setup(setup)
        req = ops.exec_request(self.id, s, checkpoint, cmd, timeout, cwd, env, stdin, session)
        return AsyncCommandStream(self, req, s, self._command_deadline(timeout))

    async def step(self, action: action_pb2.Action | str, *, checkpoint: bool = False, setup: bool | None = None,
                   checkpoint_wait_for_digest: bool = False, checkpoint_dedupe: bool = False,
                   timeout: float | None = None) -> StepResult:
        """As deltagym.Sandbox.step, awaited."""
        from .actions import coerce

        s = self._setup(setup)
        act = coerce(action)
        if act.WhichOneof("kind") == "submit":
            s = False
        dl = self._deadline(timeout)
        if act.WhichOneof("kind") == "exec" and act.exec.timeout_seconds > 0 and timeout is None:
            dl = ops.command_deadline(act.exec.timeout_seconds, self.timeout)
        return cv.step_result(await self._step(act, s, dl, checkpoint, checkpoint_wait_for_digest, checkpoint_dedupe), s)

    # --- episode --------------------------------------------------------------------------------

    async def submit(self, answer: str | None = None, *, timeout: float | None = None) -> SubmitResult:
        """Ends the episode: the env's verifier runs and gives the reward. Never a setup step."""
        from .actions import submit

        return cv.submit_result(await self._step(submit(answer), False, self._deadline(timeout)))

    async def evaluate(self, *, timeout: float | None = None) -> Evaluation:
        """Runs the verifier on the sandbox's state without changing it or ending the episode."""
        return cv.evaluation(await self.client.evaluate(self.id, timeout=self._deadline(timeout)))

    async def checkpoint(self, *, durable: bool = False, process_mode: ProcessMode | None = None,
                         wait_for_digest: bool = False, dedupe: bool = False,
                         timeout: float | None = None) -> Checkpoint:
        """As deltagym.Sandbox.checkpoint, awaited."""
        r = await self.client.checkpoint(self.id, durable=durable, process_mode=to_process_mode(process_mode),
                                         wait_for_digest=wait_for_digest, dedupe=dedupe,
                                         timeout=self._deadline(timeout))
        return dataclasses.replace(cv.checkpoint(r), env=self.env)

    async def restore(self, checkpoint: Checkpoint | str, *, fresh_entropy: bool = False,
                timeout: float | None = None) -> Restored:
        """Puts the sandbox back at a checkpoint; a new episode starts there."""
        r = await self.client.restore(self.id, _checkpoint_id(checkpoint), fresh_entropy=fresh_entropy,
                                timeout=self._deadline(timeout))
        self._h.episode_id = r.episode_id
        return cv.restored(r)

    async def fork(self, n: int = 1, *, group_id: str = "", run: str = "", fresh_entropy: bool = False,
             lease_ttl: float | None = None, timeout: float | None = None) -> list[AsyncSandbox]:
        """As deltagym.Sandbox.fork, awaited."""
        hs = await self.client.fork(sandbox_id=self.id, n=n, group_id=group_id, run=run, fresh_entropy=fresh_entropy,
                              lease_ttl=lease_ttl, timeout=self._deadline(timeout))
        for h in hs:
            h.env = self.env
        return [AsyncSandbox(h, timeout=self.timeout, task=self.task, owner=self._owner) for h in hs]

    async def describe(self, *, timeout: float | None = None) -> SandboxInfo:
        """The server's description of the sandbox."""
        info = cv.sandbox_info(await self.client.get_sandbox(self.id, timeout=self._deadline(timeout)))
        if info.lease_expires_at is not None:
            self._h.lease_expires_at = info.lease_expires_at
        return info

    async def is_alive(self, *, timeout: float | None = None) -> bool:
        """Whether the server still has the sandbox, open (its episode may have ended)."""
        if self._closed:
            return False
        try:
            return (await self.describe(timeout=timeout)).state != "closed"
        except NotFound:
            return False

    async def extend_lease(self, ttl: float | None = None, *, timeout: float | None = None) -> float | None:
        """As deltagym.Sandbox.extend_lease, awaited."""
        resp = await self.client.heartbeat([self.id], lease_ttl=ttl, timeout=self._deadline(timeout))
        if self.id in resp.unknown_sandbox_ids:
            raise from_code(5, f"sandbox {self.id} is gone (closed, or its lease ran out)", "Heartbeat",
                            reason="SANDBOX_NOT_FOUND", metadata={"sandbox_id": self.id})
        if ttl is not None:
            self._h.lease_ttl = ttl
        for lease in resp.leases:
            if lease.sandbox_id == self.id:
                self._h.saw_lease(lease.expire_time)
        return self._h.lease_expires_at

    async def close(self, *, timeout: float | None = None) -> None:
        """As deltagym.Sandbox.close, awaited."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._h.close(timeout=ops.deadline(timeout, self.timeout))
        except NotFound:
            pass  # reaped or closed elsewhere: what close asks for holds
        finally:
            if self._owner is not None:
                await self._owner.release()

    async def detach(self) -> None:
        """As deltagym.Sandbox.detach, awaited."""
        if self._closed:
            return
        self._closed = True
        await self._h.detach()
        if self._owner is not None:
            await self._owner.release()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()



class AsyncCommandStream:
    """A command's output as it comes (AsyncSandbox.stream): `async for` it
    for OutputChunks; `await result()` gives the CommandResult once the
    command ended. An async context manager: leaving it early cancels the
    call, which cuts the command short."""

    def __init__(self, sb: AsyncSandbox, req: es.StepRequest, setup: bool, deadline: float | None) -> None:
        self._sb = sb
        self._setup = setup
        self._call = sb.client.stream_step(req, timeout=deadline)
        self._dec = cv.ChunkDecoder()
        self._result: CommandResult | None = None
        self._done = False

    async def __aenter__(self) -> AsyncCommandStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self

    async def __anext__(self) -> OutputChunk:
        while not self._done:
            try:
                msg = await self._call.__anext__()
            except StopAsyncIteration:
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
        raise StopAsyncIteration

    async def result(self) -> CommandResult:
        """The command's result; awaiting it before the end reads (and drops) the rest of the output."""
        async for _ in self:
            pass
        if self._result is None:
            raise from_code(2, "the stream ended without the step's response", "StreamStep")
        return self._result

    def close(self) -> None:
        """Cancels the call when the command has not ended."""
        if not self._done:
            self._done = True
            self._call.cancel()


class AsyncFiles:
    """File operations inside the sandbox (AsyncSandbox.files). Paths are
    absolute or relative to the env's working directory, and cannot
    escape the sandbox. Each operation is one step of the episode (a large
    read, several); each takes setup= and timeout=. An operation the
    sandbox's state refuses (a missing file to read, a directory to
    write) raises ActionFailed with its errno."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb

    async def read_bytes(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> bytes:
        """The whole file, read in parts when larger than one read may return."""
        out = bytearray()
        while True:
            x = await self._sb._act(ops.read_action(path, len(out)), "read_file", setup, timeout)
            out += x.content
            if not x.truncated or not x.content:
                return bytes(out)

    async def read(self, path: str, *, encoding: str = "utf-8", errors: str = "replace", setup: bool | None = None,
             timeout: float | None = None) -> str:
        """The whole file as text."""
        return (await self.read_bytes(path, setup=setup, timeout=timeout)).decode(encoding, errors)

    async def write(self, path: str, data: str | bytes, *, mode: int | None = None, append: bool = False,
              setup: bool | None = None, timeout: float | None = None) -> int:
        """As deltagym.Files.write, awaited."""
        x = await self._sb._act(ops.write_action(path, data, mode, append), "write_file", setup, timeout)
        return int(x.size)

    async def list(self, path: str = ".", depth: int = 1, *, setup: bool | None = None,
             timeout: float | None = None) -> builtins.list[FileInfo]:
        """As deltagym.Files.list, awaited."""
        x = await self._sb._act(ops.list_action(path, depth), "list_dir", setup, timeout)
        return [cv.file_info(f) for f in x.entries]

    async def stat(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> FileInfo | None:
        """A path's FileInfo (of a final link itself), None when it does not exist."""
        x = await self._sb._act(ops.stat_action(path), "stat", setup, timeout)
        return cv.file_info(x.info) if x.exists else None

    async def exists(self, path: str, *, setup: bool | None = None, timeout: float | None = None) -> bool:
        """Whether the path exists."""
        return (await self.stat(path, setup=setup, timeout=timeout)) is not None

    async def remove(self, path: str, *, recursive: bool = False, setup: bool | None = None,
               timeout: float | None = None) -> int:
        """As deltagym.Files.remove, awaited."""
        x = await self._sb._act(ops.remove_action(path, recursive), "remove", setup, timeout)
        return int(x.removed)

    async def mkdir(self, path: str, *, parents: bool = True, mode: int | None = None, setup: bool | None = None,
              timeout: float | None = None) -> bool:
        """As deltagym.Files.mkdir, awaited."""
        x = await self._sb._act(ops.mkdir_action(path, parents, mode), "make_dir", setup, timeout)
        return bool(x.created)

    async def upload_tar(self, data: bytes, remote_dir: str, *, setup: bool | None = None,
                   timeout: float | None = None) -> UploadResult:
        """As deltagym.Files.upload_tar, awaited."""
        x = await self._sb._act(ops.upload_action(data, remote_dir), "upload", setup, timeout)
        return cv.upload_result(x)

    async def upload(self, local_path: str, remote_dir: str, *, setup: bool | None = None,
               timeout: float | None = None) -> UploadResult:
        """As deltagym.Files.upload, awaited."""
        return await self.upload_tar(ops.pack(local_path), remote_dir, setup=setup, timeout=timeout)

    async def download_tar(self, remote_path: str, *, setup: bool | None = None, timeout: float | None = None) -> bytes:
        """As deltagym.Files.download_tar, awaited."""
        x = await self._sb._act(ops.download_action(remote_path), "download", setup, timeout)
        return bytes(x.tar)

    async def download(self, remote_path: str, local_dir: str, *, setup: bool | None = None,
                 timeout: float | None = None) -> builtins.list[str]:
        """As deltagym.Files.download, awaited."""
        return ops.extract(await self.download_tar(remote_path, setup=setup, timeout=timeout), local_dir)


class AsyncProcess(ProcessBase):
    """A process started by AsyncSandbox.processes.start (see deltagym.Process)."""

    def __init__(self, sb: AsyncSandbox, pid: int, session: str, result: CommandResult,
                 expect: Sequence[str] = ()) -> None:
        super().__init__(pid, session, result, expect)
        self._sb = sb

    async def send(self, text: str, *, expect: Sequence[str] | None = None, timeout: float | None = None,
                   setup: bool | None = None) -> CommandResult:
        """As deltagym.Process.send, awaited."""
        action = self._send_action(text, expect, timeout)
        s = self._sb._setup(setup)
        return self._saw(cv.exec_response(await self._sb._step(action, s, self._sb._command_deadline(timeout)), s))

    async def interrupt(self, *, expect: Sequence[str] | None = None, setup: bool | None = None,
                        timeout: float | None = None) -> CommandResult | None:
        """As deltagym.Process.interrupt, awaited."""
        if not self.session:
            await self.kill(_signal.SIGINT, setup=setup, timeout=timeout)
            return None
        action = self._interrupt_action(expect, timeout)
        s = self._sb._setup(setup)
        return self._saw(cv.exec_response(await self._sb._step(action, s, self._sb._command_deadline(timeout)), s))

    async def kill(self, signal: int = _signal.SIGKILL, *, group: bool = False, setup: bool | None = None,
             timeout: float | None = None) -> None:
        """Sends a signal (default SIGKILL) to the process, or its process group."""
        if not self.pid:
            raise ValueError("this process's pid is unknown (an interactive one): use interrupt()")
        await self._sb.processes.kill(self.pid, signal, group=group, setup=setup, timeout=timeout)
        self._killed = self._killed or signal == _signal.SIGKILL


class AsyncProcesses:
    """Processes inside the sandbox (AsyncSandbox.processes)."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self._sb = sb
        self._n = 0

    def _session(self, session: str | None) -> str:
        if session:
            return session
        self._n += 1
        return f"proc-{self._n}"

    async def start(self, cmd: str | Sequence[str], *, session: str | None = None, stdin: bool = False,
              cwd: str | None = None, env: Mapping[str, str] | None = None, expect: Sequence[str] | None = None,
              timeout: float | None = None, setup: bool | None = None) -> AsyncProcess:
        """As deltagym.Processes.start, awaited."""
        s = self._sb._setup(setup)
        if not stdin:
            action = ops.exec_action(cmd, cwd=cwd, env=env, session=session, background=True)
            r = cv.exec_response(await self._sb._step(action, s, self._sb._deadline(timeout)), s)
            return AsyncProcess(self._sb, r.pid, "", r)
        if not isinstance(cmd, str):
            raise TypeError("an interactive process's cmd is a str, typed into its session")
        name = self._session(session)
        if cwd or env:
            raise ValueError("an interactive process takes no cwd or env: cd or export in its session first")
        action = ops.interactive_action(name, cmd, expect=expect or (), timeout=timeout)
        r = cv.exec_response(await self._sb._step(action, s, self._sb._command_deadline(timeout)), s)
        return AsyncProcess(self._sb, 0, name, r, expect or ())

    async def list(self, *, setup: bool | None = None, timeout: float | None = None) -> builtins.list[ProcessInfo]:
        """The processes running in the sandbox (its init excluded), by pid."""
        x = await self._sb._act(ops.list_processes_action(), "list_processes", setup, timeout)
        return [cv.process_info(p) for p in x.processes]

    async def kill(self, pid: int, signal: int = _signal.SIGKILL, *, group: bool = False, setup: bool | None = None,
             timeout: float | None = None) -> None:
        """As deltagym.Processes.kill, awaited."""
        await self._sb._act(ops.signal_action(pid, int(signal), group), "signal", setup, timeout)

