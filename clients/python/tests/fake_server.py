"""An in-process EnvService for the SDK's unit tests: a real gRPC server on
127.0.0.1:0 over a small in-memory model (files, canned command output,
errors with google.rpc.ErrorInfo details, streamed output), so the client's
wire handling is exercised without a deltagym server or root.

Commands it knows: "echo TEXT", "exit N", "fail" (stderr, exit 1),
"spew ..." (1,211 bytes of stderr, exit 2), "hang" (timed out), "killed"
(by SIGKILL), any
interactive one (a program answering "got LINE" at a "> " prompt),
"block" (waits until the call is cancelled or its deadline passes),
"stream" (output in chunks, a UTF-8 character split across two), and the
error commands "ratelimit", "nocapacity", "ended" and "weird" (a reason
the client does not know).

With a node name, it is a node of a cluster: its sandbox and checkpoint IDs
name it ("sb-NODE-HEX16"), a call on an ID of another node fails with
WRONG_NODE, NodeService.GetNode reports its load (FakeNodeService: the
sandboxes it holds plus `preloaded`, `max_sandboxes`, `cpu_load`), and while
`draining` Reset and Fork fail with DRAINING."""

from __future__ import annotations

import io
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from deltagym._cluster import node_of
from deltagym._proto.deltagym.v1 import (
    action_pb2 as ap,
    env_pb2,
    env_service_pb2 as es,
    env_service_pb2_grpc as es_grpc,
    node_service_pb2 as ns,
    node_service_pb2_grpc as ns_grpc,
)

READ_CAP = 8  # bytes per read, so reads of longer files come in parts


@dataclass
class FakeSandbox:
    id: str
    env: str
    episode: str
    files: dict[str, bytes] = field(default_factory=dict)
    step_index: int = 0
    closed: bool = False
    lease_ttl: float = 60.0


class FakeEnvService(es_grpc.EnvServiceServicer):
    """The model. Tests read setups (each step's setup flag, in order),
    signals, and may put archives into tars (path → tar bytes) for download."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        self.draining = False
        self.max_sandboxes = 0
        self.checkpoints: set[str] = set() if node else {"ck-1"}
        self.resets = 0  # Reset calls, refused ones included
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.setups: list[bool] = []
        self.signals: list[tuple[int, int, bool]] = []
        self.tars: dict[str, bytes] = {}
        self.deadlines: list[float | None] = []
        self.execs: list[ap.ExecAction] = []
        self.attached: dict[str, str] = {}
        self.described: list[str] = []
        self.lock = threading.Lock()

    # --- helpers ---

    def _abort(self, ctx: grpc.ServicerContext, code: grpc.StatusCode, msg: str, reason: str = "",
               md: dict[str, str] | None = None) -> Any:
        if reason:
            info = error_details_pb2.ErrorInfo(reason=reason, domain="deltagym.dev", metadata=md or {})
            detail = any_pb2.Any()
            detail.Pack(info)
            st = status_pb2.Status(code=code.value[0], message=msg, details=[detail])
            ctx.set_trailing_metadata((("grpc-status-details-bin", st.SerializeToString()),))
        ctx.abort(code, msg)

    def _id(self, prefix: str) -> str:
        return f"{prefix}-{self.node}-{uuid.uuid4().hex[:16]}" if self.node else uuid.uuid4().hex

    def open_sandboxes(self) -> int:
        return sum(not sb.closed for sb in self.sandboxes.values())

    def _wrong_node(self, field: str, id: str, ctx: grpc.ServicerContext) -> None:
        owner = node_of(id)
        if self.node and owner and owner != self.node:
            self._abort(ctx, grpc.StatusCode.FAILED_PRECONDITION, f"{field[:-3]} {id} is on node {owner}, not on this node",
                        "WRONG_NODE", {field: id, "node": owner, "address": ""})

    def _draining(self, call: str, ctx: grpc.ServicerContext) -> None:
        if self.draining:
            self._abort(ctx, grpc.StatusCode.UNAVAILABLE, f"{call} refused: node {self.node} is draining", "DRAINING",
                        {"node": self.node})
        if self.max_sandboxes and self.open_sandboxes() >= self.max_sandboxes:
            self._abort(ctx, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{call} refused: node {self.node} is full", "NO_CAPACITY")

    def _sandbox(self, sid: str, ctx: grpc.ServicerContext) -> FakeSandbox:
        sb = self.sandboxes.get(sid)
        if sb is None:
            self._wrong_node("sandbox_id", sid, ctx)
        if sb is None or sb.closed:
            self._abort(ctx, grpc.StatusCode.NOT_FOUND, f"sandbox {sid} not found", "SANDBOX_NOT_FOUND",
                        {"sandbox_id": sid})
        assert sb is not None
        return sb

    def _lease(self, sb: FakeSandbox) -> Any:
        from google.protobuf import timestamp_pb2

        ts = timestamp_pb2.Timestamp()
        ts.FromNanoseconds(int((time.time() + sb.lease_ttl) * 1e9))
        return ts

    # --- EnvService ---

    def Reset(self, req: es.ResetRequest, ctx: grpc.ServicerContext) -> es.ResetResponse:
        if req.env != "shell":
            self._abort(ctx, grpc.StatusCode.NOT_FOUND, f"env {req.env} not found", "ENV_NOT_FOUND", {"env": req.env})
        self.resets += 1
        self._draining("Reset", ctx)
        sb = FakeSandbox(id=self._id("sb"), env=req.env, episode=uuid.uuid4().hex,
                         lease_ttl=req.lease_ttl_seconds or 60.0)
        self.sandboxes[sb.id] = sb
        return es.ResetResponse(sandbox_id=sb.id, episode_id=sb.episode, checkpoint_id="ck-start",
                                observation=ap.Observation(reset=ap.ResetResult(
                                    task="write 42", hook=ap.ExecResult(stdout=b"the answer goes in /work/answer.txt\n"))),
                                lease_expire_time=self._lease(sb))

    def Step(self, req: es.StepRequest, ctx: grpc.ServicerContext) -> es.StepResponse:
        sb = self._sandbox(req.sandbox_id, ctx)
        self.deadlines.append(ctx.time_remaining())
        with self.lock:
            self.setups.append(req.setup)
        obs = self._act(sb, req.action, ctx)
        sb.step_index += 1
        resp = es.StepResponse(observation=obs, step_index=sb.step_index, episode_id=sb.episode,
                               steps_left=-1, info={"elapsed": "0.5", "count": "3", "flag": "true", "who": "x"})
        if req.action.HasField("submit"):
            resp.reward, resp.terminated = 1.0, True
        return resp

    def StreamStep(self, req: es.StreamStepRequest, ctx: grpc.ServicerContext) -> Iterator[es.StreamStepResponse]:
        sb = self._sandbox(req.step.sandbox_id, ctx)
        self.setups.append(req.step.setup)
        x = req.step.action.exec
        if x.command == "stream":
            parts = [(1, b"one\n"), (2, b"err\n"), (1, b"caf\xc3"), (1, b"\xa9\n")]
            for stream, data in parts:
                yield es.StreamStepResponse(output=es.OutputChunk(stream=stream, data=data))
            out = b"".join(d for s, d in parts if s == 1)
            obs = ap.Observation(exec=ap.ExecResult(stdout=out, stderr=b"err\n", exit_code=0))
        else:
            obs = self._act(sb, req.step.action, ctx)
        sb.step_index += 1
        yield es.StreamStepResponse(step=es.StepResponse(observation=obs, step_index=sb.step_index,
                                                         episode_id=sb.episode, steps_left=-1))

    def StepStream(self, reqs: Iterator[es.StepStreamRequest],
                   ctx: grpc.ServicerContext) -> Iterator[es.StepStreamResponse]:
        for r in reqs:
            sb = self.sandboxes.get(r.step.sandbox_id)
            if sb is None or sb.closed:
                yield es.StepStreamResponse(request_id=r.request_id, error=es.ErrorStatus(
                    code=grpc.StatusCode.NOT_FOUND.value[0], message="unknown sandbox", reason="SANDBOX_NOT_FOUND"))
                continue
            sb.step_index += 1
            yield es.StepStreamResponse(request_id=r.request_id, step=es.StepResponse(
                observation=self._exec(r.step.action.exec, ctx), step_index=sb.step_index, episode_id=sb.episode))

    def _act(self, sb: FakeSandbox, a: ap.Action, ctx: grpc.ServicerContext) -> ap.Observation:
        kind = a.WhichOneof("kind")
        if kind == "exec":
            return self._exec(a.exec, ctx)
        if kind == "write_file":
            old = sb.files.get(a.write_file.path, b"") if a.write_file.append else b""
            sb.files[a.write_file.path] = old + a.write_file.content
            return ap.Observation(write_file=ap.WriteFileResult(size=len(sb.files[a.write_file.path])))
        if kind == "read_file":
            data = sb.files.get(a.read_file.path)
            if data is None:
                return ap.Observation(error=ap.ActionError(errno=2, errno_name="ENOENT",
                                                           message=f"{a.read_file.path}: no such file"))
            part = data[a.read_file.offset:a.read_file.offset + READ_CAP]
            return ap.Observation(read_file=ap.ReadFileResult(
                content=part, size=len(data), truncated=a.read_file.offset + len(part) < len(data)))
        if kind == "stat":
            data = sb.files.get(a.stat.path)
            if data is None:
                return ap.Observation(stat=ap.StatResult(exists=False))
            return ap.Observation(stat=ap.StatResult(exists=True, info=ap.FileInfo(
                path=a.stat.path, type=ap.FILE_TYPE_FILE, size=len(data), mode=0o644, modify_time_seconds=1.5)))
        if kind == "list_dir":
            pre = a.list_dir.path.rstrip("/") + "/"
            ents = [ap.FileInfo(path=p[len(pre):], type=ap.FILE_TYPE_FILE, size=len(d), mode=0o644)
                    for p, d in sorted(sb.files.items()) if p.startswith(pre)]
            return ap.Observation(list_dir=ap.ListDirResult(entries=ents))
        if kind == "remove":
            n = 1 if sb.files.pop(a.remove.path, None) is not None else 0
            return ap.Observation(remove=ap.RemoveResult(removed=n))
        if kind == "make_dir":
            return ap.Observation(make_dir=ap.MakeDirResult(created=True))
        if kind == "upload":
            n = size = 0
            with tarfile.open(fileobj=io.BytesIO(a.upload.tar)) as tf:
                for m in tf.getmembers():
                    n += 1
                    if m.isreg():
                        f = tf.extractfile(m)
                        assert f is not None
                        sb.files[a.upload.path.rstrip("/") + "/" + m.name] = f.read()
                        size += m.size
            return ap.Observation(upload=ap.UploadResult(files=n, bytes=size))
        if kind == "download":
            return ap.Observation(download=ap.DownloadResult(tar=self.tars.get(a.download.path, b"")))
        if kind == "list_processes":
            return ap.Observation(list_processes=ap.ListProcessesResult(processes=[
                ap.ProcessInfo(pid=7, ppid=1, pgid=7, sid=7, argv=["sleep", "100"], state="S", start_seconds=2.0)]))
        if kind == "signal":
            self.signals.append((a.signal.pid, a.signal.signal, a.signal.process_group))
            return ap.Observation(signal=ap.SignalResult())
        if kind == "submit":
            return ap.Observation(submit=ap.SubmitResult(components={"answer": 1.0}, output="ok"))
        self._abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"action {kind} not in the fake")
        raise AssertionError

    def _interactive(self, x: ap.ExecAction) -> ap.Observation:
        """An interactive step: a program that answers "got LINE" and prompts
        "> ", ends on "exit", and prompts again after Ctrl-C, as a REPL does:
        an interrupt that expects nothing waits out its timeout, and the
        program is killed."""
        matched = x.expect[0] if x.expect else ""
        if x.interrupt:
            if matched:
                return ap.Observation(exec=ap.ExecResult(stdout=b"KeyboardInterrupt\n> ", exit_code=-1,
                                                         matched=matched, running=True))
            self.attached.pop(x.session, None)
            return ap.Observation(exec=ap.ExecResult(stdout=b"^C\n", exit_code=-1, signal=9, timed_out=True))
        if x.session not in self.attached:
            self.attached[x.session] = x.command
            return ap.Observation(exec=ap.ExecResult(stdout=b"> ", exit_code=-1, matched=matched, running=True))
        if x.command == "exit":
            self.attached.pop(x.session, None)
            return ap.Observation(exec=ap.ExecResult(stdout=b"bye\n", exit_code=0))
        out = f"got {x.command}\n> ".encode()
        return ap.Observation(exec=ap.ExecResult(stdout=out, exit_code=-1, matched=matched, running=True))

    def _exec(self, x: ap.ExecAction, ctx: grpc.ServicerContext) -> ap.Observation:
        self.execs.append(x)
        if x.interactive:
            return self._interactive(x)
        cmd = x.command or " ".join(x.argv)
        if x.background:
            return ap.Observation(exec=ap.ExecResult(exit_code=-1, pid=42))
        if cmd.startswith("echo "):
            return ap.Observation(exec=ap.ExecResult(stdout=cmd[5:].encode() + b"\n", duration_seconds=0.25))
        if cmd.startswith("exit "):
            return ap.Observation(exec=ap.ExecResult(exit_code=int(cmd[5:])))
        if cmd == "fail":
            return ap.Observation(exec=ap.ExecResult(stderr=b"boom\n", exit_code=1))
        if cmd.startswith("spew "):
            return ap.Observation(exec=ap.ExecResult(stderr=b"noise\n" * 200 + b"last words\n", exit_code=2))
        if cmd == "hang":
            return ap.Observation(exec=ap.ExecResult(stdout=b"waiting\n", exit_code=-1, timed_out=True,
                                                     duration_seconds=1.5))
        if cmd == "killed":
            return ap.Observation(exec=ap.ExecResult(exit_code=-1, signal=9))
        if cmd == "block":
            done = threading.Event()
            ctx.add_callback(done.set)
            done.wait(30)
            self._abort(ctx, grpc.StatusCode.CANCELLED, "cancelled")
        errors = {
            "ratelimit": (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", {"retry_after_seconds": "2.5"}),
            "nocapacity": (grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_CAPACITY", {}),
            "ended": (grpc.StatusCode.FAILED_PRECONDITION, "EPISODE_ENDED", {}),
            "weird": (grpc.StatusCode.NOT_FOUND, "SOMETHING_NEW", {"k": "v"}),
            "mismatch": (grpc.StatusCode.INTERNAL, "SANDBOX_NOT_FOUND", {}),
        }
        if cmd in errors:
            code, reason, md = errors[cmd]
            self._abort(ctx, code, f"{cmd} refused", reason, md)
        return ap.Observation(error=ap.ActionError(errno=2, errno_name="ENOENT", message=f"{cmd}: not found"))

    def Checkpoint(self, req: es.CheckpointRequest, ctx: grpc.ServicerContext) -> es.CheckpointResponse:
        self._sandbox(req.sandbox_id, ctx)
        ck = self._id("ck") if self.node else "ck-1"
        self.checkpoints.add(ck)
        return es.CheckpointResponse(checkpoint_id=ck, parent_id="ck-start", depth=1, durable=False, processes=[
            env_pb2.ProcessCapture(pid=7, command="sleep 100", method=env_pb2.CAPTURE_METHOD_TEMPLATE,
                                   saved=False, unsaved_reason="kept as a frozen template")])

    def Restore(self, req: es.RestoreRequest, ctx: grpc.ServicerContext) -> es.RestoreResponse:
        sb = self._sandbox(req.sandbox_id, ctx)
        if req.checkpoint_id not in self.checkpoints:
            self._wrong_node("checkpoint_id", req.checkpoint_id, ctx)
            self._abort(ctx, grpc.StatusCode.NOT_FOUND, "no checkpoint", "CHECKPOINT_NOT_FOUND",
                        {"checkpoint_id": req.checkpoint_id})
        sb.episode = uuid.uuid4().hex
        return es.RestoreResponse(episode_id=sb.episode, next_step_index=3)

    def Evaluate(self, req: es.EvaluateRequest, ctx: grpc.ServicerContext) -> es.EvaluateResponse:
        self._sandbox(req.sandbox_id, ctx)
        return es.EvaluateResponse(reward=0.5, components={"a": 0.5}, output="half", duration_seconds=0.1)

    def Fork(self, req: es.ForkRequest, ctx: grpc.ServicerContext) -> es.ForkResponse:
        # A checkpoint of another node is forked as a real node does once it fetched it from
        # its owner, but one whose ID says "beef" (one with processes, which do not move) only
        # on its own node.
        ck, owner = req.checkpoint_id, node_of(req.checkpoint_id)
        if req.WhichOneof("source") == "checkpoint_id" and self.node and owner and owner != self.node and "beef" in ck:
            self._abort(ctx, grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint {ck} holds live processes: they do not move "
                        "between nodes", "PROCESSES_STAY", {"checkpoint_id": ck})
        self._draining("Fork", ctx)
        ids, eps = [], []
        for _ in range(req.n):
            sb = FakeSandbox(id=self._id("sb"), env="shell", episode=uuid.uuid4().hex)
            self.sandboxes[sb.id] = sb
            ids.append(sb.id)
            eps.append(sb.episode)
        return es.ForkResponse(sandbox_ids=ids, episode_ids=eps, checkpoint_id="ck-fork")

    def Close(self, req: es.CloseRequest, ctx: grpc.ServicerContext) -> es.CloseResponse:
        sb = self.sandboxes.get(req.sandbox_id)
        if sb is not None:
            sb.closed = True
        return es.CloseResponse()

    def Heartbeat(self, req: es.HeartbeatRequest, ctx: grpc.ServicerContext) -> es.HeartbeatResponse:
        resp = es.HeartbeatResponse()
        for sid in req.sandbox_ids:
            sb = self.sandboxes.get(sid)
            if sb is None or sb.closed:
                resp.unknown_sandbox_ids.append(sid)
                continue
            if req.lease_ttl_seconds:
                sb.lease_ttl = req.lease_ttl_seconds
            resp.leases.append(es.Lease(sandbox_id=sid, expire_time=self._lease(sb)))
        return resp

    def GetSandbox(self, req: es.GetSandboxRequest, ctx: grpc.ServicerContext) -> es.GetSandboxResponse:
        sb = self._sandbox(req.sandbox_id, ctx)
        self.described.append(sb.id)
        return es.GetSandboxResponse(sandbox=env_pb2.Sandbox(
            sandbox_id=sb.id, env=sb.env, episode_id=sb.episode, state=env_pb2.SANDBOX_STATE_READY,
            next_step_index=sb.step_index, start_checkpoint_id="ck-start", lease_expire_time=self._lease(sb)))


class FakeNodeService(ns_grpc.NodeServiceServicer):
    """NodeService over a FakeEnvService: its name and load. Tests set preloaded (sandboxes
    held besides the fake's own), cpu_load and memory; tokens holds each call's bearer token,
    and asked is released once per call."""

    def __init__(self, env: FakeEnvService, address: str) -> None:
        self.env = env
        self.address = address
        self.preloaded = 0
        self.cpu_load = 0.1
        self.memory = (6 << 30, 8 << 30)
        self.tokens: list[str] = []
        self.asked = threading.Semaphore(0)

    def GetNode(self, req: ns.GetNodeRequest, ctx: grpc.ServicerContext) -> ns.GetNodeResponse:
        self.tokens.append(dict(ctx.invocation_metadata()).get("authorization", ""))
        self.asked.release()
        e = self.env
        return ns.GetNodeResponse(node=ns.NodeInfo(
            name=e.node, address=self.address, version="test", draining=e.draining,
            sandboxes=e.open_sandboxes() + self.preloaded, max_sandboxes=e.max_sandboxes,
            checkpoints=len(e.checkpoints), cpus=2, cpu_load=self.cpu_load,
            memory_available_bytes=self.memory[0], memory_total_bytes=self.memory[1]))


class FakeServer:
    """The fake services on a real gRPC server; addr is host:port. With node, a node of a
    cluster named so (see the module's doc), on host and port (0: a free one)."""

    def __init__(self, node: str = "", host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = FakeEnvService(node)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        es_grpc.add_EnvServiceServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.addr = f"{host}:{self.port}"
        self.nodes = FakeNodeService(self.service, self.addr)
        ns_grpc.add_NodeServiceServicer_to_server(self.nodes, self.server)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)
