"""The Gymnasium env and its registration against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

gymnasium = pytest.importorskip("gymnasium", reason="deltagym.gym needs gymnasium (the [gym] extra)")

from gymnasium.utils.env_checker import check_env  # noqa: E402

import deltagym  # noqa: E402
from deltagym.gym import (  # noqa: E402
    BUILTIN_ENVS,
    SAMPLE_COMMANDS,
    SandboxEnv,
    ShellCommandSpace,
    register_envs,
)

from .doc_examples import run_example  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _numeric(info: dict) -> bool:
    return all(type(v) in (int, float, bool) or (isinstance(v, dict) and _numeric(v)) for v in info.values())


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
        assert "seed=9 who=gym" in obs and env.sandbox_id and env.episode_id and env.start_checkpoint_id
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
        before = env.episode_id
        env.restore(ck)
        assert env.episode_id != before
        assert env.evaluate() == 0.0
        obs, reward, terminated, truncated, _ = env.step("submit")
        assert terminated and reward == 0.0
        obs, _ = env.reset(seed=9, options={"WHO": "gym"})
        assert "seed=9" in obs
    finally:
        env.close()


def test_info_values_are_numbers(server):
    env = SandboxEnv(env="shell", addr=server.addr)
    try:
        _, info = env.reset(seed=1)
        assert _numeric(info)
        infos = [env.step(a)[4] for a in ("echo hi", "sh -c 'exit 7'", "sleep 30 & kill -9 $!; wait $!", "submit")]
        assert all(_numeric(i) for i in infos), infos
        assert infos[0]["exit_code"] == 0 and infos[0]["timed_out"] is False and infos[0]["step_index"] >= 0
        assert infos[1]["exit_code"] == 7
        assert type(infos[0]["steps_left"]) is int and infos[1]["step_index"] == infos[0]["step_index"] + 1
        assert infos[3]["components"] == {"correct": 0.0}
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


def test_action_space_samples_are_varied_valid_commands(server):
    space = ShellCommandSpace()
    space.seed(7)
    first = [space.sample() for _ in range(40)]
    space.seed(7)
    assert [space.sample() for _ in range(40)] == first
    assert len(set(first)) >= 10 and all(space.contains(a) for a in first)
    assert space.contains("cat <<'EOF' | grep -c x\nx\nEOF") and not space.contains("caf\u00e9")
    with pytest.raises(ValueError, match="not in the space"):
        SandboxEnv(env="shell", addr=server.addr, sample_commands=["echo caf\u00e9"])
    env = SandboxEnv(env="shell", addr=server.addr, sample_commands=["echo a", "echo b"])
    assert {env.action_space.sample() for _ in range(20)} == {"echo a", "echo b"}
    env.close()
    env = SandboxEnv(env="shell", addr=server.addr)
    try:
        env.reset()
        for cmd in SAMPLE_COMMANDS:
            obs, _, terminated, truncated, info = env.step(cmd)
            # Each runs (no "not found", no syntax error) and leaves the episode going.
            assert info["exit_code"] not in (2, 126, 127) and not info["timed_out"], (cmd, obs)
            assert not terminated and not truncated and "not found" not in obs, (cmd, obs)
        assert env.evaluate() == 0.0
    finally:
        env.close()


def test_import_deltagym_registers_builtin_envs():
    # A fresh interpreter: nothing but `import deltagym` has run.
    code = "import deltagym, gymnasium; s = gymnasium.spec('deltagym/shell-v0'); print(s.entry_point, s.vector_entry_point)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["deltagym.gym:SandboxEnv", "deltagym.gym_vector:SandboxVectorEnv"]


def test_builtin_envs_are_the_repository_catalog():
    names = sorted(json.loads(p.read_text())["name"] for p in (REPO / "envs").glob("*.json"))
    assert sorted(BUILTIN_ENVS) == names
    for n in names:
        assert gymnasium.spec(f"deltagym/{n}-v0").kwargs == {"env": n}


def test_make_builtin_id(server):
    env = gymnasium.make("deltagym/shell-v0", addr=server.addr, max_observation_length=256)
    try:
        assert isinstance(env.unwrapped, SandboxEnv) and isinstance(env.unwrapped, gymnasium.Env)
        obs, _ = env.reset(seed=4)
        assert "seed=4" in obs
        obs, *_ = env.step("echo $((6 * 7))")
        assert obs == "42\n"
    finally:
        env.close()


def test_register_envs_uses_the_client(server, client):
    ids = register_envs(client)
    try:
        # Other tests may have added envs to the server's catalog.
        assert ids == [f"deltagym/{e.spec.name}-v0" for e in client.list_envs()] and "deltagym/shell-v0" in ids
        env = gymnasium.make("deltagym/shell-v0")
        try:
            assert env.unwrapped.client is client
            env.reset()
            _, _, _, _, info = env.step("true")
            assert info["exit_code"] == 0
        finally:
            env.close()
        assert not client._closed  # the env does not own a client it was given
    finally:
        for gid in ids:
            gymnasium.registry.pop(gid)
        assert deltagym.gym.register_builtin_envs() == ["deltagym/shell-v0"]
    assert gymnasium.spec("deltagym/shell-v0").entry_point == "deltagym.gym:SandboxEnv"


def test_docs_example(server, monkeypatch):
    monkeypatch.setenv("DELTAGYM_ADDR", server.addr)
    ns = run_example("gymnasium.md")
    assert ns["env"].unwrapped.client._closed and ns["envs"].client._closed
