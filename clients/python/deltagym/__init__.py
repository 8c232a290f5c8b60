"""deltagym: Python SDK for deltagym sandbox servers.

Client and AsyncClient cover every call of EnvService and LedgerService;
Sandbox and AsyncSandbox are leased sandboxes whose leases are renewed in the
background until closed. deltagym.gym holds the Gymnasium env, deltagym.grpo
group rollouts, deltagym.tree checkpoint tree search.
"""

from . import actions, errors
from ._common import RetryPolicy, observation_text
from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2, ledger_service_pb2
from ._version import __version__
from .aio import AsyncClient, AsyncSandbox
from .client import Client, Sandbox
from .errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    DeltagymError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)

__all__ = [
    "__version__",
    "Client", "Sandbox", "AsyncClient", "AsyncSandbox", "RetryPolicy", "observation_text", "actions", "errors",
    "action_pb2", "env_pb2", "env_service_pb2", "ledger_service_pb2",
    "DeltagymError", "NotFound", "InvalidArgument", "FailedPrecondition", "ResourceExhausted", "Aborted",
    "Unauthenticated", "AlreadyExists", "PermissionDenied", "DeadlineExceeded", "Unavailable", "Unimplemented",
    "Internal",
]
