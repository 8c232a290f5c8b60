"""deltagym sandboxes as TRL environments: GRPOTrainer(environment_factory=...).

    from trl import GRPOConfig, GRPOTrainer
    from deltagym.integrations.trl import environment_factory

    factory = environment_factory("shell", num_generations=8, run="grpo-1")
    trainer = GRPOTrainer(model=..., train_dataset=dataset, environment_factory=factory,
                          args=GRPOConfig(num_generations=8, ...))
    trainer.train()
    factory.close()

TRL calls the factory once with no arguments to probe the environment (the
instance leases nothing until its first reset), lists the public methods of
its class as tools (their type hints and docstrings become the tool schemas,
through transformers.utils.get_json_schema), and keeps a pool of instances
that it resets with each dataset row, one instance per rollout, across
batches. SandboxEnvironment's only public methods are reset, the tools bash,
write_file, read_file and submit, and get_reward, which TRL calls once per
finished rollout as the environment's reward.

A GRPO group is the same row repeated num_generations times in a row (TRL's
RepeatSampler order). The first reset of a group leases one sandbox by Reset
under a new group_id; the others of the group are forks of that Reset's
checkpoint under the same group_id (one Fork call for the whole group when
num_generations is given), so the ledger sees one group and its advantages
(Client.get_group_advantages(group_id)). A row's "seed" (int) and "options"
(a mapping) go to Reset; its other fields, such as "prompt", only decide which
rows are the same.
"""

from __future__ import annotations

import json
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from deltagym import _common as c
from deltagym.client import Client, SandboxHandle

# The low-level handle, not deltagym.Sandbox: the model reads what the
# server observed, rendered as observation_text does, and a Reset's text
# includes the reset hook's output (an env may state its question there),
# which Sandbox.task leaves out.

__all__ = ["SandboxEnvironment", "SandboxEnvironmentFactory", "environment_factory"]


class SandboxEnvironmentFactory:
    """Makes SandboxEnvironments sharing one client and the group bookkeeping.

    Args:
        env: the catalog name of the server env.
        num_generations: GRPOConfig.num_generations (the group size); None
            forks each member of a group when it resets.
        client: a deltagym.Client to share (not closed by close()); default
            one made from addr and token, closed by close().
        run: recorded with each episode in the ledger.
        session: the persistent bash session bash() runs in; "" runs each
            command in a fresh `/bin/sh -c`.
        command_timeout: bash()'s timeout in seconds; 0 means the env's.
        max_output_chars: tool results are cut to this many characters.
    """

    def __init__(
        self,
        env: str = "shell",
        *,
        num_generations: int | None = None,
        client: Client | None = None,
        addr: str | None = None,
        token: str | None = None,
        run: str = "",
        session: str = "",
        command_timeout: float = 0,
        max_output_chars: int = 8192,
    ) -> None:
        if num_generations is not None and num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, not {num_generations}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be at least 1, not {max_output_chars}")
        self.env = env
        self.num_generations = num_generations
        self._own_client = client is None
        self.client = client or Client(addr, token=token)
        self.run = run
        self.session = session
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars
        self._lock = threading.Lock()
        # The current group: the row it is for, its ID, the Reset's
        # checkpoint and observation, how many members have it, and the
        # forked sandboxes no member has claimed yet.
        self._key: str | None = None  # +guarded by _lock
        self._group_id = ""
        self._checkpoint_id = ""
        self._observation = ""
        self._claimed = 0
        self._spare: list[SandboxHandle] = []
        self._instances: weakref.WeakSet[SandboxEnvironment] = weakref.WeakSet()
        self._closed = False

    def __call__(self) -> SandboxEnvironment:
        """A new environment instance; it leases nothing until reset."""
        if self._closed:
            raise RuntimeError("SandboxEnvironmentFactory is closed")
        e = SandboxEnvironment(self)
        with self._lock:
            self._instances.add(e)
        return e

    def close(self) -> None:
        """Closes every instance's sandbox and the spare forks, then the
        client when the factory made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            instances = list(self._instances)
            spare, self._spare = self._spare, []
        for e in instances:
            e._release()
        for sb in spare:
            sb.close()
        if self._own_client:
            self.client.close()

    def _claim(self, row: Mapping[str, Any]) -> tuple[SandboxHandle, str, str]:
        """A sandbox for a rollout of row, its reset observation and its
        group ID: a fork of the current group's checkpoint when row is the
        current group's and the group is not full, else a new group's Reset."""
        key = json.dumps(row, sort_keys=True, default=repr)
        seed, options = _reset_args(row)
        with self._lock:
            if self._closed:
                raise RuntimeError("SandboxEnvironmentFactory is closed")
            if key == self._key and (self.num_generations is None or self._claimed < self.num_generations):
                if self._spare:
                    sb = self._spare.pop(0)
                else:
                    sb = self.client.fork(checkpoint_id=self._checkpoint_id, n=1, group_id=self._group_id,
                                          run=self.run)[0]
                    sb.env = self.env
                self._claimed += 1
                return sb, self._observation, self._group_id
            spare, self._spare = self._spare, []
            self._key = None
            for old in spare:
                old.close()
            gid = uuid.uuid4().hex
            sb = self.client.reset(self.env, seed=seed, options=options, run=self.run, group_id=gid)
            assert sb.reset_response is not None
            self._key, self._group_id, self._checkpoint_id = key, gid, sb.start_checkpoint_id
            self._observation = c.observation_text(sb.reset_response.observation)
            self._claimed = 1
            if self.num_generations is not None and self.num_generations > 1:
                try:
                    self._spare = self.client.fork(checkpoint_id=sb.start_checkpoint_id,
                                                   n=self.num_generations - 1, group_id=gid, run=self.run)
                except BaseException:
                    self._key = None  # no group: the next reset starts one
                    sb.close()
                    raise
                for k in self._spare:
                    k.env = self.env
            return sb, self._observation, gid


def _reset_args(row: Mapping[str, Any]) -> tuple[int | None, dict[str, str] | None]:
    seed = row.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"a row's seed is an int, not {type(seed).__name__}")
    options = row.get("options")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"a row's options are a mapping of names to values, not {type(options).__name__}")
    return seed, (None if options is None else {str(k): str(v) for k, v in options.items()})


def environment_factory(env: str = "shell", **kwargs: Any) -> SandboxEnvironmentFactory:
    """A factory for GRPOTrainer(environment_factory=...); kwargs as
    SandboxEnvironmentFactory's. Close it when training is done."""
    return SandboxEnvironmentFactory(env, **kwargs)


class SandboxEnvironment:
    """One rollout's sandbox, with tools for the model.

    Made by a SandboxEnvironmentFactory; its public methods are what TRL
    uses: reset, the tools, get_reward. The current sandbox's IDs are
    properties (sandbox_id, episode_id, group_id)."""

    def __init__(self, factory: SandboxEnvironmentFactory) -> None:
        self._factory = factory
        self._sandbox: SandboxHandle | None = None
        self._group_id = ""
        self._reward: float | None = None
        self._truncated = False

    @property
    def sandbox_id(self) -> str:
        return self._sandbox.id if self._sandbox else ""

    @property
    def episode_id(self) -> str:
        return self._sandbox.episode_id if self._sandbox else ""

    @property
    def group_id(self) -> str:
        return self._group_id

    @property
    def start_checkpoint_id(self) -> str:
        return self._sandbox.start_checkpoint_id if self._sandbox else ""

    def reset(self, **row: Any) -> str:
        """Releases the previous rollout's sandbox and starts this row's
        episode; returns the task and the reset hook's output after a blank
        line ("" when there are none), which TRL appends to the row's last
        user message."""
        self._release()
        sb, observation, gid = self._factory._claim(row)
        self._sandbox, self._group_id = sb, gid
        return "\n\n" + observation.rstrip("\n") if observation.strip() else ""

    def bash(self, command: str) -> str:
        """Runs a shell command in the sandbox and returns its output.

        Args:
            command: The shell command to run, for example "ls -la" or "python3 main.py".

        Returns:
            The command's standard output and standard error, and its exit status when it failed.
        """
        f = self._factory
        return self._act(lambda sb: sb.exec(command, session=f.session, timeout=f.command_timeout))

    def write_file(self, path: str, content: str) -> str:
        """Writes a text file in the sandbox, replacing it if it exists.

        Args:
            path: The file's path, absolute or relative to the working directory.
            content: The text to write.

        Returns:
            How many bytes were written, or why the file could not be written.
        """
        return self._act(lambda sb: sb.write_file(path, content))

    def read_file(self, path: str) -> str:
        """Reads a text file in the sandbox.

        Args:
            path: The file's path, absolute or relative to the working directory.

        Returns:
            The file's content, or why it could not be read.
        """
        return self._act(lambda sb: sb.read_file(path))

    def submit(self, answer: str = "") -> str:
        """Submits the work done in the sandbox for grading; this ends the episode.

        Args:
            answer: A final answer, for tasks that ask for one.

        Returns:
            The grader's output.
        """
        sb = self._need_sandbox()
        resp = sb.submit(answer or None)
        self._reward = float(resp.reward)
        return self._clip(c.observation_text(resp.observation) or "submitted")

    def get_reward(self) -> float:
        """The rollout's reward: the verifier's at submit. A rollout that did
        not submit is submitted now (so its episode ends in the ledger); one
        that ran out of its env's budget is graded as it stands."""
        if self._reward is None:
            sb = self._need_sandbox()
            if self._truncated:
                self._reward = float(sb.evaluate().reward)
            else:
                self.submit()
        assert self._reward is not None
        return self._reward

    # --- helpers --------------------------------------------------------------

    def _need_sandbox(self) -> SandboxHandle:
        if self._sandbox is None:
            raise RuntimeError("SandboxEnvironment: reset() has not been called")
        return self._sandbox

    def _act(self, do: Callable[[SandboxHandle], Any]) -> str:
        sb = self._need_sandbox()
        if self._reward is not None or self._truncated:
            raise RuntimeError("the episode has ended; no more tool calls")
        resp = do(sb)
        self._truncated = bool(resp.truncated)
        return self._clip(c.observation_text(resp.observation))

    def _clip(self, text: str) -> str:
        n = self._factory.max_output_chars
        return text if len(text) <= n else text[:n] + f"\n[cut at {n} characters]\n"

    def _release(self) -> None:
        sb, self._sandbox = self._sandbox, None
        self._reward, self._truncated, self._group_id = None, False, ""
        if sb is not None:
            sb.close()
