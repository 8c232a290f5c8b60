"""deltagym.integrations.skyrl: the "deltagym" SkyRL-Gym env made by
skyrl_gym.make and run for whole episodes against a real server."""

from __future__ import annotations

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (make python-integrations-test)")

from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402

from deltagym import FailedPrecondition, NotFound  # noqa: E402
from deltagym.integrations.skyrl import INSTRUCTIONS, DeltagymTextEnv  # noqa: E402

from .doc_examples import run_example  # noqa: E402

PROMPT = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Solve the task."}]


def test_episode_to_the_verifiers_reward(server, client):
    env = skyrl_gym.make("deltagym", env_config={"addr": server.addr},
                         extras={"seed": 3, "options": {"WHO": "skyrl"}, "max_turns": 5})
    try:
        assert isinstance(env, DeltagymTextEnv) and isinstance(env, BaseTextEnv)
        prompt, meta = env.init(PROMPT)
        assert prompt[0] == PROMPT[0] and PROMPT[1]["content"] == "Solve the task."  # the input is not changed
        last = prompt[-1]["content"]
        assert last.startswith("Solve the task.\n\nWrite 42") and "seed=3 who=skyrl" in last and last.endswith(INSTRUCTIONS)
        assert meta["sandbox_id"] and meta["episode_id"]

        out = env.step("Let me look.\n<bash>echo $((6 * 7)) > /work/answer.txt; cat /work/answer.txt</bash>\nDone?")
        assert out["observations"] == [{"role": "user", "content": "42\n"}] and out["reward"] == 0.0
        assert not out["done"] and out["postprocessed_action"].endswith("</bash>")
        assert out["metadata"]["exit_code"] == 0

        out = env.step("I will think first.")
        assert not out["done"] and out["observations"][0]["content"].startswith("No action found.")

        out = env.step("<bash>cat /nope</bash>")
        assert out["observations"][0]["content"].endswith("[exit 1]\n") and out["metadata"]["exit_code"] == 1

        out = env.step("The answer is in place. <submit></submit> <bash>rm /work/answer.txt</bash>")
        assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
        assert out["metadata"]["components"] == {"correct": 1.0}
        assert out["postprocessed_action"] == "The answer is in place. <submit></submit>"
        assert env.get_metrics() == {"turns": 4, "commands": 2, "failed_commands": 1, "reward": 1.0}
        with pytest.raises(RuntimeError, match="ended"):
            env.step("<bash>true</bash>")
        sid = meta["sandbox_id"]
    finally:
        env.close()
    env.close()  # twice is fine
    assert env.client._closed  # the env made its client
    with pytest.raises((NotFound, FailedPrecondition)):
        client.get_sandbox(sid)


def test_last_turn_submits(server, client):
    env = skyrl_gym.make("deltagym", env_config={"client": client, "instructions": False},
                         extras={"max_turns": 2})
    try:
        prompt, meta = env.init([{"role": "assistant", "content": "hi"}])
        assert prompt[-1]["role"] == "user" and INSTRUCTIONS not in prompt[-1]["content"]
        assert not env.step("<bash>echo 41 > /work/answer.txt</bash>")["done"]
        out = env.step("<bash>cat /work/answer.txt</bash>")
        assert out["done"] and out["reward"] == 0.0 and out["metadata"]["action"] == "bash"
        ep = env.sandbox.episode_id
    finally:
        env.close()
    assert not client._closed  # a shared client stays open
    with pytest.raises((NotFound, FailedPrecondition)):
        client.get_sandbox(meta["sandbox_id"])
    if server.ledger:  # the last turn's submit ended the episode, with the verifier's reward
        tr = client.get_trajectory(ep)
        assert tr.episode.step_count == 3 and tr.episode.total_reward == 0.0


def test_bad_extras_are_refused(server, client):
    for extras, err in (({"seed": "1"}, TypeError), ({"options": ["A"]}, TypeError), ({"max_turns": 0}, ValueError)):
        with pytest.raises(err):
            skyrl_gym.make("deltagym", env_config={"client": client}, extras=extras)
    env = skyrl_gym.make("deltagym", env_config={"client": client})
    with pytest.raises(RuntimeError, match="init"):
        env.step("<bash>true</bash>")
    env.close()


def test_docs_example(server, monkeypatch):
    monkeypatch.setenv("DELTAGYM_ADDR", server.addr)
    ns = run_example("skyrl.md")
    assert "seed=7" in ns["prompt"][-1]["content"] and ns["env"].get_metrics()["reward"] == 1.0


def test_env_config_from_a_training_config(server):
    # SkyRL hands the env its section of the Hydra config, an OmegaConf DictConfig.
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"addr": server.addr, "session": "agent", "max_output_chars": 16})
    env = skyrl_gym.make("deltagym", env_config=cfg, extras={"max_turns": 4})
    try:
        env.init([{"role": "user", "content": "Go."}])
        env.step("<bash>cd /tmp</bash>")
        out = env.step("<bash>pwd; seq 1 20</bash>")
        assert out["observations"][0]["content"] == "/tmp\n1\n2\n3\n4\n5\n6\n[cut at 16 characters]\n"
        nudge = env.step("I am thinking about it.")  # the format's reminder is never cut
        assert nudge["observations"][0]["content"] == "No action found. " + INSTRUCTIONS and not nudge["done"]
    finally:
        env.close()
