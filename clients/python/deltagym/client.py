"""The synchronous deltagym client and its sandbox handle.

    from deltagym import Client, actions

    with Client() as c, c.reset("shell", seed=1) as sb:
        print(sb.exec("echo hi").observation.exec.stdout)
        ck = sb.checkpoint().checkpoint_id
        sb.write_file("answer.txt", "42\\n")
        print(sb.submit().reward)
        sb.restore(ck)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from . import _common as c, _convert as cv
from ._proto.deltagym.v1 import (
    action_pb2,
    env_pb2,
    env_service_pb2 as es,
    env_service_pb2_grpc as es_grpc,
    ledger_service_pb2 as ls,
    ledger_service_pb2_grpc as ls_grpc,
    node_service_pb2 as ns,
    node_service_pb2_grpc as ns_grpc,
)
from .actions import argv as _argv, command as _command, read_file as _read_file, submit as _submit, write_file as _write_file
from .errors import DeltagymError, Draining, from_code, from_rpc_error, on_node
from .types import Checkpoint, CheckpointDiff, DiffDetail

__all__ = ["Client", "Sandbox", "SandboxHandle"]

log = logging.getLogger("deltagym")

# The deadline argument's default: the client's own timeout.
_DEFAULT: Any = object()


class Client:
    """A connection to a deltagym server covering EnvService, LedgerService and NodeService.

    Args:
        addr: host:port of the server; default $DELTAGYM_ADDR, else 127.0.0.1:8080.
        token: bearer token; default $DELTAGYM_TOKEN (none when unset).
        timeout: deadline in seconds of each call; None means no deadline.
        retry: how safe calls are retried on UNAVAILABLE (see RetryPolicy).
        heartbeat: whether sandbox handles renew their leases in a background thread.
        channel: an existing grpc.Channel to use instead of dialing addr.

    Attributes:
        node: the name of the cluster node the server is, set by deltagym.Cluster ("" outside
            one): an UNAVAILABLE of a call then raises NodeUnavailable naming the node and addr.
    """

    def __init__(
        self,
        addr: str | None = None,
        *,
        token: str | None = None,
        timeout: float | None = None,
        retry: c.RetryPolicy = c.DEFAULT_RETRY,
        heartbeat: bool = True,
        channel: grpc.Channel | None = None,
    ) -> None:
        self.addr = c.resolve_addr(addr)
        self._md = c.metadata(c.resolve_token(token))
        self.timeout = timeout
        self.retry = retry
        self.heartbeat_enabled = heartbeat
        self._own_channel = channel is None
        self._channel = channel or grpc.insecure_channel(self.addr, options=c.CHANNEL_OPTIONS)
        self._env = es_grpc.EnvServiceStub(self._channel)
        self._ledger = ls_grpc.LedgerServiceStub(self._channel)
        self._node_service = ns_grpc.NodeServiceStub(self._channel)
        self.node = ""
        self._lease_ttl: float | None = None
        self._handles: set[SandboxHandle] = set()
        self._lock = threading.Lock()
        self._closed = False

    # --- plumbing -------------------------------------------------------------

    def _call(self, name: str, fn: Callable[..., Any], req: Any, safe: bool, timeout: Any = _DEFAULT) -> Any:
        deadline = self.timeout if timeout is _DEFAULT else timeout
        if not safe:
            return self._call_once(name, fn, req, deadline)
        policy = self.retry
        attempt = 0
        while True:
            try:
                return fn(req, metadata=self._md, timeout=deadline)
            except grpc.RpcError as e:
                err = self._error(e, name)
                # A draining node stays draining: its DRAINING is for the caller to go elsewhere.
                if err.code == grpc.StatusCode.UNAVAILABLE and not isinstance(err, Draining) \
                        and attempt + 1 < policy.max_attempts:
                    time.sleep(policy.backoff(attempt))
                    attempt += 1
                    continue
                raise err from None

    def _call_once(self, name: str, fn: Callable[..., Any], req: Any, deadline: float | None) -> Any:
        """A call that is never retried (unsafe to repeat), with this deadline."""
        try:
            return fn(req, metadata=self._md, timeout=deadline)
        except grpc.RpcError as e:
            raise self._error(e, name) from None

    def _error(self, e: grpc.RpcError, method: str) -> DeltagymError:
        """The DeltagymError of a failed call: a NodeUnavailable when the server is a cluster's node that cannot be reached."""
        return on_node(from_rpc_error(e, method, bool(self._md)), self.node, self.addr)

    def _saw_lease(self, ts: Any) -> None:
        ttl = c.lease_seconds(ts, time.time())
        if ttl is not None and ttl > 0:
            self._lease_ttl = ttl

    def close(self) -> None:
        """Closes every sandbox handle still open, then the channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            try:
                h.close()
            except DeltagymError as e:
                log.warning("closing sandbox %s: %s", h.id, e)
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- EnvService -----------------------------------------------------------

    def list_envs(self) -> list[env_pb2.EnvInfo]:
        """Returns the catalog with the state of each env's warm pool."""
        return list(self._call("ListEnvs", self._env.ListEnvs, es.ListEnvsRequest(), True).envs)

    def register_env(self, spec: env_pb2.EnvSpec | Mapping[str, Any], *, replace: bool = False) -> env_pb2.EnvInfo:
        """Adds an env (an EnvSpec or its JSON form as a dict) to the catalog."""
        req = es.RegisterEnvRequest(spec=c.env_spec(spec), replace=replace)
        resp: es.RegisterEnvResponse = self._call("RegisterEnv", self._env.RegisterEnv, req, False)
        return resp.env

    def import_image(self, name: str, path: str, *, format: es.ImageFormat | str | None = None,
                     reference: str = "") -> es.ImportImageResponse:
        """Imports a base image from a path on the server (format: an es.ImageFormat value)."""
        req = es.ImportImageRequest(name=name, path=path, format=format, reference=reference)
        resp: es.ImportImageResponse = self._call("ImportImage", self._env.ImportImage, req, False)
        return resp

    def reset(
        self,
        env: str,
        *,
        seed: int | None = None,
        options: Mapping[str, Any] | None = None,
        run: str = "",
        group_id: str = "",
        idempotency_key: str | None = None,
        lease_ttl: float | None = None,
        timeout: Any = _DEFAULT,
    ) -> SandboxHandle:
        """Leases a warm sandbox of env and starts an episode. Retried safely:
        each call carries an idempotency key (a fresh one unless given).
        lease_ttl: seconds the sandbox lives without a call or heartbeat
        (default: the server's --lease-ttl). timeout: this call's deadline."""
        req = c.reset_request(env, seed, options, run, group_id, idempotency_key)
        req.lease_ttl_seconds = c.ttl_seconds(lease_ttl)
        resp: es.ResetResponse = self._call("Reset", self._env.Reset, req, True, timeout)
        self._saw_lease(resp.lease_expire_time)
        return SandboxHandle(self, resp.sandbox_id, env=env, episode_id=resp.episode_id,
                             start_checkpoint_id=resp.checkpoint_id, reset=resp, lease_ttl=lease_ttl)

    def step(self, sandbox_id: str, action: action_pb2.Action | str, *, checkpoint: bool = False,
             restore: str | None = None, fresh_entropy: bool = False, setup: bool = False,
             checkpoint_wait_for_digest: bool = False, checkpoint_dedupe: bool = False,
             timeout: Any = _DEFAULT) -> es.StepResponse:
        """Performs one action (an Action, or a str run as a shell command). Never retried.
        With restore, the sandbox is first restored to that checkpoint, as restore() does
        (a new episode starts there; fresh_entropy as in restore), in the same call.
        setup marks a setup step (StepRequest.setup). checkpoint_wait_for_digest and checkpoint_dedupe
        are checkpoint()'s wait_for_digest and dedupe for the checkpoint the step takes (they need
        checkpoint): the response's checkpoint_digest and checkpoint_deduplicated answer them."""
        req = c.step_request(sandbox_id, action, checkpoint, restore, fresh_entropy, checkpoint_wait_for_digest,
                             checkpoint_dedupe)
        req.setup = setup
        resp: es.StepResponse = self._call("Step", self._env.Step, req, False, timeout)
        return resp

    def stream_step(self, req: es.StepRequest, *, timeout: Any = _DEFAULT) -> _Stream:
        """Starts a StreamStep: the output chunks of the step's command as they
        come, then its StepResponse. Never retried. Errors raise as
        DeltagymError while iterating; the returned iterator is also the
        gRPC call (cancel() cuts the step short)."""
        deadline = self.timeout if timeout is _DEFAULT else timeout
        call = self._env.StreamStep(es.StreamStepRequest(step=req), metadata=self._md, timeout=deadline)
        return _Stream(call, self._error)

    def step_stream(self, steps: Iterable[es.StepRequest]) -> list[es.StepResponse | DeltagymError]:
        """Pipelines steps over many sandboxes on one StepStream. Returns, in
        the order sent, each step's response or the DeltagymError it failed with."""
        reqs = [es.StepStreamRequest(request_id=i, step=s) for i, s in enumerate(steps)]
        out: list[Any] = [None] * len(reqs)
        try:
            for r in self._env.StepStream(iter(reqs), metadata=self._md, timeout=self.timeout):
                if r.WhichOneof("result") == "step":
                    out[r.request_id] = r.step
                else:
                    out[r.request_id] = from_code(r.error.code, r.error.message, "StepStream", reason=r.error.reason)
        except grpc.RpcError as e:
            raise self._error(e, "StepStream") from None
        for i, o in enumerate(out):
            if o is None:
                out[i] = from_code(grpc.StatusCode.UNKNOWN, "no response on the stream", "StepStream")
        return out

    def checkpoint(self, sandbox_id: str, *, durable: bool = False,
                   process_mode: env_pb2.ProcessMode | str | None = None, wait_for_digest: bool = False,
                   dedupe: bool = False, timeout: Any = _DEFAULT) -> es.CheckpointResponse:
        """Saves the sandbox's whole state as an immutable checkpoint. wait_for_digest
        answers once the checkpoint's state digest is computed, with it (digest);
        dedupe, which implies it, answers with an existing checkpoint of the env that
        holds the same state, if there is one, instead of keeping a second copy
        (deduplicated is then set)."""
        req = c.checkpoint_request(sandbox_id, durable, process_mode, wait_for_digest, dedupe)
        resp: es.CheckpointResponse = self._call("Checkpoint", self._env.Checkpoint, req, False, timeout)
        return resp

    def restore(self, sandbox_id: str, checkpoint_id: str, *, fresh_entropy: bool = False,
                timeout: Any = _DEFAULT) -> es.RestoreResponse:
        """Puts the sandbox at a checkpoint; a new episode starts there."""
        req = es.RestoreRequest(sandbox_id=sandbox_id, checkpoint_id=checkpoint_id, fresh_entropy=fresh_entropy)
        resp: es.RestoreResponse = self._call("Restore", self._env.Restore, req, False, timeout)
        return resp

    def fork(
        self,
        *,
        checkpoint_id: str | None = None,
        sandbox_id: str | None = None,
        n: int = 1,
        group_id: str = "",
        run: str = "",
        fresh_entropy: bool = False,
        idempotency_key: str | None = None,
        lease_ttl: float | None = None,
        timeout: Any = _DEFAULT,
    ) -> list[SandboxHandle]:
        """Creates n sandboxes at a checkpoint or at a sandbox's current state
        and returns their handles. Retried safely with an idempotency key.
        lease_ttl as for reset, for each child."""
        req = c.fork_request(checkpoint_id, sandbox_id, n, group_id, run, fresh_entropy, idempotency_key)
        req.lease_ttl_seconds = c.ttl_seconds(lease_ttl)
        resp: es.ForkResponse = self._call("Fork", self._env.Fork, req, True, timeout)
        return [SandboxHandle(self, sid, env="", episode_id=eid, start_checkpoint_id=resp.checkpoint_id, lease_ttl=lease_ttl)
                for sid, eid in zip(resp.sandbox_ids, resp.episode_ids, strict=False)]

    def release_checkpoint(self, checkpoint_id: str) -> None:
        """Drops the caller's hold on a checkpoint."""
        req = es.ReleaseCheckpointRequest(checkpoint_id=checkpoint_id)
        self._call("ReleaseCheckpoint", self._env.ReleaseCheckpoint, req, False)

    def diff_checkpoints(self, base: Checkpoint | str, checkpoint: Checkpoint | str, *,
                         detail: DiffDetail = "paths", path: str | None = None, max_paths: int | None = None,
                         timeout: Any = _DEFAULT) -> CheckpointDiff:
        """What differs from base to checkpoint (Checkpoints or IDs, of one env): the
        paths added, removed and modified, and the processes that came, went or
        changed, as a typed CheckpointDiff (str() of it reads as `git diff --stat`).
        detail "paths" gives types, sizes and modes; "lines" also counts the lines
        added and removed in each text file of at most 64 KiB; "unified" also gives
        their unified diffs. path keeps the changes at that absolute path and below;
        max_paths caps the paths returned (default 10,000, at most 100,000), past
        which truncated is set. Read-only, so retried safely."""
        req = c.diff_request(base, checkpoint, detail, path, max_paths)
        resp: es.DiffCheckpointsResponse = self._call("DiffCheckpoints", self._env.DiffCheckpoints, req, True,
                                                      timeout)
        return cv.checkpoint_diff(resp, req.base_checkpoint_id, req.checkpoint_id, detail)

    def list_checkpoints(self, *, env: str = "", run: str = "", group_id: str = "", episode_id: str = "",
                         timeout: Any = _DEFAULT) -> list[es.CheckpointSummary]:
        """Lists the checkpoints the server holds, oldest first, filtered by env, run,
        group and episode: where each was taken, what keeps it, its digest once computed."""
        req = c.list_checkpoints_request(env, run, group_id, episode_id)
        resp: es.ListCheckpointsResponse = self._call("ListCheckpoints", self._env.ListCheckpoints, req, True,
                                                      timeout)
        return list(resp.checkpoints)

    def evaluate(self, sandbox_id: str, *, timeout: Any = _DEFAULT) -> es.EvaluateResponse:
        """Runs the verifier on the sandbox's state without changing it."""
        req = es.EvaluateRequest(sandbox_id=sandbox_id)
        resp: es.EvaluateResponse = self._call("Evaluate", self._env.Evaluate, req, True, timeout)
        return resp

    def close_sandbox(self, sandbox_id: str, *, timeout: Any = _DEFAULT) -> None:
        """Ends the sandbox's episode and frees it. Closing twice succeeds."""
        self._call("Close", self._env.Close, es.CloseRequest(sandbox_id=sandbox_id), True, timeout)

    def heartbeat(self, sandbox_ids: Sequence[str | SandboxHandle], *, lease_ttl: float | None = None,
                  timeout: Any = _DEFAULT) -> es.HeartbeatResponse:
        """Renews the leases of sandboxes; with lease_ttl, their TTL becomes that many seconds."""
        req = es.HeartbeatRequest(sandbox_ids=c.ids(sandbox_ids), lease_ttl_seconds=c.ttl_seconds(lease_ttl))
        resp: es.HeartbeatResponse = self._call("Heartbeat", self._env.Heartbeat, req, True, timeout)
        if lease_ttl is None:
            for lease in resp.leases:
                self._saw_lease(lease.expire_time)
        return resp

    def get_sandbox(self, sandbox_id: str, *, timeout: Any = _DEFAULT) -> env_pb2.Sandbox:
        """Describes one sandbox."""
        req = es.GetSandboxRequest(sandbox_id=sandbox_id)
        resp: es.GetSandboxResponse = self._call("GetSandbox", self._env.GetSandbox, req, True, timeout)
        return resp.sandbox

    def list_sandboxes(self, *, env: str = "", run: str = "", group_id: str = "") -> list[env_pb2.Sandbox]:
        """Lists the live sandboxes, filtered by env, run and group."""
        req = es.ListSandboxesRequest(env=env, run=run, group_id=group_id)
        return list(self._call("ListSandboxes", self._env.ListSandboxes, req, True).sandboxes)

    def get_node(self, *, timeout: Any = _DEFAULT) -> ns.NodeInfo:
        """Describes the server as a node of a cluster: its name, address and load (NodeService.GetNode)."""
        resp: ns.GetNodeResponse = self._call("GetNode", self._node_service.GetNode, ns.GetNodeRequest(), True, timeout)
        return resp.node

    # --- LedgerService --------------------------------------------------------

    def list_episodes(self, *, run: str = "", group_id: str = "", env: str = "", page_size: int = 0,
                      page_token: str = "") -> ls.ListEpisodesResponse:
        """Returns one page of episodes in the order they started, oldest first."""
        req = ls.ListEpisodesRequest(run=run, group_id=group_id, env=env, page_size=page_size, page_token=page_token)
        resp: ls.ListEpisodesResponse = self._call("ListEpisodes", self._ledger.ListEpisodes, req, True)
        return resp

    def iter_episodes(self, *, run: str = "", group_id: str = "", env: str = "", page_size: int = 0) -> Iterator[ls.Episode]:
        """Yields every matching episode in the order they started, fetching pages as needed."""
        token = ""
        while True:
            page = self.list_episodes(run=run, group_id=group_id, env=env, page_size=page_size, page_token=token)
            yield from page.episodes
            token = page.next_page_token
            if not token:
                return

    def get_trajectory(self, episode_id: str) -> ls.GetTrajectoryResponse:
        """Returns an episode and its steps, inherited ones first."""
        req = ls.GetTrajectoryRequest(episode_id=episode_id)
        resp: ls.GetTrajectoryResponse = self._call("GetTrajectory", self._ledger.GetTrajectory, req, True)
        return resp

    def get_checkpoint_tree(self, *, run: str | None = None, episode_id: str | None = None) -> list[ls.CheckpointNode]:
        """Returns the checkpoints of a run or of an episode's lineage, parents first."""
        return list(self._call("GetCheckpointTree", self._ledger.GetCheckpointTree, c.tree_request(run, episode_id), True).nodes)

    def get_group_advantages(self, group_id: str, *, reward_source: str = "") -> ls.GetGroupAdvantagesResponse:
        """Computes the group-relative (GRPO) advantages of a group's episodes."""
        req = ls.GetGroupAdvantagesRequest(group_id=group_id, reward_source=reward_source)
        resp: ls.GetGroupAdvantagesResponse = self._call("GetGroupAdvantages", self._ledger.GetGroupAdvantages, req, True)
        return resp

    def report_reward(self, episode_id: str, name: str, value: float, *, source: str = "") -> None:
        """Records a reward for an episode (same name and source replaces)."""
        req = ls.ReportRewardRequest(episode_id=episode_id, name=name, value=value, source=source)
        self._call("ReportReward", self._ledger.ReportReward, req, False)


class _Stream:
    """A StreamStep call's responses, its errors raised as DeltagymError."""

    def __init__(self, call: Any, error: Callable[[grpc.RpcError, str], DeltagymError]) -> None:
        self._call = call
        self._error = error

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> es.StreamStepResponse:
        try:
            return next(self._call)  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            raise self._error(e, "StreamStep") from None

    def cancel(self) -> None:
        """Cancels the call, which cuts the step short."""
        self._call.cancel()


class SandboxHandle:
    """A leased sandbox as the low-level Client sees it: every call returns
    the server's messages. Its lease is renewed by a background thread
    until close(); use it as a context manager to close it. (The typed
    API is deltagym.Sandbox.)

    Attributes:
        id: the sandbox ID.
        env: the env's catalog name ("" for forks until described).
        episode_id: the current episode (updated by restore()).
        start_checkpoint_id: the checkpoint the first episode started from.
        reset_response: the ResetResponse, for sandboxes made by Reset.
        lost: set when a heartbeat found the sandbox unknown (reaped or closed elsewhere).
        lease_ttl: the TTL this handle asked for, else None (the server's default).
        lease_expires_at: when the lease runs out (Unix seconds) by the last answer seen, else None.
    """

    def __init__(self, client: Client, sandbox_id: str, *, env: str, episode_id: str, start_checkpoint_id: str,
                 reset: es.ResetResponse | None = None, lease_ttl: float | None = None) -> None:
        self.client = client
        self.id = sandbox_id
        self.env = env
        self.episode_id = episode_id
        self.start_checkpoint_id = start_checkpoint_id
        self.reset_response = reset
        self.lost = False
        self.closed = False
        self.lease_ttl = lease_ttl
        self.lease_expires_at: float | None = None
        if reset is not None:
            self.saw_lease(reset.lease_expire_time)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with client._lock:
            client._handles.add(self)
        if client.heartbeat_enabled:
            self._thread = threading.Thread(target=self._heartbeats, name=f"deltagym-heartbeat-{sandbox_id}", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"SandboxHandle(id={self.id!r}, env={self.env!r}, episode_id={self.episode_id!r})"

    def saw_lease(self, ts: Any) -> None:
        """Records the lease expiry a response gave (a Timestamp)."""
        at = c.lease_seconds(ts, 0.0)
        if at is not None:
            self.lease_expires_at = at

    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats: a fraction of this sandbox's TTL."""
        return c.heartbeat_interval(self.lease_ttl or self.client._lease_ttl)

    @property
    def observation(self) -> action_pb2.Observation | None:
        """The Reset observation, for sandboxes made by Reset."""
        return self.reset_response.observation if self.reset_response else None

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval()):
            try:
                resp = self.client.heartbeat([self.id])
            except DeltagymError as e:
                log.warning("heartbeat of sandbox %s: %s", self.id, e)
                continue
            for lease in resp.leases:
                if lease.sandbox_id == self.id:
                    self.saw_lease(lease.expire_time)
            if self.id in resp.unknown_sandbox_ids:
                self.lost = True
                return

    def step(self, action: action_pb2.Action | str, *, checkpoint: bool = False,
             restore: str | None = None, fresh_entropy: bool = False, checkpoint_wait_for_digest: bool = False,
             checkpoint_dedupe: bool = False) -> es.StepResponse:
        """Performs one action; a str is run as a shell command. With restore, the
        sandbox goes back to that checkpoint first, in the same call."""
        resp = self.client.step(self.id, action, checkpoint=checkpoint, restore=restore, fresh_entropy=fresh_entropy,
                                checkpoint_wait_for_digest=checkpoint_wait_for_digest, checkpoint_dedupe=checkpoint_dedupe)
        self.episode_id = resp.episode_id or self.episode_id
        return resp

    def exec(self, cmd: str, *, session: str = "", checkpoint: bool = False, **kw: Any) -> es.StepResponse:
        """Runs a shell command (in a persistent bash session when named)."""
        return self.step(_command(cmd, session=session, **kw), checkpoint=checkpoint)

    def run(self, args: Sequence[str], *, checkpoint: bool = False, **kw: Any) -> es.StepResponse:
        """Executes a program directly, without a shell."""
        return self.step(_argv(args, **kw), checkpoint=checkpoint)

    def write_file(self, path: str, content: bytes | str, *, mode: int = 0, append: bool = False) -> es.StepResponse:
        """Writes (or with append extends) a file inside the sandbox."""
        return self.step(_write_file(path, content, mode=mode, append=append))

    def read_file(self, path: str, *, offset: int = 0, max_bytes: int = 0) -> es.StepResponse:
        """Reads (part of) a file inside the sandbox."""
        return self.step(_read_file(path, offset=offset, max_bytes=max_bytes))

    def submit(self, answer: str | None = None) -> es.StepResponse:
        """Ends the episode; the response carries the verifier's reward."""
        return self.step(_submit(answer))

    def checkpoint(self, *, durable: bool = False, process_mode: env_pb2.ProcessMode | str | None = None,
                   wait_for_digest: bool = False, dedupe: bool = False) -> es.CheckpointResponse:
        """Saves the sandbox's whole state as an immutable checkpoint (wait_for_digest and
        dedupe as for Client.checkpoint)."""
        return self.client.checkpoint(self.id, durable=durable, process_mode=process_mode,
                                      wait_for_digest=wait_for_digest, dedupe=dedupe)

    def restore(self, checkpoint_id: str, *, fresh_entropy: bool = False) -> es.RestoreResponse:
        """Puts the sandbox at a checkpoint; a new episode starts there."""
        resp = self.client.restore(self.id, checkpoint_id, fresh_entropy=fresh_entropy)
        self.episode_id = resp.episode_id
        return resp

    def fork(self, n: int = 1, *, group_id: str = "", run: str = "", fresh_entropy: bool = False) -> list[SandboxHandle]:
        """Creates n sandboxes at this sandbox's current state."""
        kids = self.client.fork(sandbox_id=self.id, n=n, group_id=group_id, run=run, fresh_entropy=fresh_entropy)
        for k in kids:
            k.env = self.env
        return kids

    def evaluate(self) -> es.EvaluateResponse:
        """Runs the verifier on the sandbox's state without changing it."""
        return self.client.evaluate(self.id)

    def describe(self) -> env_pb2.Sandbox:
        """Describes the sandbox (GetSandbox)."""
        return self.client.get_sandbox(self.id)

    def detach(self) -> None:
        """Stops the heartbeats and forgets the sandbox without closing it:
        it lives on until its lease runs out or another client closes it."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self.client._lock:
            self.client._handles.discard(self)

    def close(self, *, timeout: Any = _DEFAULT) -> None:
        """Stops the heartbeats and closes the sandbox. Idempotent."""
        if self.closed:
            return
        self.detach()
        self.client.close_sandbox(self.id, timeout=timeout)

    def __enter__(self) -> SandboxHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Sandbox is the low-level handle's former name, kept for code that imports
# it from here; deltagym.Sandbox is the typed API.
Sandbox = SandboxHandle
