"""deltagym.search against the fixture's real server: the archive, selection, budgets, and the
release of every checkpoint the search took (checked with ListCheckpoints); the archive's
bookkeeping on its own."""

from __future__ import annotations

import asyncio
import math
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import deltagym
import deltagym.errors
from deltagym import Client, aio, search as search_mod
from deltagym.search import AsyncGoExplore, GoExplore, Progress, _Archive
from deltagym.types import Checkpoint, StateDigest

README = Path(__file__).resolve().parents[1] / "README.md"


def counter(sb: deltagym.Sandbox) -> int:
    """The state of these searches: the number in /work/n (0 when missing)."""
    return int(sb.run("cat /work/n 2>/dev/null || echo 0", check=True).stdout)


def adder(rng: random.Random):
    """Adds 2 in one step, or 1 in each of two: every number is reached by paths of several lengths."""

    def policy(sb: deltagym.Sandbox) -> list[str]:
        if rng.random() < 0.5:
            return ["echo $(( $(cat /work/n 2>/dev/null || echo 0) + 2 )) > /work/n"]
        return ["echo $(( $(cat /work/n 2>/dev/null || echo 0) + 1 )) > /work/n"] * 2

    return policy


def listed(client: Client, run: str) -> set[str]:
    return {c.checkpoint_id for c in client.list_checkpoints(run=run)}


def recorded(sb: deltagym.Sandbox) -> list[str]:
    """The IDs of every checkpoint taken through sb.checkpoint from now on: what a search took,
    apart from what the server checkpoints for itself (an Evaluate's fork)."""
    took: list[str] = []
    take = sb.checkpoint

    def checkpoint(**kw):
        c = take(**kw)
        took.append(c.id)
        return c

    sb.checkpoint = checkpoint  # type: ignore[method-assign]
    return took


@pytest.fixture
def run_sb(client: Client) -> Iterator[tuple[str, deltagym.Sandbox]]:
    run = f"run-{uuid.uuid4().hex[:8]}"
    with deltagym.Sandbox.create("shell", client=client, run=run) as sb:
        yield run, sb


def test_archive_keeps_the_shortest_way_to_each_cell_and_releases_the_rest(
        client: Client, run_sb: tuple[str, deltagym.Sandbox]) -> None:
    run, sb = run_sb
    shortest: dict[object, int] = {}
    seen: list[Progress] = []

    def watch(p: Progress) -> None:
        seen.append(p)
        assert p.reached is not None and p.explore_steps in (1, 2)
        shortest[p.reached.key] = min(shortest.get(p.reached.key, math.inf), p.chosen.steps + p.explore_steps)
        # What the archive keeps is what the server holds of this run, and nothing more.
        assert listed(client, run) == {c.checkpoint.id for c in search.cells.values()}

    search = GoExplore(sb, adder(random.Random(7)), cell=counter, score=lambda s: float(counter(s)), seed=7)
    best = search.run(iterations=12, on_progress=watch)
    assert len(seen) == 12 and search.iterations == 12 and seen[-1].steps == search.steps
    assert search.steps == sum(p.explore_steps for p in seen)
    cells = search.cells
    assert cells[0].steps == 0 and cells[0].chosen >= 1 and cells[0].parent is None
    assert sum(c.visits for c in cells.values()) == 12 + 1
    assert sum(c.chosen for c in cells.values()) == 12
    for key, c in cells.items():
        if key != 0:
            assert c.steps == shortest[key], (key, c)
            assert c.parent in cells
            assert c.score == float(key)
    assert any(p.improved for p in seen) or all(c.visits == 1 for c in cells.values())
    assert best is max(cells.values(), key=lambda c: (c.score, -c.steps))
    search.restore(best)
    assert counter(sb) == best.key
    search.close(keep=[best])
    assert listed(client, run) == {best.checkpoint.id}
    search.close()  # idempotent: keep's are the caller's now
    assert listed(client, run) == {best.checkpoint.id}
    client.release_checkpoint(best.checkpoint.id)
    with pytest.raises(ValueError, match="closed"):
        search.step()


def test_budgets_stop_and_explore_steps(client: Client, run_sb: tuple[str, deltagym.Sandbox]) -> None:
    run, sb = run_sb

    def endless(sb: deltagym.Sandbox) -> Iterator[str]:
        while True:  # a generator: the search takes what it needs
            yield "echo $(( $(cat /work/n 2>/dev/null || echo 0) + 1 )) > /work/n"

    with GoExplore(sb, endless, cell=counter, score=lambda s: float(counter(s)), explore_steps=3, seed=1) as search:
        progress = list(search.iterate(steps=10))
        assert [p.explore_steps for p in progress] == [3, 3, 3, 1] and search.steps == 10
        with pytest.raises(ValueError, match="budget"):
            search.run()
        before = search.iterations
        best = search.run(iterations=50, stop_at=4.0)
        assert best.score >= 4.0 and search.iterations < before + 50
    assert listed(client, run) == set()


def test_policy_that_steps_itself_and_dead_ends(client: Client, run_sb: tuple[str, deltagym.Sandbox]) -> None:
    run, sb = run_sb
    rng = random.Random(3)

    def policy(sb: deltagym.Sandbox) -> None:
        sb.run(f"echo {rng.randrange(6)} > /work/n")  # its own step; returns None

    def cell(sb: deltagym.Sandbox) -> int | None:
        n = counter(sb)
        return None if n == 3 else n  # 3 is a dead end: never filed

    with GoExplore(sb, policy, cell=cell, score=lambda s: 0.0, seed=3) as search:
        ps = list(search.iterate(iterations=15))
        assert all(p.explore_steps == 1 for p in ps)
        assert 3 not in search.cells and any(p.reached is None for p in ps)
        assert set(search.cells) <= {0, 1, 2, 4, 5}
        assert listed(client, run) == {c.checkpoint.id for c in search.cells.values()}
    assert listed(client, run) == set()


def test_ended_episode_files_no_cell(client: Client, run_sb: tuple[str, deltagym.Sandbox]) -> None:
    run, sb = run_sb
    took = recorded(sb)
    with GoExplore(sb, lambda s: ["echo 42 > /work/answer.txt", deltagym.actions.submit()], cell=counter) as search:
        p = search.step()
        assert p.reached is None and p.explore_steps == 2 and len(search.cells) == 1
        assert search.best.score == 0.0  # the start, by the verifier (Evaluate, the default score)
        assert took and set(took) <= listed(client, run)
    assert not set(took) & listed(client, run)


def test_default_cell_is_the_state_digest(client: Client, run_sb: tuple[str, deltagym.Sandbox]) -> None:
    run, sb = run_sb
    rng = random.Random(5)
    took = recorded(sb)
    search = GoExplore(sb, lambda s: [f"echo {rng.choice('ab')} > /work/v"], seed=5)
    probe = client.checkpoint(sb.id, wait_for_digest=True)
    client.release_checkpoint(probe.checkpoint_id)
    assert probe.digest.files.startswith("sha256:")
    search.run(iterations=6)
    # Three states: the start, v=a and v=b, however often and from wherever reached.
    assert len(search.cells) == 3 and all(isinstance(k, StateDigest) for k in search.cells)
    assert sum(c.visits for c in search.cells.values()) == 7
    search.close()
    assert len(took) == 7 and not set(took) & listed(client, run)


def test_scores_are_reported_to_the_ledger(server, client: Client, run_sb: tuple[str, deltagym.Sandbox],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server.require_ledger()
    run, sb = run_sb
    start = sb.episode_id
    scores: dict[str, float] = {}

    def watch(p: Progress) -> None:
        scores[sb.episode_id] = p.score  # the episode the iteration's restore started

    with GoExplore(sb, adder(random.Random(11)), cell=counter, score=lambda s: float(counter(s)) / 10,
                   seed=11) as search:
        search.run(iterations=4, on_progress=watch)
    assert len(scores) == 4 and start not in scores
    for ep, score in scores.items():
        rewards = [(r.name, r.value, r.source) for r in client.get_trajectory(ep).episode.rewards]
        assert rewards == [(search_mod.SCORE_REWARD, score, search_mod.SCORE_SOURCE)] == [("score", score, "goexplore")]
    assert set(scores) < {e.episode_id for e in client.iter_episodes(run=run)}
    assert not client.get_trajectory(start).episode.rewards  # the start was not explored

    # report_scores=False reports nothing.
    quiet_eps: list[str] = []
    with GoExplore(sb, adder(random.Random(12)), cell=counter, score=lambda s: 1.0, seed=12,
                   report_scores=False) as quiet:
        quiet.run(iterations=2, on_progress=lambda p: quiet_eps.append(sb.episode_id))
    assert len(quiet_eps) == 2 and all(not client.get_trajectory(ep).episode.rewards for ep in quiet_eps)

    # A server without a ledger refuses the first report: the search goes on without reporting.
    calls: list[str] = []

    def refuse(episode_id: str, name: str, value: float, *, source: str = "") -> None:
        calls.append(episode_id)
        raise deltagym.errors.from_code(grpc.StatusCode.FAILED_PRECONDITION, "ledger disabled on this server",
                                        "ReportReward", reason="LEDGER_DISABLED")

    monkeypatch.setattr(sb.client, "report_reward", refuse)
    with GoExplore(sb, adder(random.Random(13)), cell=counter, score=lambda s: 1.0, seed=13) as off:
        off.run(iterations=3)
        assert len(calls) == 1 and not off.report_scores and off.iterations == 3

    # Any other refusal is the caller's to see.
    def broken(episode_id: str, name: str, value: float, *, source: str = "") -> None:
        raise deltagym.errors.from_code(grpc.StatusCode.INTERNAL, "ledger write failed", "ReportReward")

    monkeypatch.setattr(sb.client, "report_reward", broken)
    with GoExplore(sb, adder(random.Random(14)), cell=counter, score=lambda s: 1.0, seed=14) as loud, \
            pytest.raises(deltagym.errors.DeltagymError, match="ledger write failed"):
        loud.step()


def test_async_search(server, client: Client) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        async with await aio.AsyncSandbox.create("shell", addr=server.addr, run=run) as sb:
            async def cell(s: aio.AsyncSandbox) -> int:
                return int((await s.run("cat /work/n 2>/dev/null || echo 0")).stdout)

            async def policy(s: aio.AsyncSandbox):  # an async generator of actions
                for _ in range(2):
                    yield "echo $(( $(cat /work/n 2>/dev/null || echo 0) + 1 )) > /work/n"

            seen: list[Progress] = []

            episodes: list[str] = []

            async def watch(p: Progress) -> None:
                seen.append(p)
                episodes.append(sb.episode_id)

            async with AsyncGoExplore(sb, policy, cell=cell, score=cell, seed=2) as search:
                best = await search.run(iterations=5, on_progress=watch)
                assert len(seen) == 5 and best.score == best.key and best.key >= 2
                if server.ledger:  # each explored episode's score, reported as a reward
                    got = [[(r.name, r.value, r.source) for r in (await sb.client.get_trajectory(ep)).episode.rewards]
                           for ep in episodes]
                    assert got == [[("score", p.score, "goexplore")] for p in seen]
                assert listed(client, run) == {c.checkpoint.id for c in search.cells.values()}
                await search.restore(best)
                assert await cell(sb) == best.key
        assert listed(client, run) == set()

    asyncio.run(main())


def test_readme_example(server, client: Client, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text().split("\n## Go-Explore over checkpoints\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)
    monkeypatch.setenv("DELTAGYM_ADDR", server.addr)
    with deltagym.Sandbox.create("shell", client=client) as sb:
        probe = client.checkpoint(sb.id, wait_for_digest=True)
        client.release_checkpoint(probe.checkpoint_id)
    assert probe.digest.files.startswith("sha256:")
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})  # the repository's own docs
    score, steps, cells, reward = capsys.readouterr().out.split()
    assert float(score) == 1.0 and int(steps) >= 2 and int(cells) >= 3 and float(reward) == 1.0


# --- the archive on its own ------------------------------------------------------------------


def ck(id: str, deduplicated: bool = False) -> Checkpoint:
    return Checkpoint(id=id, deduplicated=deduplicated)


def test_selection_weighs_novelty_and_score() -> None:
    a = _Archive(random.Random(0), 1.0, 2.0, None)
    a.offer("start", ck("c0"), 0.0, 0, None, 0)
    a.offer("mid", ck("c1"), 0.5, 1, "start", 1)
    a.offer("top", ck("c2"), 1.0, 2, "mid", 2)
    assert a.weights() == [1.0, 2.0, 3.0]
    a.cells["top"].chosen = 3
    assert a.weights() == [1.0, 2.0, 1 / 2 + 2.0]
    picks = [a.select().key for _ in range(3000)]
    assert picks.count("top") > picks.count("mid") > picks.count("start") > 0
    only = _Archive(random.Random(0), 1.0, 1.0, lambda c: 1.0 if c.key == "mid" else 0.0)
    for i, k in enumerate(["start", "mid", "top"]):
        only.offer(k, ck(f"c{i}"), 0.0, i, None, i)
    assert {only.select().key for _ in range(50)} == {"mid"}
    with pytest.raises(ValueError):
        _Archive(random.Random(0), -1.0, 1.0, None)


def test_offer_keeps_the_best_and_releases_only_its_own() -> None:
    a = _Archive(random.Random(0), 1.0, 1.0, None)
    for c in (ck("c0"), ck("c1"), ck("c2"), ck("c3")):
        a.took(c)
    a.offer("s", ck("c0"), 0.0, 0, None, 0)
    cell, new, improved, drop = a.offer("x", ck("c1"), 1.0, 5, "s", 1)
    assert new and not improved and drop == []
    cell, new, improved, drop = a.offer("x", ck("c2"), 1.0, 7, "s", 2)  # as good, longer: a visit
    assert (new, improved, drop, cell.visits, cell.checkpoint.id) == (False, False, ["c2"], 2, "c1")
    cell, new, improved, drop = a.offer("x", ck("c3"), 1.0, 3, "s", 3)  # as good, shorter: replaces
    assert (improved, drop, cell.checkpoint.id, cell.steps, cell.improved) == (True, ["c1"], "c3", 3, 1)
    # A deduplicated answer naming a checkpoint the search did not take (an env's pool checkpoint)
    # is kept by its cell but never released; one naming a cell's own is released after the last cell.
    pool = ck("ck-pool", deduplicated=True)
    a.took(pool)
    a.offer("y", pool, 2.0, 1, "s", 4)
    assert a.offer("y", ck("ck-pool", deduplicated=True), 0.0, 9, "s", 5)[3] == []
    a.took(ck("c3", deduplicated=True))
    assert a.offer("z", ck("c3", deduplicated=True), 0.5, 2, "s", 6)[3] == []  # "x" and "z" share it
    assert a.release_all(keep=[a.cells["s"]]) == ["c3"]
    assert a.release_all(keep=()) == []
