"""deltagym.integrations.trl used as TRL's GRPOTrainer uses an environment_factory:
probe one instance, turn its public methods into tool schemas with
transformers.utils.get_json_schema, reset a pool of instances with a batch of
rows in RepeatSampler order, call tools by name with keyword arguments, score
each rollout with get_reward, and reuse the instances for the next batch."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

transformers_utils = pytest.importorskip("transformers.utils", reason="needs transformers (make python-integrations-test)")

from deltagym import DeltagymError, FailedPrecondition, NotFound  # noqa: E402
from deltagym.integrations.trl import SandboxEnvironment, environment_factory  # noqa: E402

from .doc_examples import run_example  # noqa: E402

TOOLS = {"bash", "write_file", "read_file", "submit"}


def _members(env: object) -> list[str]:
    # What GRPOTrainer lists: functions of the class, not of the instance.
    return [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)]


def _tool_dict(env: object) -> dict[str, Any]:
    return {n: getattr(env, n) for n in _members(env) if n not in ("reset", "get_reward") and not n.startswith("_")}


def _batch(rows: list[dict[str, Any]], g: int) -> list[dict[str, Any]]:
    # RepeatSampler: each row num_generations times in a row.
    return [dict(r) for r in rows for _ in range(g)]


def _live(client, run: str) -> set[str]:
    return {s.sandbox_id for s in client.list_sandboxes(run=run)}


def test_probe_leases_nothing_and_exposes_the_tools(server, client):
    factory = environment_factory("shell", client=client, run="trl-probe")
    try:
        env = factory()
        assert isinstance(env, SandboxEnvironment)
        public = {n for n in _members(env) if not n.startswith("_")}
        assert public == TOOLS | {"reset", "get_reward"}
        assert _live(client, "trl-probe") == set()
        schemas = {n: transformers_utils.get_json_schema(f)["function"] for n, f in _tool_dict(env).items()}
        assert set(schemas) == TOOLS
        assert schemas["bash"]["parameters"]["required"] == ["command"]
        assert schemas["write_file"]["parameters"]["required"] == ["path", "content"]
        assert schemas["read_file"]["parameters"]["properties"]["path"]["type"] == "string"
        assert "required" not in schemas["submit"]["parameters"]
        assert all(s["description"] and all(p["description"] for p in s["parameters"]["properties"].values())
                   for s in schemas.values())
        with pytest.raises(RuntimeError, match="reset"):
            env.bash(command="true")
    finally:
        factory.close()


def test_grpo_groups_fork_from_one_checkpoint(server, client):
    g, run = 3, "trl-groups"
    factory = environment_factory("shell", client=client, run=run, num_generations=g)
    try:
        pool = [factory()]  # the probe seeds the pool
        rows = [{"prompt": [{"role": "user", "content": "first"}], "seed": 1},
                {"prompt": [{"role": "user", "content": "second"}], "seed": 2, "options": {"WHO": "trl"}}]
        batch = _batch(rows, g)
        pool += [factory() for _ in range(len(batch) - len(pool))]
        observations = [env.reset(**row) for env, row in zip(pool, batch, strict=True)]
        assert all(o.startswith("\n\nWrite 42") for o in observations)
        assert all("seed=1 who=nobody" in o for o in observations[:g])
        assert all("seed=2 who=trl" in o for o in observations[g:])
        groups = [env.group_id for env in pool]
        assert len(set(groups[:g])) == 1 and len(set(groups[g:])) == 1 and groups[0] != groups[g]
        # One Reset per group; the other members are forks of its checkpoint.
        assert len({env.start_checkpoint_id for env in pool[:g]}) == 1
        assert len({env.start_checkpoint_id for env in pool[g:]}) == 1
        assert len({env.sandbox_id for env in pool}) == len(batch) == len(_live(client, run))

        # Rollouts: the model's tool calls, as TRL makes them.
        tools = [_tool_dict(env) for env in pool]
        assert tools[0]["bash"](command="echo $((6 * 7)) > /work/answer.txt; cat /work/answer.txt") == "42\n"
        assert tools[1]["write_file"](path="/work/answer.txt", content="41") == "wrote 2 bytes"
        assert tools[1]["read_file"](path="/work/answer.txt") == "41"
        assert "ENOENT" in tools[2]["read_file"](path="/work/missing.txt")
        assert tools[3]["write_file"](path="answer.txt", content="42") == "wrote 2 bytes"
        tools[3]["submit"]()
        with pytest.raises(RuntimeError, match="ended"):
            tools[3]["bash"](command="true")
        assert tools[4]["bash"](command="exit 3") == "[exit 3]\n"
        # The sibling forks did not see each other's files.
        assert "ENOENT" in tools[5]["read_file"](path="/work/answer.txt")

        rewards = [env.get_reward() for env in pool]  # TRL's get_reward column
        assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
        assert [env.get_reward() for env in pool] == rewards  # asked again, the same
        if server.ledger:
            for gid, want in ((groups[0], [1.0, 0.0, 0.0]), (groups[g], [1.0, 0.0, 0.0])):
                adv = client.get_group_advantages(gid)
                assert sorted(a.reward for a in adv.advantages) == sorted(want) and adv.counted_count == g

        # The next batch reuses the instances: each reset releases its sandbox.
        first = {env.sandbox_id for env in pool}
        for env in pool:
            env.reset(prompt=[{"role": "user", "content": "third"}])
        assert len({env.group_id for env in pool}) == 2  # six rows of one prompt: two groups of three
        assert not first & _live(client, run)
        for sid in first:
            with pytest.raises((NotFound, FailedPrecondition)):  # closed, or closed and forgotten
                client.get_sandbox(sid)
    finally:
        factory.close()
    assert _live(client, run) == set()


def test_groups_without_a_size_fork_on_demand(server, client):
    run = "trl-lazy"
    factory = environment_factory("shell", client=client, run=run)
    try:
        pool = [factory() for _ in range(4)]
        for env, row in zip(pool, [{"prompt": "a"}] * 3 + [{"prompt": "b"}], strict=True):
            env.reset(**row)
        assert len({env.group_id for env in pool[:3]}) == 1 and pool[3].group_id != pool[0].group_id
        assert len({env.start_checkpoint_id for env in pool[:3]}) == 1
        assert len(_live(client, run)) == 4
    finally:
        factory.close()
    assert _live(client, run) == set()


def test_bad_rows_are_refused(server, client):
    factory = environment_factory("shell", client=client, run="trl-bad")
    try:
        env = factory()
        with pytest.raises(TypeError, match="seed"):
            env.reset(prompt="x", seed="1")
        with pytest.raises(TypeError, match="options"):
            env.reset(prompt="x", options=["WHO"])
        assert _live(client, "trl-bad") == set()
        with pytest.raises(ValueError):
            environment_factory("shell", client=client, num_generations=0)
    finally:
        factory.close()
    with pytest.raises(RuntimeError, match="closed"):
        factory()


def test_docs_example(server, client, monkeypatch):
    monkeypatch.setenv("DELTAGYM_ADDR", server.addr)
    ns = run_example("trl.md")
    assert ns["rewards"] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert all("seed=" in o for o in ns["observations"])
    assert not {env.sandbox_id for env in ns["pool"]} & {s.sandbox_id for s in client.list_sandboxes()}


def test_a_group_whose_forks_fail_leaks_no_sandbox(server, client):
    run = "trl-fork-fails"
    factory = environment_factory("shell", client=client, run=run, num_generations=100_000)
    try:
        env = factory()
        with pytest.raises(DeltagymError):  # more forks than the server makes at once
            env.reset(prompt="x")
        assert _live(client, run) == set() and env.sandbox_id == ""
    finally:
        factory.close()
