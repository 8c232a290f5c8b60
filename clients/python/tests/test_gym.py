"""The Gymnasium env against a real server."""

from __future__ import annotations

import gymnasium
from gymnasium.utils.env_checker import check_env

from deltagym.gym import SandboxEnv


def test_check_env(server):
    env = SandboxEnv(env="shell", addr=server.addr)
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_episode_checkpoint_restore_fork(server):
    env = SandboxEnv(env="shell", addr=server.addr, session="agent", render_mode="ansi")
    try:
        obs, info = env.reset(seed=9, options={"WHO": "gym"})
        assert env.observation_space.contains(obs)
        assert "seed=9 who=gym" in obs and info["sandbox_id"] and info["episode_id"]
        obs, reward, terminated, truncated, info = env.step("cd /tmp; X=5")
        assert (obs, reward, terminated, truncated) == ("", 0.0, False, False)
        obs, *_ = env.step("echo $X $(pwd)")
        assert obs == "5 /tmp\n" and env.render() == obs
        obs, _, _, _, info = env.step("cat /nope")
        assert info["exit_code"] == 1 and obs.endswith("[exit 1]\n")
        ck = env.checkpoint()
        env.step("echo 42 > /work/answer.txt")
        assert env.evaluate() == 1.0
        kids = env.fork(2)
        try:
            for k in kids:
                obs, reward, terminated, truncated, info = k.step("submit")
                assert terminated and reward == 1.0 and info["components"] == {"correct": 1.0}
        finally:
            for k in kids:
                k.close()
        env.restore(ck)
        assert env.evaluate() == 0.0
        obs, reward, terminated, truncated, _ = env.step("submit")
        assert terminated and reward == 0.0
        obs, _ = env.reset(seed=9, options={"WHO": "gym"})
        assert "seed=9" in obs
    finally:
        env.close()


def test_observation_is_clipped_to_space(server):
    env = SandboxEnv(env="shell", addr=server.addr, max_observation_length=64)
    try:
        env.reset()
        obs, *_ = env.step("printf '\\303\\251'; yes | head -c 500")
        assert len(obs) == 64 and obs.startswith("?y\n") and env.observation_space.contains(obs)
    finally:
        env.close()


def test_is_a_gymnasium_env(server):
    env = SandboxEnv(addr=server.addr)
    assert isinstance(env, gymnasium.Env)
    env.close()
