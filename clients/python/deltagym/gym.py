"""A Gymnasium environment over a deltagym sandbox.

    from deltagym.gym import SandboxEnv

    env = SandboxEnv(env="shell")
    obs, info = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("echo 42 > answer.txt")
    obs, reward, terminated, truncated, info = env.step("submit")
    env.close()

Actions are text: a shell command, run as `/bin/sh -c` (or in the persistent
bash session named by `session`), or "submit" / "submit <answer>", which ends
the episode and runs the verifier. Step info holds step_index, exit_code (commands) and components (submit);
the full StepResponse is env.last_response. Observations are the rendered text of the
result (stdout, stderr, a final "[exit N]" line for failures), cut to
max_observation_length and limited to printable ASCII plus whitespace (other
characters become "?"), so that they always lie in observation_space.
"""

from __future__ import annotations

import string
from typing import Any, Dict, List, Optional, SupportsFloat, Tuple, Union

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as e:  # the extra is not installed
    raise ImportError('deltagym.gym needs Gymnasium: pip install gymnasium, or install this client with '
                      'its extra, from the repository\'s root: pip install "./clients/python[gym]"') from e

from . import _common as c
from ._proto.deltagym.v1 import action_pb2, env_service_pb2 as es
from .actions import command, submit
from .client import Client, Sandbox

__all__ = ["SandboxEnv", "OBSERVATION_CHARSET"]

OBSERVATION_CHARSET = frozenset(string.printable)
# Random samples of the action space (as env checkers send) must be harmless
# commands: letters, digits and spaces.
ACTION_CHARSET = string.ascii_letters + string.digits + " "


class SandboxEnv(gymnasium.Env):
    """A gymnasium.Env whose episodes run in deltagym sandboxes.

    Args:
        env: the catalog name of the server env.
        client: a deltagym.Client to use; default one made from addr and token.
        addr, token: server address and bearer token when no client is given.
        session: name of the persistent bash session commands run in; "" runs
            each command in a fresh `/bin/sh -c`.
        submit_command: the action text that submits ("submit", or
            "submit <answer>"); None disables it.
        run, group_id: recorded with each episode in the ledger.
        reset_options: default Reset options, merged under reset(options=...).
        max_action_length, max_observation_length: bounds of the Text spaces.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        env: str = "shell",
        *,
        client: Optional[Client] = None,
        addr: Optional[str] = None,
        token: Optional[str] = None,
        session: str = "",
        submit_command: Optional[str] = "submit",
        run: str = "",
        group_id: str = "",
        reset_options: Optional[Dict[str, Any]] = None,
        max_action_length: int = 4096,
        max_observation_length: int = 16384,
        render_mode: Optional[str] = None,
        _sandbox: Optional[Sandbox] = None,
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
        self.action_space = spaces.Text(max_length=max_action_length, min_length=1, charset=ACTION_CHARSET)
        self.observation_space = spaces.Text(max_length=max_observation_length, min_length=0,
                                             charset="".join(sorted(OBSERVATION_CHARSET)))
        self.sandbox: Optional[Sandbox] = _sandbox
        self._last_obs = ""
        self.last_response: Optional[es.StepResponse] = None

    # --- Gymnasium API --------------------------------------------------------

    def reset(self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
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
        info = {"sandbox_id": resp.sandbox_id, "episode_id": resp.episode_id,
                "checkpoint_id": resp.checkpoint_id, **dict(resp.info)}
        return obs, info

    def step(self, action: Union[str, action_pb2.Action]) -> Tuple[str, SupportsFloat, bool, bool, Dict[str, Any]]:
        """Performs one action: a command, "submit [answer]", or an Action message."""
        sb = self._need_sandbox()
        resp = sb.step(self._action(action))
        obs = self._clip(c.observation_text(resp.observation))
        self._last_obs = obs
        self.last_response = resp
        # Step info holds only what the same seed and actions reproduce (the
        # env checker compares it); IDs and timings are on last_response.
        info: Dict[str, Any] = {"step_index": resp.step_index}
        if resp.observation.WhichOneof("kind") == "exec":
            info["exit_code"] = resp.observation.exec.exit_code
        if resp.observation.WhichOneof("kind") == "submit":
            info["components"] = dict(resp.observation.submit.components)
        if resp.observation.HasField("error"):
            info["error"] = resp.observation.error.errno_name
        return obs, float(resp.reward), bool(resp.terminated), bool(resp.truncated), info

    def render(self) -> Optional[str]:
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
        return self._need_sandbox().checkpoint(durable=durable).checkpoint_id

    def restore(self, checkpoint_id: str) -> Dict[str, Any]:
        """Puts the sandbox back at a checkpoint (a new episode starts there)."""
        r = self._need_sandbox().restore(checkpoint_id)
        return {"episode_id": r.episode_id, "next_step_index": r.next_step_index}

    def fork(self, n: int, *, group_id: str = "", fresh_entropy: bool = False) -> List["SandboxEnv"]:
        """Returns n new envs, each in its own sandbox at this env's current
        state, sharing this env's client. Close each when done."""
        kids = self._need_sandbox().fork(n, group_id=group_id, run=self.run, fresh_entropy=fresh_entropy)
        out = []
        for k in kids:
            e = SandboxEnv(self.env_name, client=self.client, session=self.session, submit_command=self.submit_command,
                           run=self.run, group_id=group_id or self.group_id, reset_options=self.reset_options,
                           max_action_length=self.max_action_length,
                           max_observation_length=self.max_observation_length,
                           render_mode=self.render_mode, _sandbox=k)
            e._last_obs = self._last_obs
            out.append(e)
        return out

    def evaluate(self) -> float:
        """Runs the verifier on the current state without ending the episode."""
        return self._need_sandbox().evaluate().reward

    # --- helpers --------------------------------------------------------------

    def _need_sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("SandboxEnv: call reset() first")
        return self.sandbox

    def _drop_sandbox(self) -> None:
        if self.sandbox is not None:
            sb, self.sandbox = self.sandbox, None
            sb.close()

    def _action(self, action: Union[str, action_pb2.Action]) -> action_pb2.Action:
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

    def _clip(self, text: str) -> str:
        text = "".join(ch if ch in OBSERVATION_CHARSET else "?" for ch in text)
        return text[: self.max_observation_length]
