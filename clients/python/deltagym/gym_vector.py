"""A Gymnasium vector env stepping many deltagym sandboxes concurrently.

    import gymnasium, deltagym.gym

    envs = gymnasium.make_vec("deltagym/shell-v0", num_envs=8, vectorization_mode="vector_entry_point")
    obs, infos = envs.reset(seed=0)                  # 8 resets, concurrently
    obs, rewards, terminated, truncated, infos = envs.step(["echo hi"] * 8)
    envs.close()

step() sends the actions of all sub-envs on one StepStream, so the server
runs them concurrently and one round trip carries the batch. Observations
are a tuple of str (the batch of SandboxEnv's Text space); rewards, terminated
and truncated are NumPy arrays; infos are batched by Gymnasium's rules
(each key an array, with a "_key" mask of the sub-envs that set it).

Autoreset is next-step (metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP):
the step after a sub-env terminated or truncated ignores that sub-env's
action, closes its sandbox and resets it in a new one, returning the reset
observation with reward 0, terminated and truncated False, and the reset's
info. The sandbox of an ended episode stays open until then, so the episode
can still be inspected (envs.envs[i].sandbox).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

try:
    import numpy as np
    from gymnasium.vector import AutoresetMode, VectorEnv
    from gymnasium.vector.utils import batch_space
except ImportError as e:  # the extra is not installed
    raise ImportError(
        'deltagym.gym_vector needs Gymnasium: pip install "deltagym[gym]", or "./clients/python[gym]" from a checkout'
    ) from e

from . import _common as c
from .client import Client
from .errors import DeltagymError
from .gym import SandboxEnv

__all__ = ["SandboxVectorEnv"]

Obs = tuple[str, ...]


class SandboxVectorEnv(VectorEnv[Obs, Sequence[str], np.ndarray]):
    """num_envs SandboxEnvs sharing one client, reset and stepped together.

    Args:
        num_envs: how many sandboxes.
        env: the catalog name of the server env.
        client: a deltagym.Client to share (not closed by close()); default
            one made from addr and token, closed by close().
        kwargs: the other arguments of each SandboxEnv (session,
            submit_command, run, group_id, reset_options, max_action_length,
            max_observation_length).
    """

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}  # noqa: RUF012  # Gymnasium reads it per class

    def __init__(self, num_envs: int, env: str = "shell", *, client: Client | None = None, addr: str | None = None,
                 token: str | None = None, **kwargs: Any) -> None:
        if num_envs < 1:
            raise ValueError(f"SandboxVectorEnv needs num_envs >= 1, not {num_envs}")
        self.num_envs = num_envs
        self._own_client = client is None
        self.client = client or Client(addr, token=token)
        self.envs = [SandboxEnv(env, client=self.client, **kwargs) for _ in range(num_envs)]
        self.single_action_space = self.envs[0].action_space
        self.single_observation_space = self.envs[0].observation_space
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self._pool = ThreadPoolExecutor(max_workers=min(num_envs, 64), thread_name_prefix="deltagym-vector")
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)

    def reset(self, *, seed: int | Sequence[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Obs, dict[str, Any]]:
        """Resets every sub-env in a new sandbox, concurrently. seed: one int
        (sub-env i gets seed + i), a seed per sub-env, or None."""
        if seed is None or isinstance(seed, int):
            super().reset(seed=seed)
            seeds: list[int | None] = [None if seed is None else seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"reset got {len(seeds)} seeds for {self.num_envs} envs")
        results = list(self._pool.map(lambda i: self.envs[i].reset(seed=seeds[i], options=options),
                                      range(self.num_envs)))
        self._autoreset[:] = False
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        return tuple(obs for obs, _ in results), infos

    def step(self, actions: Sequence[str]) -> tuple[Obs, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Steps every sub-env with its action, concurrently on one StepStream;
        sub-envs whose episode ended at the previous step reset instead."""
        actions = list(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"step got {len(actions)} actions for {self.num_envs} envs")
        resetting = [i for i in range(self.num_envs) if self._autoreset[i]]
        stepping = [i for i in range(self.num_envs) if not self._autoreset[i]]
        if any(not self.envs[i].sandbox_id for i in stepping):
            raise RuntimeError("SandboxVectorEnv: call reset() first")
        # Every action is parsed before anything is sent, so a bad one changes nothing.
        reqs = [c.step_request(self.envs[i].sandbox_id, self.envs[i].action(actions[i]), False) for i in stepping]
        resets = [(i, self._pool.submit(self.envs[i].reset)) for i in resetting]
        responses = self.client.step_stream(reqs) if reqs else []

        obs: list[str] = [""] * self.num_envs
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, fut in resets:
            obs[i], info = fut.result()
            infos = self._add_info(infos, info, i)
        for i, resp in zip(stepping, responses, strict=True):
            if isinstance(resp, DeltagymError):
                raise resp
            obs[i], rewards[i], terminated[i], truncated[i], info = self.envs[i].apply(resp)
            infos = self._add_info(infos, info, i)
        self._autoreset = terminated | truncated
        return tuple(obs), rewards, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        """Closes every sandbox concurrently, then the client when the vector
        env made it."""
        try:
            list(self._pool.map(lambda e: e.close(), self.envs))
        finally:
            self._pool.shutdown(wait=True)
            if self._own_client:
                self.client.close()
