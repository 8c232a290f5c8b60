"""Conversion of the server's messages into the typed results of
deltagym.types: the one place that reads generated messages for the
Sandbox API."""

from __future__ import annotations

import codecs
import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

from ._common import lease_seconds
from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2 as es, node_service_pb2 as ns, state_pb2
from .errors import ActionFailed
from .types import (
    ActionErrorInfo,
    ChangeKind,
    Checkpoint,
    CheckpointDiff,
    CommandResult,
    DiffDetail,
    Evaluation,
    FileInfo,
    FileType,
    InfoValue,
    NodeInfo,
    OutputChunk,
    PathChange,
    ProcessCapture,
    ProcessChange,
    ProcessInfo,
    Restored,
    SandboxInfo,
    StateDigest,
    StepInfo,
    StepResult,
    SubmitResult,
    UploadResult,
)

_FILE_TYPES: dict[int, FileType] = {
    action_pb2.FILE_TYPE_FILE: "file",
    action_pb2.FILE_TYPE_DIRECTORY: "dir",
    action_pb2.FILE_TYPE_SYMLINK: "symlink",
}

_CHANGE_KINDS: dict[int, ChangeKind] = {
    state_pb2.CHANGE_KIND_ADDED: "added",
    state_pb2.CHANGE_KIND_REMOVED: "removed",
    state_pb2.CHANGE_KIND_MODIFIED: "modified",
}

_STATES = {
    env_pb2.SANDBOX_STATE_READY: "ready",
    env_pb2.SANDBOX_STATE_DONE: "done",
    env_pb2.SANDBOX_STATE_CLOSED: "closed",
}

_METHODS = {
    env_pb2.CAPTURE_METHOD_NONE: "none",
    env_pb2.CAPTURE_METHOD_TEMPLATE: "template",
    env_pb2.CAPTURE_METHOD_CRIU: "criu",
}


# Characters of a number that float() reads and int() does not: a fraction,
# an exponent, inf, infinity and nan. A string float() reads without any of
# them is an integer to int() too.
_NOT_INT = frozenset(".eEnN")


def info_value(v: str) -> InfoValue:
    """Parses one StepResponse.info value: "true"/"false" as booleans,
    integers and finite floats as numbers, anything else as it is."""
    if v == "true":
        return True
    if v == "false":
        return False
    try:
        f = float(v)
    except ValueError:
        return v
    if not math.isfinite(f):
        return v
    if _NOT_INT.isdisjoint(v):
        try:
            return int(v)
        except ValueError:  # beyond int()'s digit limit (leading zeros), as float() reads it
            return f
    return f


T = TypeVar("T")


def _maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of the frozen, slotted dataclass cls that takes its
    fields positionally, in their order, and sets each slot through its
    descriptor. The dataclass's own __init__ sets them through
    object.__setattr__ (frozen) from keywords, at twice the cost; this
    runs for every step's result. It skips nothing the __init__ does: cls
    has no __post_init__, and every field is given."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # cls is a dataclass
    if getattr(cls, "__post_init__", None) is not None or not all(n in vars(cls) for n in names):
        raise TypeError(f"{cls.__name__} is not a slotted dataclass without __post_init__")
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    env.update({f"_set_{n}": vars(cls)[n].__set__ for n in names})
    body = "".join(f"    _set_{n}(o, {n})\n" for n in names)
    exec(f"def make({', '.join(names)}):\n    o = _new(_cls)\n{body}    return o\n", env)
    make: Callable[..., T] = env["make"]
    return make


_step_info = _maker(StepInfo)
_command_result = _maker(CommandResult)


def step_info(r: es.StepResponse, setup: bool) -> StepInfo:
    """The StepInfo of a step's response; setup is what the request asked."""
    raw = r.info
    info = {k: info_value(raw[k]) for k in raw} if raw else {}  # by key: faster than the map's items()
    ck = r.checkpoint_id
    digest = state_digest(r.checkpoint_digest) if ck and r.HasField("checkpoint_digest") else None
    # index, episode_id, reward, terminated, truncated, truncated_by, checkpoint_id, steps_left, setup, info,
    # checkpoint_digest, checkpoint_deduplicated
    return _step_info(r.step_index, r.episode_id, r.reward, r.terminated, r.truncated, raw.get("truncated_by", ""),
                      ck, r.steps_left, setup, info, digest, r.checkpoint_deduplicated)


def state_digest(d: state_pb2.StateDigest) -> StateDigest | None:
    """A StateDigest of the message, None when it is unset (not computed)."""
    if not d.files:
        return None
    return StateDigest(files=d.files, processes=d.processes)


def action_error(r: es.StepResponse, step: StepInfo) -> ActionFailed | None:
    """The ActionFailed of a response whose observation is an error, else None."""
    if not r.observation.HasField("error"):
        return None
    e = r.observation.error
    return ActionFailed(ActionErrorInfo(errno=e.errno, errno_name=e.errno_name, message=e.message), step)


def _refused(r: es.StepResponse, kind: str, step: StepInfo) -> Exception:
    """What to raise for a response without the kind's result: its
    ActionFailed, or a ValueError when it has another kind's."""
    err = action_error(r, step)
    if err is not None:
        return err
    got = r.observation.WhichOneof("kind")
    return ValueError(f"the server answered a {kind} action with a {got or 'empty'} observation")


def observation(r: es.StepResponse, kind: str, setup: bool) -> tuple[Any, StepInfo]:
    """The observation's result of the kind asked for and the StepInfo;
    raises ActionFailed when the sandbox refused the action."""
    step = step_info(r, setup)
    obs = r.observation
    if obs.HasField(kind) and not obs.HasField("error"):
        return getattr(obs, kind), step
    raise _refused(r, kind, step)


def command_result(x: action_pb2.ExecResult, step: StepInfo) -> CommandResult:
    """A CommandResult of an ExecResult."""
    out, err = x.stdout, x.stderr
    # stdout, stderr, stdout_bytes, stderr_bytes, exit_code, signal, timed_out, truncated, duration, pid,
    # matched, running, step
    return _command_result(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), out, err, x.exit_code,
                           x.signal, x.timed_out, x.stdout_truncated or x.stderr_truncated, x.duration_seconds, x.pid,
                           x.matched, x.running, step)


def exec_response(r: es.StepResponse, setup: bool) -> CommandResult:
    """The CommandResult of an exec step's response (ActionFailed when refused)."""
    obs = r.observation
    if obs.HasField("exec") and not obs.HasField("error"):
        return command_result(obs.exec, step_info(r, setup))
    raise _refused(r, "exec", step_info(r, setup))


def step_result(r: es.StepResponse, setup: bool) -> StepResult:
    """The StepResult of a raw action's response; an action error is data here, not raised."""
    from ._common import observation_text

    step = step_info(r, setup)
    kind = r.observation.WhichOneof("kind") or ""
    text = observation_text(r.observation)
    if r.observation.HasField("error"):
        e = r.observation.error
        return StepResult(step=step, kind="", text=text,
                          error=ActionErrorInfo(errno=e.errno, errno_name=e.errno_name, message=e.message))
    cmd = command_result(r.observation.exec, step) if kind == "exec" else None
    return StepResult(step=step, kind=kind, text=text, command=cmd)


def submit_result(r: es.StepResponse) -> SubmitResult:
    """The SubmitResult of a submit step's response."""
    x, step = observation(r, "submit", False)
    return SubmitResult(reward=r.reward, components=dict(x.components), output=x.output, step=step)


def file_info(f: action_pb2.FileInfo) -> FileInfo:
    """A FileInfo of the message."""
    return FileInfo(path=f.path, type=_FILE_TYPES.get(f.type, "other"), size=f.size, mode=f.mode,
                    mtime=f.modify_time_seconds, symlink_target=f.symlink_target)


def upload_result(x: action_pb2.UploadResult) -> UploadResult:
    """An UploadResult of the message."""
    return UploadResult(files=x.files, size=x.bytes)


def process_info(p: action_pb2.ProcessInfo) -> ProcessInfo:
    """A ProcessInfo of the message."""
    return ProcessInfo(pid=p.pid, ppid=p.ppid, pgid=p.pgid, sid=p.sid, argv=tuple(p.argv), state=p.state,
                       session=p.session, started_ago=p.start_seconds)


def checkpoint(r: es.CheckpointResponse) -> Checkpoint:
    """A Checkpoint of a Checkpoint response."""
    procs = tuple(ProcessCapture(pid=p.pid, command=p.command, method=_METHODS.get(p.method, "unspecified"),
                                 reason=p.reason, saved=p.saved, unsaved_reason=p.unsaved_reason)
                  for p in r.processes)
    return Checkpoint(id=r.checkpoint_id, parent_id=r.parent_id, depth=r.depth, processes=procs,
                      durable=r.durable,
                      not_durable=tuple(p.unsaved_reason for p in procs if not p.saved and p.unsaved_reason),
                      digest=state_digest(r.digest), deduplicated=r.deduplicated)


def _file_type(t: int) -> FileType | None:
    return _FILE_TYPES.get(t, "other") if t else None


def path_change(p: state_pb2.PathChange) -> PathChange:
    """A PathChange of the message."""
    return PathChange(path=p.path, kind=_CHANGE_KINDS.get(p.kind, "modified"), old_type=_file_type(p.old_type),
                      new_type=_file_type(p.new_type), old_size=p.old_size, new_size=p.new_size,
                      old_mode=p.old_mode, new_mode=p.new_mode, metadata_only=p.metadata_only, binary=p.binary,
                      lines_added=p.lines_added, lines_removed=p.lines_removed, unified_diff=p.unified_diff)


def checkpoint_diff(r: es.DiffCheckpointsResponse, base: str, checkpoint: str, detail: DiffDetail) -> CheckpointDiff:
    """A CheckpointDiff of a DiffCheckpoints response, for the request's checkpoints and detail."""
    procs = tuple(ProcessChange(kind=_CHANGE_KINDS.get(p.kind, "modified"), pid=p.pid, command=p.command,
                                details=tuple(p.details)) for p in r.processes)
    return CheckpointDiff(base_checkpoint_id=base, checkpoint_id=checkpoint, detail=detail,
                          paths=tuple(path_change(p) for p in r.paths), processes=procs, truncated=r.truncated,
                          details_truncated=r.details_truncated,
                          base_digest=state_digest(r.base_digest), digest=state_digest(r.digest))


def restored(r: es.RestoreResponse) -> Restored:
    """A Restored of a Restore response."""
    return Restored(episode_id=r.episode_id, next_step_index=r.next_step_index)


def evaluation(r: es.EvaluateResponse) -> Evaluation:
    """An Evaluation of an Evaluate response."""
    return Evaluation(reward=r.reward, components=dict(r.components), output=r.output, duration=r.duration_seconds)


def _instant(ts: Any) -> float | None:
    """A Timestamp as Unix seconds, None when unset."""
    return lease_seconds(ts, 0.0)


def sandbox_info(s: env_pb2.Sandbox) -> SandboxInfo:
    """A SandboxInfo of the message."""
    return SandboxInfo(id=s.sandbox_id, env=s.env, episode_id=s.episode_id, run=s.run, group_id=s.group_id,
                       state=_STATES.get(s.state, "unspecified"), next_step_index=s.next_step_index,
                       start_checkpoint_id=s.start_checkpoint_id, lease_expires_at=_instant(s.lease_expire_time),
                       created_at=_instant(s.create_time))


def node_info(n: ns.NodeInfo, address: str) -> NodeInfo:
    """A NodeInfo of the message, for the node reached at address."""
    return NodeInfo(name=n.name, address=address, advertise_address=n.address, version=n.version, draining=n.draining,
                    sandboxes=n.sandboxes, max_sandboxes=n.max_sandboxes, checkpoints=n.checkpoints, cpus=n.cpus,
                    cpu_load=n.cpu_load, memory_available=n.memory_available_bytes, memory_total=n.memory_total_bytes,
                    measured_at=_instant(n.measured_at))


def reset_task(r: es.ResetResponse) -> str:
    """The task text of a Reset's observation."""
    return r.observation.reset.task if r.observation.HasField("reset") else ""


class ChunkDecoder:
    """Turns a StreamStep's OutputChunk messages into OutputChunks, decoding
    each stream's UTF-8 incrementally so a character split across two
    chunks comes whole in the second."""

    def __init__(self) -> None:
        self._dec = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }

    def chunk(self, c: es.OutputChunk) -> OutputChunk:
        """The OutputChunk of one message."""
        name = "stderr" if c.stream == es.OUTPUT_STREAM_STDERR else "stdout"
        data = bytes(c.data)
        if name == "stderr":
            return OutputChunk(stream="stderr", data=data, text=self._dec[name].decode(data))
        return OutputChunk(stream="stdout", data=data, text=self._dec[name].decode(data))

