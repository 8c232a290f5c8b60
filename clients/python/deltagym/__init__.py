"""deltagym: Python SDK for deltagym sandbox servers.

Client and AsyncClient cover every call of EnvService and LedgerService;
Sandbox and AsyncSandbox are leased sandboxes whose leases are renewed in the
background until closed. deltagym.gym holds the Gymnasium env, deltagym.grpo
group rollouts, deltagym.tree checkpoint tree search.
"""

from . import actions, errors
from ._common import RetryPolicy, observation_text
from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2, ledger_service_pb2
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

__version__ = "0.1.0"

__all__ = [
    "Client", "Sandbox", "AsyncClient", "AsyncSandbox", "RetryPolicy", "observation_text", "actions", "errors",
    "action_pb2", "env_pb2", "env_service_pb2", "ledger_service_pb2",
    "DeltagymError", "NotFound", "InvalidArgument", "FailedPrecondition", "ResourceExhausted", "Aborted",
    "Unauthenticated", "AlreadyExists", "PermissionDenied", "DeadlineExceeded", "Unavailable", "Unimplemented",
    "Internal",
]

# With Gymnasium installed, `import deltagym` registers the Gymnasium ids of
# the built-in envs ("deltagym/shell-v0"), so gymnasium.make finds them.
import importlib.util as _importlib_util

if _importlib_util.find_spec("gymnasium") is not None:
    from . import gym as gym
