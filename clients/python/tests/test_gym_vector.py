"""The vector env over many sandboxes against a real server."""

from __future__ import annotations

import time

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium", reason="deltagym.gym needs gymnasium (the [gym] extra)")

from gymnasium.vector import AutoresetMode  # noqa: E402

from deltagym.gym import SandboxEnv  # noqa: E402
from deltagym.gym_vector import SandboxVectorEnv  # noqa: E402


def test_make_vec_steps_and_autoresets_next_step(server):
    envs = gymnasium.make_vec("deltagym/shell-v0", num_envs=3, vectorization_mode="vector_entry_point",
                              addr=server.addr)
    try:
        assert isinstance(envs, SandboxVectorEnv) and envs.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
        obs, infos = envs.reset(seed=5)
        assert [o.splitlines()[-1] for o in obs] == ["seed=5 who=nobody", "seed=6 who=nobody", "seed=7 who=nobody"]
        assert envs.observation_space.contains(obs)
        first = [e.sandbox_id for e in envs.envs]
        assert len(set(first)) == 3

        obs, rewards, terminated, truncated, infos = envs.step(
            ["echo 42 > /work/answer.txt; echo zero", "echo one", "sh -c 'exit 3'"])
        assert obs == ("zero\n", "one\n", "[exit 3]\n")
        assert infos["exit_code"].tolist() == [0, 0, 3] and infos["_exit_code"].all()
        assert infos["exit_code"].dtype.kind == "i"

        obs, rewards, terminated, truncated, infos = envs.step(["submit", "submit", "echo two"])
        assert rewards.tolist() == [1.0, 0.0, 0.0] and terminated.tolist() == [True, True, False]
        assert not truncated.any() and obs[2] == "two\n"
        assert infos["_components"].tolist() == [True, True, False]
        assert infos["components"]["correct"].tolist() == [1.0, 0.0, 0.0]

        # Next-step autoreset: the ended sub-envs ignore their actions and
        # start over in new sandboxes; the other one steps.
        obs, rewards, terminated, truncated, infos = envs.step(["submit", "submit", "echo three"])
        assert [o.splitlines()[-1] for o in obs[:2]] == ["seed=none who=nobody"] * 2 and obs[2] == "three\n"
        assert rewards.tolist() == [0.0, 0.0, 0.0] and not terminated.any()
        assert infos["_exit_code"].tolist() == [False, False, True]
        now = [e.sandbox_id for e in envs.envs]
        assert now[0] not in first and now[1] not in first and now[2] == first[2]
        obs, *_ = envs.step(["cat /work/answer.txt", "echo again", "echo four"])
        assert obs == ("cat: can't open '/work/answer.txt': No such file or directory\n[exit 1]\n", "again\n", "four\n")
    finally:
        envs.close()
    assert envs.client._closed  # the vector env made its client, so it closed it


def test_steps_run_concurrently(server):
    n, seconds = 3, 1.0
    envs = SandboxVectorEnv(n, addr=server.addr)
    try:
        envs.reset()
        obs, *_ = envs.step([f"sleep {seconds}; echo {i}" for i in range(n)])
        assert obs == tuple(f"{i}\n" for i in range(n))
        # The server's own record of when each step ran: one after another,
        # no step would begin before the one before it ended; together,
        # every step begins before any ends, however loaded the machine.
        spans = []
        for e in envs.envs:
            step = _last_step(envs.client, e.episode_id)
            begin = step.start_time.ToNanoseconds() / 1e9
            spans.append((begin, begin + step.duration_seconds))
        assert max(b for b, _ in spans) < min(end for _, end in spans), spans
    finally:
        envs.close()


def _last_step(client, episode_id, timeout=60.0):
    """The episode's last step once the ledger, which writes behind the
    steps, has it."""
    deadline = time.monotonic() + timeout
    while True:
        steps = client.get_trajectory(episode_id).steps
        if steps and steps[-1].action.exec.command.startswith("sleep"):
            return steps[-1]
        assert time.monotonic() < deadline, f"the ledger has no step of episode {episode_id}"
        time.sleep(0.05)


def test_bad_input_changes_nothing(server, client):
    envs = SandboxVectorEnv(2, client=client)
    try:
        with pytest.raises(RuntimeError, match="reset"):
            envs.step(["true", "true"])
        envs.reset(seed=[1, None])
        with pytest.raises(ValueError, match="2 envs"):
            envs.step(["true"])
        with pytest.raises(ValueError, match="2 envs"):
            envs.reset(seed=[1, 2, 3])
        with pytest.raises(TypeError, match="str"):
            envs.step(["echo x > /work/answer.txt", 7])  # type: ignore[list-item]
        obs, *_ = envs.step(["cat /work/answer.txt 2>/dev/null; echo done", "echo done"])
        assert obs == ("done\n", "done\n")  # the first action was not sent
    finally:
        envs.close()
    assert not client._closed
    with pytest.raises(ValueError):
        SandboxVectorEnv(0, client=client)


def test_sub_envs_are_sandbox_envs(server, client):
    envs = SandboxVectorEnv(2, client=client, max_observation_length=8)
    try:
        obs, _ = envs.reset()
        assert all(isinstance(e, SandboxEnv) for e in envs.envs) and all(len(o) <= 8 for o in obs)
        actions = envs.action_space.sample()
        assert len(actions) == 2 and envs.action_space.contains(actions)
        _, rewards, *_ = envs.step(actions)
        assert isinstance(rewards, np.ndarray) and rewards.shape == (2,)
    finally:
        envs.close()
