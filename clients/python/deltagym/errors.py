"""Exceptions raised by the deltagym clients, one class per gRPC status code.

Every error a call can raise is a :class:`DeltagymError` carrying the status
``code`` (a :class:`grpc.StatusCode`) and the server's ``message``. Catch a
subclass (``NotFound``, ``InvalidArgument`` ...) to handle one kind of failure.
"""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = [
    "DeltagymError",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "from_rpc_error",
    "from_code",
]


class DeltagymError(Exception):
    """Base of every error raised by a deltagym call.

    Attributes:
        code: the gRPC status code.
        message: the server's (or the transport's) message.
        method: the RPC that failed, e.g. "Step", when known.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None, method: str = "") -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
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


_BY_CODE: dict[grpc.StatusCode, type[DeltagymError]] = {
    cls.code: cls
    for cls in (
        Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
        PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
        Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated,
    )
}

_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def from_code(code: grpc.StatusCode | int, message: str, method: str = "") -> DeltagymError:
    """Returns the exception for a status code (a grpc.StatusCode or its number)."""
    if isinstance(code, int):
        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, DeltagymError)
    return cls(message, code=code, method=method)


NO_TOKEN_HINT = (" (this client found no token: pass token=, set $DELTAGYM_TOKEN or $DELTAGYM_TOKEN_FILE, "
                 "or run from the directory that holds the server's data directory .data, or set $DELTAGYM_DATA to it)")


def from_rpc_error(err: grpc.RpcError, method: str = "", sent_token: bool = True) -> DeltagymError:
    """Converts a grpc.RpcError (sync or aio) into the matching DeltagymError.
    An UNAUTHENTICATED error of a client that sent no token says where it
    looked for one."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAUTHENTICATED and not sent_token:
        details = (details or "") + NO_TOKEN_HINT
    return from_code(code, details or "", method)
