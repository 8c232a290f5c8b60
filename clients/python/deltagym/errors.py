"""Exceptions raised by the deltagym clients.

Every error a call can raise is a :class:`DeltagymError` carrying the status
``code`` (a :class:`grpc.StatusCode`), the server's ``message``, and the
``reason`` and ``metadata`` of the google.rpc.ErrorInfo the server attaches
(in the ``grpc-status-details-bin`` trailer; on StepStream, in
ErrorStatus.reason). There is one class per status code (``NotFound``,
``InvalidArgument`` ...) and, below them, one per reason the server names
(``SandboxNotFound``, ``RateLimited`` ...); a reason this client does not
know gives the status code's class. Every DEADLINE_EXCEEDED, the server's
or this client's own deadline, is a :class:`Timeout`.

Failures inside the sandbox are not call errors: :class:`CommandExitError`
(a command that failed under ``check=True``) and :class:`ActionFailed` (an
action the sandbox's state refused, such as reading a missing file) derive
from :class:`SandboxError`.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from ._common import token_files

if TYPE_CHECKING:
    from .types import ActionErrorInfo, CommandResult, StepInfo

__all__ = [
    "ERROR_DOMAIN",
    "Aborted",
    "ActionFailed",
    "AlreadyExists",
    "Cancelled",
    "CheckpointNotFound",
    "CommandExitError",
    "DataLoss",
    "DeadlineExceeded",
    "DeltagymError",
    "EnvNotFound",
    "EpisodeEnded",
    "EpisodeNotFound",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NoCapacity",
    "NodeUnavailable",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ProcessEnded",
    "RateLimited",
    "ResourceExhausted",
    "SandboxClosed",
    "SandboxError",
    "SandboxNotFound",
    "Timeout",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "UnsafeArchiveError",
    "from_code",
    "from_rpc_error",
    "on_node",
]


class DeltagymError(Exception):
    """Base of every error raised by a deltagym call.

    Attributes:
        code: the gRPC status code.
        message: the server's (or the transport's) message.
        method: the RPC that failed, e.g. "Step", when known.
        reason: the server's ErrorInfo reason, such as "SANDBOX_NOT_FOUND"; "" when it gave none.
        metadata: the ErrorInfo's metadata, such as {"sandbox_id": "..."}.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "",
                 reason: str = "", metadata: Mapping[str, str] | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{self.code.name.lower()}: {message}")


class Cancelled(DeltagymError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Unknown(DeltagymError):
    """The server failed with an error of no known kind."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(DeltagymError):
    """The request or action is malformed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(DeltagymError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(DeltagymError):
    """An unknown sandbox, checkpoint, env, image or episode."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(DeltagymError):
    """The thing to create exists (for example an env name)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(DeltagymError):
    """The caller may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(DeltagymError):
    """A limit or quota was reached (no warm sandbox, message too large ...)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(DeltagymError):
    """The sandbox is closed or its episode is finished."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(DeltagymError):
    """The call conflicted with another one and was abandoned."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(DeltagymError):
    """A value is past the valid range."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(DeltagymError):
    """The server does not offer this call (or, for the ledger, runs without it)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(DeltagymError):
    """The server broke an invariant."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(DeltagymError):
    """The server cannot be reached or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(DeltagymError):
    """Data was lost or corrupted."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(DeltagymError):
    """The bearer token is missing or wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class SandboxNotFound(NotFound):
    """The sandbox is unknown: never leased, closed, or reaped when its lease ran out (SANDBOX_NOT_FOUND)."""


class CheckpointNotFound(NotFound):
    """The checkpoint is unknown or released (CHECKPOINT_NOT_FOUND)."""


class EnvNotFound(NotFound):
    """The env is not in the server's catalog (ENV_NOT_FOUND)."""


class EpisodeNotFound(NotFound):
    """The episode is unknown to the ledger (EPISODE_NOT_FOUND)."""


class EpisodeEnded(FailedPrecondition):
    """The sandbox's episode has ended (submitted or out of budget); restore or fork to go on (EPISODE_ENDED)."""


class SandboxClosed(FailedPrecondition):
    """The sandbox is closed (SANDBOX_CLOSED)."""


class WrongNode(FailedPrecondition):
    """Another node of the cluster holds the sandbox or checkpoint (WRONG_NODE).

    Attributes:
        node: the name of the node that holds it.
        address: its host:port, when the node that answered knows it ("" when not).
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "",
                 reason: str = "", metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, method=method, reason=reason, metadata=metadata)
        self.node: str = self.metadata.get("node", "")
        self.address: str = self.metadata.get("address", "")


class RateLimited(ResourceExhausted):
    """The server refused the call for its rate (RATE_LIMITED).

    Attributes:
        retry_after: seconds to wait before trying again, when the server said (None when not).
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "",
                 reason: str = "", metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, method=method, reason=reason, metadata=metadata)
        self.retry_after: float | None = _seconds(self.metadata.get("retry_after_seconds", ""))


class Draining(Unavailable):
    """The node is draining (shutting down): it takes no new sandboxes; place them on another node (DRAINING).

    Attributes:
        node: the name of the node.
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "",
                 reason: str = "", metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, code=code, method=method, reason=reason, metadata=metadata)
        self.node: str = self.metadata.get("node", "")


class NodeUnavailable(Unavailable):
    """A node of a cluster cannot be reached (it stopped, or left the cluster and no longer
    answers), or the cluster does not know it. Raised by the clients of a deltagym.Cluster for
    the calls on the node's sandboxes and checkpoints, and by a node asked to restore or fork
    a checkpoint of another that it cannot reach (NODE_UNAVAILABLE); the message names the
    node and its address. New sandboxes go to the other nodes.

    Attributes:
        node: the node's name.
        address: the host:port it was last reached at ("" when this client never reached it).
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "",
                 reason: str = "", metadata: Mapping[str, str] | None = None, node: str = "",
                 address: str = "") -> None:
        md = dict(metadata or {})
        for k, v in (("node", node), ("address", address)):
            if v or k not in md:
                md[k] = v
        super().__init__(message, code=code, method=method, reason=reason, metadata=md)
        self.node: str = self.metadata["node"]
        self.address: str = self.metadata["address"]


class NoCapacity(ResourceExhausted):
    """No warm sandbox is free and the server may not make more now (NO_CAPACITY)."""


class Timeout(DeadlineExceeded):
    """The call's deadline passed: the server's, or the one this client set (timeout=)."""


_BY_CODE: dict[grpc.StatusCode, type[DeltagymError]] = {
    cls.code: cls
    for cls in (
        Cancelled, Unknown, InvalidArgument, Timeout, NotFound, AlreadyExists,
        PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
        Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated,
    )
}

# The domain of the ErrorInfo details the server attaches.
ERROR_DOMAIN = "deltagym.dev"

_BY_REASON: dict[str, type[DeltagymError]] = {
    "SANDBOX_NOT_FOUND": SandboxNotFound,
    "CHECKPOINT_NOT_FOUND": CheckpointNotFound,
    "ENV_NOT_FOUND": EnvNotFound,
    "EPISODE_NOT_FOUND": EpisodeNotFound,
    "EPISODE_ENDED": EpisodeEnded,
    "SANDBOX_CLOSED": SandboxClosed,
    "WRONG_NODE": WrongNode,
    "DRAINING": Draining,
    "NODE_UNAVAILABLE": NodeUnavailable,
    "RATE_LIMITED": RateLimited,
    "NO_CAPACITY": NoCapacity,
}

_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def _seconds(v: str) -> float | None:
    try:
        f = float(v)
    except ValueError:
        return None
    return f if f >= 0 and f == f and f != float("inf") else None


def from_code(code: grpc.StatusCode | int, message: str, method: str = "", *, reason: str = "",
              metadata: Mapping[str, str] | None = None) -> DeltagymError:
    """Returns the exception for a status code (a grpc.StatusCode or its
    number) and the server's reason: the reason's class when it is one of
    this status code's, else the status code's class."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, DeltagymError)
    sem = _BY_REASON.get(reason)
    if sem is not None and issubclass(sem, cls):
        cls = sem
    return cls(message, code=code, method=method, reason=reason, metadata=metadata)


def on_node(err: DeltagymError, node: str, address: str) -> DeltagymError:
    """Returns err as a call to a cluster's node (named node, reached at address) raised it: an
    UNAVAILABLE becomes a NodeUnavailable naming the node, but for the node's own DRAINING,
    which says it answers; every other error is err. Outside a cluster (node "") it is err."""
    if not node or not isinstance(err, Unavailable) or isinstance(err, (Draining, NodeUnavailable)):
        return err
    return NodeUnavailable(f"node {node} ({address}) is unavailable: {err.message}", method=err.method,
                           reason=err.reason, metadata=err.metadata, node=node, address=address)


def error_info(trailers: Iterable[Any] | None) -> tuple[str, dict[str, str]]:
    """Returns the reason and metadata of the first google.rpc.ErrorInfo in
    the grpc-status-details-bin trailer (preferring the deltagym.dev
    domain), or ("", {}) when there is none or it does not parse."""
    for item in trailers or ():
        key, value = item[0], item[1]
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a malformed trailer is no reason to hide the status
            return "", {}
        found: error_details_pb2.ErrorInfo | None = None
        for d in status.details:
            if not d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                continue
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            if found is None or (info.domain == ERROR_DOMAIN and found.domain != ERROR_DOMAIN):
                found = info
        if found is not None:
            return found.reason, dict(found.metadata)
    return "", {}


def no_token_hint() -> str:
    """What an UNAUTHENTICATED error of a client that sent no token adds:
    how to give one, and which files it looked in."""
    files = token_files()
    looked = f"; it looked in {', '.join(files)}" if files else ""
    return (" (this client found no token: pass token=, set $DELTAGYM_TOKEN or $DELTAGYM_TOKEN_FILE, or set "
            f"$DELTAGYM_DATA to the server's data directory{looked})")


def from_rpc_error(err: grpc.RpcError, method: str = "", sent_token: bool = True) -> DeltagymError:
    """Converts a grpc.RpcError (sync or aio) into the matching DeltagymError.
    An UNAUTHENTICATED error of a client that sent no token says where it
    looked for one."""
    e: Any = err  # a sync grpc.Call or an aio AioRpcError; a bare RpcError has neither method
    code = (e.code() if hasattr(e, "code") else None) or grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.UNAUTHENTICATED and not sent_token:
        details = (details or "") + no_token_hint()
    trailers = None
    if hasattr(e, "trailing_metadata"):
        try:
            trailers = e.trailing_metadata()
        except Exception:  # some transport errors carry no call to ask
            trailers = None
    reason, md = error_info(trailers)
    return from_code(code, details or "", method, reason=reason, metadata=md)


class SandboxError(Exception):
    """Base of the failures inside a sandbox that are not call errors: the
    call succeeded, and what it ran failed."""


class CommandExitError(SandboxError):
    """A command run with check=True failed: it exited non-zero, timed out
    or was killed by a signal. The message names the command (cut to 200
    characters), how it failed and the end of its stderr (its stdout when
    the stderr is empty).

    Attributes:
        result: the command's CommandResult.
        command: the command as run: a str, or its argv joined as a shell would quote it.
    """

    def __init__(self, result: CommandResult, command: str | Sequence[str] = "") -> None:
        self.result = result
        self.command = command if isinstance(command, str) else shlex.join(command)
        if result.timed_out:
            why = f"timed out after {result.duration:g}s" if result.duration else "timed out"
        elif result.signal:
            why = f"was killed by signal {result.signal}{_signal_name(result.signal)}"
        else:
            why = f"exited with {result.exit_code}"
        cmd = self.command if len(self.command) <= _COMMAND_CHARS else self.command[:_COMMAND_CHARS - 3] + "..."
        what = f"command {cmd!r}" if cmd else "command"
        if result.stderr:
            tail = "; stderr: " + _tail(result.stderr)
        elif result.stdout:
            tail = "; stdout: " + _tail(result.stdout)
        else:
            tail = ""
        super().__init__(f"{what} {why}{tail}")


# How much of a failed command, and of the end of its output, a CommandExitError's message shows.
_COMMAND_CHARS = 200
_TAIL_CHARS = 500


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL_CHARS else "..." + text[-_TAIL_CHARS:]


def _signal_name(n: int) -> str:
    try:
        return f" ({signal.Signals(n).name})"
    except ValueError:
        return ""


class ActionFailed(SandboxError):
    """The sandbox's state refused an action (a missing file, a directory
    where a file was expected, a program that is not executable ...). The
    step is recorded and counts; the episode goes on.

    Attributes:
        error: the errno, its name and the server's message.
        step: the step's StepInfo.
    """

    def __init__(self, error: ActionErrorInfo, step: StepInfo) -> None:
        self.error = error
        self.step = step
        self.errno = error.errno
        self.errno_name = error.errno_name
        super().__init__(f"{error.errno_name}: {error.message}")


class ProcessEnded(SandboxError):
    """An interactive process has ended (a step's result said it no longer
    runs), so there is nothing to send text to: what was sent would go to
    the session's shell instead. Start it again with processes.start.

    Attributes:
        session: the process's session.
        result: the result of the step that saw it end.
    """

    def __init__(self, session: str, result: CommandResult) -> None:
        self.session = session
        self.result = result
        if result.signal:
            how = f"was killed by signal {result.signal}{_signal_name(result.signal)}"
        elif result.exit_code >= 0:
            how = f"exited with {result.exit_code}"
        else:
            how = "ended"
        super().__init__(f"the interactive process of session {session!r} {how}; "
                         "processes.start runs it again, run(..., session=) runs shell commands there")


class UnsafeArchiveError(SandboxError):
    """A downloaded archive holds an entry that would land outside the
    target directory, a device or FIFO, or a link that leads out; nothing
    was written."""
