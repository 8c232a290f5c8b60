"""Gymnasium environments over deltagym sandboxes.

    import gymnasium
    import deltagym.gym  # registers "deltagym/shell-v0" (import deltagym does too)

    env = gymnasium.make("deltagym/shell-v0")
    obs, info = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("echo 42 > answer.txt")
    obs, reward, terminated, truncated, info = env.step("submit")
    env.close()

Actions are text: a shell command, run as `/bin/sh -c` (or in the persistent
bash session named by `session`), or "submit" / "submit <answer>", which ends
the episode and runs the verifier. The action space's sample() draws from a
fixed set of varied, harmless shell commands with the space's own RNG.

Observations are the rendered text of the result (stdout, stderr, a final
"[exit N]" line for failures), cut to max_observation_length and limited to
printable ASCII plus whitespace (other characters become "?"), so that they
always lie in observation_space.

Info values are numbers (int, float, bool) or dicts of numbers, so vector
envs batch them into arrays: step_index, steps_left, exit_code, signal,
timed_out (commands), errno (refused actions), components (submit), and the
numeric entries of the server's info map. IDs are attributes of the env
(sandbox_id, episode_id, start_checkpoint_id); the full StepResponse is
env.last_response.

Registration: importing this module registers "deltagym/<name>-v0" for each
env of the repository's built-in catalog (BUILTIN_ENVS), with no network;
register_envs(client) registers every env of a server's catalog, made with
that client. Each id also has a vector entry point, deltagym.gym_vector's
SandboxVectorEnv, so gymnasium.make_vec(id, num_envs=n,
vectorization_mode="vector_entry_point") steps n sandboxes concurrently.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from typing import Any, SupportsFloat

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as e:  # the extra is not installed
    raise ImportError(
        'deltagym.gym needs Gymnasium: pip install "deltagym[gym]", or "./clients/python[gym]" from a checkout'
    ) from e

import numpy as np

from . import _common as c
from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .actions import command, submit
from .client import Client, SandboxHandle

__all__ = [
    "BUILTIN_ENVS",
    "OBSERVATION_CHARSET",
    "SAMPLE_COMMANDS",
    "SandboxEnv",
    "ShellCommandSpace",
    "env_id",
    "numeric_info",
    "register_builtin_envs",
    "register_envs",
]

OBSERVATION_CHARSET = frozenset(string.printable)
# Actions may hold any printable ASCII character (pipes, quotes, redirections).
ACTION_CHARSET = "".join(sorted(frozenset(string.printable) - frozenset("\x0b\x0c")))

# What ShellCommandSpace.sample() draws from: commands that work in any env
# with a POSIX shell and coreutils or Busybox, print the same text every time
# (env checkers compare two seeded steps), and leave the task's state alone.
SAMPLE_COMMANDS: tuple[str, ...] = (
    "echo hello",
    "pwd",
    "ls /",
    "true",
    "false",
    "id -u",
    "uname -s",
    "seq 1 5",
    "expr 6 \\* 7",
    "printf '%s\\n' alpha beta gamma",
    "echo deltagym | tr a-z A-Z",
    "echo one two three | wc -w",
    "test -d /tmp && echo tmp is a directory",
    "cat /nonexistent",
    "sh -c 'exit 3'",
    "echo out; echo err >&2",
    "mkdir -p /tmp/sample && ls -d /tmp/sample",
    "printf 'b\\na\\nc\\n' | sort",
    "basename /usr/local/bin",
    "echo $((17 % 5))",
)

# The envs of the repository's catalog (envs/*.json), registered at import.
BUILTIN_ENVS: tuple[str, ...] = ("shell",)

ENTRY_POINT = "deltagym.gym:SandboxEnv"
VECTOR_ENTRY_POINT = "deltagym.gym_vector:SandboxVectorEnv"

InfoValue = int | float | bool


class ShellCommandSpace(spaces.Text):
    """A Text space of shell commands: contains() accepts any printable
    command up to max_length; sample() draws one of SAMPLE_COMMANDS (or of
    the given commands) with the space's RNG, so seed() makes it repeatable.
    A sample() given a mask or probability samples characters as Text does."""

    def __init__(self, max_length: int = 4096, *, commands: tuple[str, ...] = SAMPLE_COMMANDS,
                 seed: int | np.random.Generator | None = None) -> None:
        if not commands:
            raise ValueError("ShellCommandSpace needs at least one sample command")
        for cmd in commands:
            if not 1 <= len(cmd) <= max_length or any(ch not in ACTION_CHARSET for ch in cmd):
                raise ValueError(f"sample command {cmd!r} is not in the space (printable, 1 to {max_length} characters)")
        super().__init__(max_length=max_length, min_length=1, charset=ACTION_CHARSET, seed=seed)
        self.commands = tuple(commands)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is not None or probability is not None:
            return str(super().sample(mask=mask, probability=probability))
        return self.commands[int(self.np_random.integers(len(self.commands)))]

    def __repr__(self) -> str:
        return f"ShellCommandSpace({self.max_length}, {len(self.commands)} sample commands)"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ShellCommandSpace) and self.max_length == other.max_length
                and self.commands == other.commands)

    __hash__ = None  # type: ignore[assignment]  # mutable RNG state, as Text


def numeric_info(m: Mapping[str, str]) -> dict[str, InfoValue]:
    """The entries of a server info map that hold numbers or booleans,
    parsed ("3" → 3, "0.5" → 0.5, "true" → True); others are left out."""
    out: dict[str, InfoValue] = {}
    for k, v in m.items():
        if v in ("true", "false"):
            out[k] = v == "true"
            continue
        try:
            out[k] = int(v)
            continue
        except ValueError:
            pass
        try:
            f = float(v)
        except ValueError:
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def step_info(resp: es.StepResponse) -> dict[str, Any]:
    """A StepResponse's facts as numbers: what the same seed and actions
    reproduce (the env checker compares it); IDs and timings are left out."""
    info: dict[str, Any] = numeric_info(resp.info)
    info["step_index"] = int(resp.step_index)
    info["steps_left"] = int(resp.steps_left)
    obs = resp.observation
    kind = obs.WhichOneof("kind")
    if kind == "exec":
        info["exit_code"] = int(obs.exec.exit_code)
        info["signal"] = int(obs.exec.signal)
        info["timed_out"] = bool(obs.exec.timed_out)
    elif kind == "submit":
        info["components"] = {k: float(v) for k, v in obs.submit.components.items()}
    if obs.HasField("error"):
        info["errno"] = int(obs.error.errno)
    return info


class SandboxEnv(gymnasium.Env[str, str]):
    """A gymnasium.Env whose episodes run in deltagym sandboxes.

    Args:
        env: the catalog name of the server env.
        client: a deltagym.Client to use (not closed by close()); default one
            made from addr and token, closed by close().
        addr, token: server address and bearer token when no client is given.
        session: name of the persistent bash session commands run in; "" runs
            each command in a fresh `/bin/sh -c`.
        submit_command: the action text that submits ("submit", or
            "submit <answer>"); None disables it.
        run, group_id: recorded with each episode in the ledger.
        reset_options: default Reset options, merged under reset(options=...).
        max_action_length, max_observation_length: bounds of the Text spaces.
        sample_commands: what action_space.sample() draws from (default
            SAMPLE_COMMANDS); commands that suit the env's image and task.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}  # noqa: RUF012  # Gymnasium reads it per class

    def __init__(
        self,
        env: str = "shell",
        *,
        client: Client | None = None,
        addr: str | None = None,
        token: str | None = None,
        session: str = "",
        submit_command: str | None = "submit",
        run: str = "",
        group_id: str = "",
        reset_options: Mapping[str, Any] | None = None,
        max_action_length: int = 4096,
        max_observation_length: int = 16384,
        render_mode: str | None = None,
        sample_commands: Sequence[str] = SAMPLE_COMMANDS,
        _sandbox: SandboxHandle | None = None,
    ) -> None:
        super().__init__()
        self.env_name = env
        self._own_client = client is None
        self.client = client or Client(addr, token=token)
        self.session = session
        self.submit_command = submit_command
        self.run = run
        self.group_id = group_id
        self.reset_options = dict(reset_options or {})
        self.render_mode = render_mode
        self.max_action_length = max_action_length
        self.max_observation_length = max_observation_length
        self.sample_commands = tuple(sample_commands)
        self.action_space = ShellCommandSpace(max_action_length, commands=self.sample_commands)
        self.observation_space = spaces.Text(max_length=max_observation_length, min_length=0,
                                             charset="".join(sorted(OBSERVATION_CHARSET)))
        self.sandbox: SandboxHandle | None = _sandbox
        self._last_obs = ""
        self.last_response: es.StepResponse | None = None

    @property
    def sandbox_id(self) -> str:
        """The current sandbox's ID ("" before reset)."""
        return self.sandbox.id if self.sandbox else ""

    @property
    def episode_id(self) -> str:
        """The current episode's ID ("" before reset)."""
        return self.sandbox.episode_id if self.sandbox else ""

    @property
    def start_checkpoint_id(self) -> str:
        """The checkpoint the current sandbox's first episode started from."""
        return self.sandbox.start_checkpoint_id if self.sandbox else ""

    # --- Gymnasium API --------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Starts an episode in a fresh warm sandbox (closing the previous one).
        seed goes to the env's reset hook as DELTAGYM_SEED; options as variables."""
        super().reset(seed=seed)
        self._drop_sandbox()
        opts = {**self.reset_options, **(options or {})}
        self.sandbox = self.client.reset(self.env_name, seed=seed, options=opts, run=self.run, group_id=self.group_id)
        resp = self.sandbox.reset_response
        assert resp is not None
        obs = self._clip(c.observation_text(resp.observation))
        self._last_obs = obs
        self.last_response = None
        return obs, dict(numeric_info(resp.info))

    def step(self, action: str | action_pb2.Action) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        """Performs one action: a command, "submit [answer]", or an Action message."""
        sb = self._need_sandbox()
        return self.apply(sb.step(self.action(action)))

    def apply(self, resp: es.StepResponse) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Makes a step's transition from its StepResponse (what step() returns)."""
        obs = self._clip(c.observation_text(resp.observation))
        self._last_obs = obs
        self.last_response = resp
        if self.sandbox is not None and resp.episode_id:
            self.sandbox.episode_id = resp.episode_id
        return obs, float(resp.reward), bool(resp.terminated), bool(resp.truncated), step_info(resp)

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last_obs
        return None

    def close(self) -> None:
        """Closes the sandbox (and the client, when the env made it). Idempotent."""
        self._drop_sandbox()
        if self._own_client:
            self.client.close()
        super().close()

    # --- deltagym extras ------------------------------------------------------

    def checkpoint(self, *, durable: bool = False) -> str:
        """Saves the current state; returns the checkpoint ID."""
        return str(self._need_sandbox().checkpoint(durable=durable).checkpoint_id)

    def restore(self, checkpoint_id: str) -> dict[str, Any]:
        """Puts the sandbox back at a checkpoint (a new episode starts there)."""
        r = self._need_sandbox().restore(checkpoint_id)
        return {"episode_id": r.episode_id, "next_step_index": int(r.next_step_index)}

    def fork(self, n: int, *, group_id: str = "", fresh_entropy: bool = False) -> list[SandboxEnv]:
        """Returns n new envs, each in its own sandbox at this env's current
        state, sharing this env's client. Close each when done."""
        kids = self._need_sandbox().fork(n, group_id=group_id, run=self.run, fresh_entropy=fresh_entropy)
        out = []
        for k in kids:
            e = SandboxEnv(self.env_name, client=self.client, session=self.session, submit_command=self.submit_command,
                           run=self.run, group_id=group_id or self.group_id, reset_options=self.reset_options,
                           max_action_length=self.max_action_length,
                           max_observation_length=self.max_observation_length,
                           render_mode=self.render_mode, sample_commands=self.sample_commands, _sandbox=k)
            e._last_obs = self._last_obs
            out.append(e)
        return out

    def evaluate(self) -> float:
        """Runs the verifier on the current state without ending the episode."""
        return float(self._need_sandbox().evaluate().reward)

    def action(self, action: str | action_pb2.Action) -> action_pb2.Action:
        """The Action an action text stands for: "submit [answer]" or a command."""
        if isinstance(action, action_pb2.Action):
            return action
        if not isinstance(action, str):
            raise TypeError(f"SandboxEnv actions are str, not {type(action).__name__}")
        sc = self.submit_command
        if sc is not None:
            stripped = action.strip()
            if stripped == sc:
                return submit()
            if stripped.startswith(sc + " "):
                return submit(stripped[len(sc) + 1:])
        return command(action, session=self.session)

    # --- helpers --------------------------------------------------------------

    def _need_sandbox(self) -> SandboxHandle:
        if self.sandbox is None:
            raise RuntimeError("SandboxEnv: call reset() first")
        return self.sandbox

    def _drop_sandbox(self) -> None:
        if self.sandbox is not None:
            sb, self.sandbox = self.sandbox, None
            sb.close()

    def _clip(self, text: str) -> str:
        text = "".join(ch if ch in OBSERVATION_CHARSET else "?" for ch in text)
        return text[: self.max_observation_length]


def env_id(name: str) -> str:
    """The Gymnasium id of a catalog env: "deltagym/<name>-v0"."""
    return f"deltagym/{name}-v0"


def _register(name: str, client: Client | None) -> str:
    gid = env_id(name)
    if client is None:
        gymnasium.register(gid, entry_point=ENTRY_POINT, vector_entry_point=VECTOR_ENTRY_POINT,
                           kwargs={"env": name})
        return gid

    # A server's envs are made with the caller's client, which the entry
    # points hold (spec kwargs are deep-copied, a client cannot be).
    def make(**kw: Any) -> SandboxEnv:
        return SandboxEnv(client=client, **kw)

    def make_vec(**kw: Any) -> gymnasium.vector.VectorEnv[Any, Any, Any]:
        from .gym_vector import SandboxVectorEnv

        return SandboxVectorEnv(client=client, **kw)

    gymnasium.register(gid, entry_point=make, vector_entry_point=make_vec, kwargs={"env": name})
    return gid


def register_envs(client: Client) -> list[str]:
    """Registers "deltagym/<name>-v0" for every env of the server's catalog,
    made with client (which must outlive them), replacing earlier
    registrations of the same ids. Returns the ids, in catalog order."""
    ids = []
    for info in client.list_envs():
        name = info.spec.name
        gid = env_id(name)
        gymnasium.registry.pop(gid, None)
        ids.append(_register(name, client))
    return ids


def register_builtin_envs() -> list[str]:
    """Registers "deltagym/<name>-v0" for each env of BUILTIN_ENVS, made
    from a client of their own (addr and token as Client resolves them,
    unless given to gymnasium.make), unless an id is registered already.
    Runs at import; needs no server."""
    return [_register(name, None) for name in BUILTIN_ENVS if env_id(name) not in gymnasium.registry]


register_builtin_envs()
