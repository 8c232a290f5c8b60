"""A deltagym sandbox as a SkyRL-Gym text env, registered as "deltagym".

    import skyrl_gym
    import deltagym.integrations.skyrl  # registers "deltagym"

    env = skyrl_gym.make("deltagym", env_config={"addr": "127.0.0.1:8080"},
                         extras={"env": "shell", "seed": 1, "max_turns": 8})
    prompt, metadata = env.init([{"role": "user", "content": "Solve the task."}])
    out = env.step("<bash>echo 42 > /work/answer.txt</bash>")
    out = env.step("<submit></submit>")      # out["done"], out["reward"] == 1.0
    env.close()

In SkyRL's generator an env is made per trajectory with env_config (the
env's section of the training config: addr, token, session, command_timeout,
max_output_chars, instructions) and extras (the dataset row's fields: env,
seed, options, max_turns). init() leases a sandbox by Reset and appends the
task, the reset hook's output and, unless instructions is false, how to act,
to the prompt's last user message. Each step() reads the first action tag of
the model's text:

    <bash>COMMAND</bash>       runs COMMAND; its output is the next user message
    <submit>ANSWER</submit>    (or <submit/>) submits; the episode ends with
                               the verifier's reward

Text without a tag gets a reminder of the format. The turn that reaches
max_turns without a submit submits, so every trajectory ends with the
verifier's reward (an episode that ran out of its env's budget is graded as
it stands). postprocessed_action is the text up to the end of the tag read,
so what the model wrote past its action is not kept in the trajectory.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from skyrl_gym.envs.registration import register, registry  # type: ignore[import-untyped, import-not-found, unused-ignore]
except ImportError as e:  # the extra is not installed
    raise ImportError(
        'deltagym.integrations.skyrl needs SkyRL-Gym: pip install "deltagym[skyrl]", or "./clients/python[skyrl]" from a checkout'
    ) from e

from deltagym import _common as c
from deltagym.client import Client, SandboxHandle

# The low-level handle, not deltagym.Sandbox: the model reads what the
# server observed, rendered as observation_text does, and a Reset's text
# includes the reset hook's output (an env may state its question there),
# which Sandbox.task leaves out.

__all__ = ["ENV_ID", "INSTRUCTIONS", "DeltagymTextEnv", "register_env"]

ENV_ID = "deltagym"

INSTRUCTIONS = (
    "Act in the sandbox one step per turn. To run a shell command, write <bash>COMMAND</bash>; its output is "
    "the reply. When done, write <submit></submit> (or <submit>ANSWER</submit>) to be graded; that ends the task."
)

# The first action tag of a model's text: a bash command or a submit.
_ACTION = re.compile(r"<bash>(?P<cmd>.*?)</bash>|<submit\s*/>|<submit>(?P<answer>.*?)</submit>", re.DOTALL)

Message = dict[str, str]


def _get(cfg: Any, key: str, default: Any) -> Any:
    """cfg[key] for a dict or an OmegaConf DictConfig; default when absent or None."""
    if cfg is None:
        return default
    v = cfg.get(key, default)
    return default if v is None else v


class DeltagymTextEnv(BaseTextEnv):  # type: ignore[misc]  # skyrl_gym has no type hints
    """One trajectory in a deltagym sandbox (see the module doc).

    Args:
        env_config: addr, token (default: as Client resolves them), client
            (a deltagym.Client to share instead; not closed by close()),
            session ("" runs each command in a fresh `/bin/sh -c`),
            command_timeout (seconds; 0 means the env's), max_output_chars
            (default 8192), instructions (default true), env (default "shell").
        extras: the row's env (overrides env_config's), seed, options,
            max_turns (default 16), run and group_id (recorded in the ledger).
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        self.env_name = str(_get(extras, "env", _get(env_config, "env", "shell")))
        self.seed = extras.get("seed")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"extras' seed is an int, not {type(self.seed).__name__}")
        options = extras.get("options") or {}
        if not hasattr(options, "items"):
            raise TypeError(f"extras' options are a mapping of names to values, not {type(options).__name__}")
        self.options = {str(k): str(v) for k, v in options.items()}
        self.max_turns = int(_get(extras, "max_turns", 16))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, not {self.max_turns}")
        self.run = str(_get(extras, "run", ""))
        self.group_id = str(_get(extras, "group_id", ""))
        self.session = str(_get(env_config, "session", ""))
        self.command_timeout = float(_get(env_config, "command_timeout", 0))
        self.max_output_chars = int(_get(env_config, "max_output_chars", 8192))
        self.instructions = bool(_get(env_config, "instructions", True))
        client = _get(env_config, "client", None)
        self._own_client = client is None
        self.client: Client = client or Client(_get(env_config, "addr", None), token=_get(env_config, "token", None))
        self.sandbox: SandboxHandle | None = None
        self.reward = 0.0
        self.commands = 0
        self.failed_commands = 0
        self.done = False

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """Leases a sandbox and starts the episode; returns the prompt with
        the task appended to its last user message, and the sandbox's IDs."""
        if self.sandbox is not None:
            raise RuntimeError("DeltagymTextEnv.init: the env has its episode already; make a new env")
        self.sandbox = self.client.reset(self.env_name, seed=self.seed, options=self.options, run=self.run,
                                         group_id=self.group_id)
        assert self.sandbox.reset_response is not None
        text = c.observation_text(self.sandbox.reset_response.observation).rstrip("\n")
        if self.instructions:
            text += "\n\n" + INSTRUCTIONS
        prompt = [dict(m) for m in prompt]
        if prompt and prompt[-1].get("role") == "user":
            prompt[-1]["content"] = (prompt[-1].get("content") or "") + "\n\n" + text
        else:
            prompt.append({"role": "user", "content": text})
        return prompt, {"sandbox_id": self.sandbox.id, "episode_id": self.sandbox.episode_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Performs the first action tag of the model's text (see the module doc)."""
        sb = self._need_sandbox()
        if self.done:
            raise RuntimeError("DeltagymTextEnv.step: the episode has ended")
        self.turns += 1
        m = _ACTION.search(action)
        if m is None:
            return self._out("", action, {"action": "none"}, reminder="No action found. " + INSTRUCTIONS)
        kept = action[: m.end()]
        if m.group("cmd") is None:
            return self._submit(sb, m.group("answer") or None, kept)
        resp = sb.exec(m.group("cmd"), session=self.session, timeout=self.command_timeout)
        self.commands += 1
        obs = resp.observation
        ok = obs.WhichOneof("kind") == "exec" and obs.exec.exit_code == 0 and not obs.exec.timed_out
        self.failed_commands += 0 if ok else 1
        meta: dict[str, Any] = {"action": "bash", "step_index": int(resp.step_index)}
        if obs.WhichOneof("kind") == "exec":
            meta["exit_code"] = int(obs.exec.exit_code)
        if resp.truncated:  # the env's budget ran out: grade the state as it stands
            self.done = True
            self.reward = float(sb.evaluate().reward)
            return BaseTextEnvStepOutput(observations=[], reward=self.reward, done=True, metadata=meta,
                                         postprocessed_action=kept)
        return self._out(c.observation_text(obs) or "(no output)", kept, meta)

    def close(self) -> None:
        """Closes the sandbox (and the client, when the env made it). Idempotent."""
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            sb.close()
        if self._own_client:
            self.client.close()

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "commands": self.commands, "failed_commands": self.failed_commands,
                "reward": self.reward}

    # --- helpers --------------------------------------------------------------

    def _need_sandbox(self) -> SandboxHandle:
        if self.sandbox is None:
            raise RuntimeError("DeltagymTextEnv: call init() first")
        return self.sandbox

    def _submit(self, sb: SandboxHandle, answer: str | None, kept: str) -> BaseTextEnvStepOutput:
        resp = sb.submit(answer)
        self.done = True
        self.reward = float(resp.reward)
        meta = {"action": "submit", "components": {k: float(v) for k, v in resp.observation.submit.components.items()}}
        return BaseTextEnvStepOutput(observations=[], reward=self.reward, done=True, metadata=meta,
                                     postprocessed_action=kept)

    def _out(self, text: str, kept: str, meta: dict[str, Any], reminder: str = "") -> BaseTextEnvStepOutput:
        """The turn's observation: text (what the sandbox gave) cut at
        max_output_chars, then reminder (of the format) whole."""
        if self.turns >= self.max_turns:  # the last turn: grade what is there
            out = self._submit(self._need_sandbox(), None, kept)
            out["metadata"] = {**meta, **out["metadata"], "action": meta["action"]}
            return out
        n = self.max_output_chars
        if len(text) > n:
            text = text[:n] + f"\n[cut at {n} characters]\n"
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": text + reminder}], reward=0.0,
                                     done=False, metadata=meta, postprocessed_action=kept)


def register_env(env_id: str = ENV_ID, **kwargs: Any) -> None:
    """Registers DeltagymTextEnv with skyrl_gym under env_id; kwargs are
    default constructor arguments (env_config, extras). The entry point is
    the class's import path, so Ray workers that import it can make it."""
    register(id=env_id, entry_point=f"{__name__}:DeltagymTextEnv", kwargs=kwargs)


if ENV_ID not in registry:
    register_env()
