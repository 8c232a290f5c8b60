"""deltagym: Python SDK for deltagym sandbox servers.

Sandbox (and deltagym.aio.AsyncSandbox) is a leased sandbox with typed
results: commands, streaming output, files, processes, setup steps,
checkpoints, restores and forks. Client and AsyncClient are the low-level
clients covering every call of EnvService and LedgerService, returning the
server's messages (deltagym.raw holds the generated modules). Cluster (and
deltagym.aio.AsyncCluster) routes the calls over a cluster of nodes,
placing new sandboxes by load. deltagym.gym holds the Gymnasium env, deltagym.grpo group rollouts, deltagym.tree
checkpoint tree search, deltagym.errors the exceptions.
"""

from . import actions, cluster, errors, raw, types
from ._common import RetryPolicy, observation_text
from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2, ledger_service_pb2
from ._version import __version__
from .aio import AsyncClient, AsyncCluster, AsyncSandbox
from .client import Client, SandboxHandle
from .cluster import Cluster
from .errors import (
    Aborted,
    ActionFailed,
    AlreadyExists,
    CheckpointNotFound,
    CommandExitError,
    DeadlineExceeded,
    DeltagymError,
    Draining,
    EnvNotFound,
    EpisodeEnded,
    EpisodeNotFound,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NoCapacity,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    ProcessEnded,
    RateLimited,
    ResourceExhausted,
    SandboxClosed,
    SandboxError,
    SandboxNotFound,
    Timeout,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    WrongNode,
)
from .sandbox import CommandStream, Files, Process, Processes, Sandbox
from .types import (
    Checkpoint,
    CommandResult,
    Evaluation,
    FileInfo,
    NodeInfo,
    OutputChunk,
    ProcessInfo,
    Restored,
    SandboxInfo,
    StepInfo,
    StepResult,
    SubmitResult,
    UploadResult,
)

__all__ = [
    "Aborted",
    "ActionFailed",
    "AlreadyExists",
    "AsyncClient",
    "AsyncCluster",
    "AsyncSandbox",
    "Checkpoint",
    "CheckpointNotFound",
    "Client",
    "Cluster",
    "CommandExitError",
    "CommandResult",
    "CommandStream",
    "DeadlineExceeded",
    "DeltagymError",
    "Draining",
    "EnvNotFound",
    "EpisodeEnded",
    "EpisodeNotFound",
    "Evaluation",
    "FailedPrecondition",
    "FileInfo",
    "Files",
    "Internal",
    "InvalidArgument",
    "NoCapacity",
    "NodeInfo",
    "NodeUnavailable",
    "NotFound",
    "OutputChunk",
    "PermissionDenied",
    "Process",
    "ProcessEnded",
    "ProcessInfo",
    "Processes",
    "RateLimited",
    "ResourceExhausted",
    "Restored",
    "RetryPolicy",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxHandle",
    "SandboxInfo",
    "SandboxNotFound",
    "StepInfo",
    "StepResult",
    "SubmitResult",
    "Timeout",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "UploadResult",
    "WrongNode",
    "__version__",
    "action_pb2",
    "actions",
    "cluster",
    "env_pb2",
    "env_service_pb2",
    "errors",
    "ledger_service_pb2",
    "observation_text",
    "raw",
    "types",
]

# With Gymnasium installed, `import deltagym` registers the Gymnasium ids of
# the built-in envs ("deltagym/shell-v0"), so gymnasium.make finds them.
import importlib.util as _importlib_util

if _importlib_util.find_spec("gymnasium") is not None:
    from . import gym as gym
