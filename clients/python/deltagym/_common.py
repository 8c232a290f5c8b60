"""Pieces shared by the sync and asyncio clients: addressing, auth, retry
policy, request builders and observation rendering."""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from ._proto.deltagym.v1 import action_pb2, env_pb2, env_service_pb2 as es, ledger_service_pb2 as ls, state_pb2
from .actions import coerce
from .types import Checkpoint, DiffDetail

DEFAULT_ADDR = "127.0.0.1:8080"

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect quickly after a server restart, within the retry budget of
    # RetryPolicy (the gRPC default waits a second, then longer).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Heartbeats go out at this fraction of the lease TTL, never more often than
# MIN_HEARTBEAT seconds; before the first lease is seen, DEFAULT_HEARTBEAT.
HEARTBEAT_FRACTION = 1 / 3
MIN_HEARTBEAT = 0.2
DEFAULT_HEARTBEAT = 60.0


def resolve_addr(addr: str | None) -> str:
    """Returns addr, else $DELTAGYM_ADDR, else 127.0.0.1:8080. A leading
    http:// is dropped (gRPC targets have no scheme)."""
    a = addr or os.environ.get("DELTAGYM_ADDR") or DEFAULT_ADDR
    for p in ("http://", "grpc://"):
        if a.startswith(p):
            a = a[len(p):]
    return a.rstrip("/")


def resolve_token(token: str | None) -> str:
    """Returns the bearer token to send: token when given, else
    $DELTAGYM_TOKEN, else the contents of the file $DELTAGYM_TOKEN_FILE (an
    OSError when it cannot be read), else the first of token_files() that
    this user may read and that holds one (a server started without a
    token writes it there); else ""."""
    if token is not None:
        return token
    env = os.environ.get("DELTAGYM_TOKEN", "")
    if env:
        return env
    path = os.environ.get("DELTAGYM_TOKEN_FILE", "")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    for p in token_files():
        try:
            with open(p, encoding="utf-8") as f:
                found = f.read().strip()
        except OSError:
            continue  # no server here, or not this user's to read
        if found:
            return found
    return ""


def token_files() -> list[str]:
    """The files resolve_token looks in for the token of a server that made
    its own: "token" of $DELTAGYM_DATA when set; else .data/token in the
    working directory and in each directory above it, up to the first
    that holds .git (a checkout's root, where `make serve` keeps .data) or
    the filesystem root, so a program run from anywhere in a checkout
    finds its server's token."""
    data = os.environ.get("DELTAGYM_DATA")
    if data:
        return [os.path.join(data, "token")]
    try:
        d = os.getcwd()
    except OSError:  # the working directory was removed
        return []
    out = []
    while True:
        out.append(os.path.join(d, ".data", "token"))
        parent = os.path.dirname(d)
        if parent == d or os.path.lexists(os.path.join(d, ".git")):
            return out
        d = parent


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def new_key() -> str:
    """A fresh idempotency key."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class RetryPolicy:
    """How calls that are safe to repeat are retried on UNAVAILABLE.

    Safe calls are the reads (ListEnvs, GetSandbox, ListSandboxes, Evaluate and
    every LedgerService query), Heartbeat, Close (closing twice succeeds) and
    Reset/Fork, which always carry an idempotency key. Step, Checkpoint,
    Restore, RegisterEnv, ImportImage, ReleaseCheckpoint, ReportReward and
    StepStream are never retried.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number attempt (0-based), jittered."""
        b = min(self.max_backoff, self.initial_backoff * self.multiplier ** attempt)
        return b * (0.5 + random.random() / 2)


NO_RETRY = RetryPolicy(max_attempts=1)
DEFAULT_RETRY = RetryPolicy()


def reset_request(env: str, seed: int | None, options: Mapping[str, Any] | None, run: str,
                  group_id: str, idempotency_key: str | None) -> es.ResetRequest:
    req = es.ResetRequest(env=env, options={k: str(v) for k, v in (options or {}).items()},
                          run=run, group_id=group_id, idempotency_key=idempotency_key or new_key())
    if seed is not None:
        req.seed = int(seed)
    return req


def fork_request(checkpoint_id: str | None, sandbox_id: str | None, n: int, group_id: str, run: str,
                 fresh_entropy: bool, idempotency_key: str | None) -> es.ForkRequest:
    if (checkpoint_id is None) == (sandbox_id is None):
        raise ValueError("fork needs exactly one of checkpoint_id and sandbox_id")
    req = es.ForkRequest(n=n, group_id=group_id, run=run, fresh_entropy=fresh_entropy,
                         idempotency_key=idempotency_key or new_key())
    if checkpoint_id is not None:
        req.checkpoint_id = checkpoint_id
    else:
        req.sandbox_id = sandbox_id  # type: ignore[assignment]
    return req


def tree_request(run: str | None, episode_id: str | None) -> ls.GetCheckpointTreeRequest:
    if (run is None) == (episode_id is None):
        raise ValueError("get_checkpoint_tree needs exactly one of run and episode_id")
    return ls.GetCheckpointTreeRequest(run=run) if run is not None else ls.GetCheckpointTreeRequest(episode_id=episode_id)


def env_spec(spec: env_pb2.EnvSpec | Mapping[str, Any]) -> env_pb2.EnvSpec:
    """Accepts an EnvSpec or its JSON form as a dict (as in catalog files)."""
    if isinstance(spec, env_pb2.EnvSpec):
        return spec
    return json_format.ParseDict(dict(spec), env_pb2.EnvSpec())


def step_request(sandbox_id: str, action: action_pb2.Action | str, checkpoint: bool,
                 restore: str | None = None, fresh_entropy: bool = False, wait_for_digest: bool = False,
                 dedupe: bool = False) -> es.StepRequest:
    """A StepRequest; wait_for_digest and dedupe are the checkpoint's (checkpoint_wait_for_digest,
    checkpoint_dedupe), so they need checkpoint."""
    if (wait_for_digest or dedupe) and not checkpoint:
        raise ValueError("checkpoint_wait_for_digest and checkpoint_dedupe need checkpoint=True")
    return es.StepRequest(sandbox_id=sandbox_id, action=coerce(action), checkpoint=checkpoint,
                          restore_checkpoint_id=restore or "", restore_fresh_entropy=fresh_entropy,
                          checkpoint_wait_for_digest=wait_for_digest, checkpoint_dedupe=dedupe)


def checkpoint_request(sandbox_id: str, durable: bool, process_mode: env_pb2.ProcessMode | str | None,
                       wait_for_digest: bool, dedupe: bool) -> es.CheckpointRequest:
    """A CheckpointRequest."""
    return es.CheckpointRequest(sandbox_id=sandbox_id, durable=durable, process_mode=process_mode,
                                wait_for_digest=wait_for_digest, dedupe=dedupe)


DIFF_DETAILS: dict[str, state_pb2.DiffDetail] = {
    "paths": state_pb2.DIFF_DETAIL_PATHS,
    "lines": state_pb2.DIFF_DETAIL_LINES,
    "unified": state_pb2.DIFF_DETAIL_UNIFIED,
}


def checkpoint_id(checkpoint: Checkpoint | str, what: str = "checkpoint") -> str:
    """The ID of a Checkpoint or of a checkpoint ID; ValueError when empty."""
    cid = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"{what} must be a Checkpoint or a non-empty checkpoint ID")
    return cid


def diff_request(base: Checkpoint | str, checkpoint: Checkpoint | str, detail: DiffDetail, path: str | None,
                 max_paths: int | None) -> es.DiffCheckpointsRequest:
    """A DiffCheckpointsRequest; ValueError for a detail or max_paths the server would refuse."""
    if detail not in DIFF_DETAILS:
        raise ValueError(f"detail must be one of {sorted(DIFF_DETAILS)}, not {detail!r}")
    if max_paths is not None and max_paths <= 0:
        raise ValueError(f"max_paths must be positive, not {max_paths}")
    return es.DiffCheckpointsRequest(base_checkpoint_id=checkpoint_id(base, "base"),
                                     checkpoint_id=checkpoint_id(checkpoint), detail=DIFF_DETAILS[detail],
                                     path=path or "", max_paths=max_paths or 0)


def list_checkpoints_request(env: str, run: str, group_id: str, episode_id: str) -> es.ListCheckpointsRequest:
    """A ListCheckpointsRequest."""
    return es.ListCheckpointsRequest(env=env, run=run, group_id=group_id, episode_id=episode_id)


def lease_seconds(ts: Any, now: float) -> float | None:
    """Seconds from now until a google.protobuf.Timestamp, or None when unset."""
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    at: float = ts.seconds + ts.nanos / 1e9
    return at - now


def ttl_seconds(ttl: float | None) -> float:
    """A lease TTL as the requests carry it: 0 for the server's default."""
    if ttl is None:
        return 0.0
    if not ttl > 0 or ttl == float("inf"):
        raise ValueError(f"lease_ttl must be a positive number of seconds, not {ttl}")
    return float(ttl)


def heartbeat_interval(ttl: float | None) -> float:
    if ttl is None or ttl <= 0:
        return DEFAULT_HEARTBEAT
    return max(MIN_HEARTBEAT, ttl * HEARTBEAT_FRACTION)


def observation_text(obs: action_pb2.Observation) -> str:
    """Renders an observation as the text an agent reads."""
    if obs.HasField("error"):  # the sandbox's state refused the action
        return f"[{obs.error.errno_name}: {obs.error.message}]\n"
    kind = obs.WhichOneof("kind")
    if kind == "exec":
        return exec_text(obs.exec)
    if kind == "reset":
        parts = [obs.reset.task]
        if obs.reset.HasField("hook"):
            parts.append(exec_text(obs.reset.hook))
        return "\n".join(p for p in parts if p)
    if kind == "read_file":
        return obs.read_file.content.decode("utf-8", "replace")
    if kind == "write_file":
        return f"wrote {obs.write_file.size} bytes"
    if kind == "submit":
        return obs.submit.output
    return ""


def exec_text(r: action_pb2.ExecResult) -> str:
    out = r.stdout.decode("utf-8", "replace")
    err = r.stderr.decode("utf-8", "replace")
    text = out + err
    if r.timed_out:
        text += "[timed out]\n"
    elif r.signal:
        text += f"[killed by signal {r.signal}]\n"
    elif r.exit_code not in (0, -1):
        text += f"[exit {r.exit_code}]\n"
    return text


def ids(items: Sequence[Any]) -> list[str]:
    return [getattr(i, "id", i) for i in items]
