"""Go-Explore over checkpoints: remember every distinct state reached, go
back to a promising one, explore from it, repeat.

    import deltagym
    from deltagym.search import GoExplore

    def policy(sb):                        # from a restored state, a few actions
        return [random.choice(COMMANDS) for _ in range(3)]

    with deltagym.Sandbox.create("shell") as sb:
        with GoExplore(sb, policy) as search:
            best = search.run(iterations=100, stop_at=1.0)
            search.restore(best)           # the sandbox is at the best state found
        print(sb.submit().reward)

The archive holds one cell per distinct state: keyed by the checkpoint's
state digest (its files and processes, computed by the server), or by a
function of the state given as cell=. Each cell keeps the best checkpoint
that reached it (by score, then by fewer steps from the start) and counts
how often it was reached and chosen. An iteration chooses a cell at random,
weighted by novelty (1/sqrt(1 + times chosen)) and score, restores its
checkpoint (a new episode there, in about a millisecond), lets the policy
act, checkpoints the state it ends in and files it in the archive; it reports
the state's score to the ledger as a reward of the explored episode ("score",
source "goexplore"; report_scores=False does not), so that the search's tree
can be coloured by it. The search releases every checkpoint it took and no
longer keeps, and the rest at close(): it leaves none behind on the server.

AsyncGoExplore is the same over an AsyncSandbox.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._proto.deltagym.v1 import action_pb2
from .errors import DeltagymError
from .types import Checkpoint

if TYPE_CHECKING:
    from ._aio_sandbox import AsyncSandbox
    from .sandbox import Sandbox

__all__ = ["SCORE_REWARD", "SCORE_SOURCE", "Action", "AsyncGoExplore", "AsyncPolicy", "Cell", "GoExplore", "Policy",
           "Progress"]

SCORE_REWARD = "score"
"""The name of the reward by which a search reports an explored episode's score (report_scores)."""
SCORE_SOURCE = "goexplore"
"""The source of the rewards a search reports (report_scores)."""

Action = action_pb2.Action | str
"""An action a policy returns: an Action (deltagym.actions) or a str run as a shell command."""

S = TypeVar("S")


@dataclass(eq=False)
class Cell:
    """A distinct state of the search and the best way found to it.

    Attributes:
        key: what identifies the state: its StateDigest, or what the cell= function gave.
        checkpoint: the best checkpoint reaching the state; the search holds it.
        score: the score of that checkpoint's state.
        steps: the steps from the search's start to that checkpoint.
        parent: the key of the cell it was explored from (None for the start).
        found_at: the iteration that first reached the state (0 for the start).
        visits: how many times an exploration reached the state (the first included).
        chosen: how many times the search explored from it.
        improved: how many times a better checkpoint replaced the one it keeps.
    """

    key: Hashable
    checkpoint: Checkpoint
    score: float
    steps: int
    parent: Hashable | None = None
    found_at: int = 0
    visits: int = 1
    chosen: int = 0
    improved: int = 0

    def __repr__(self) -> str:
        return (f"Cell(key={self.key!s:.40}, score={self.score}, steps={self.steps}, visits={self.visits}, "
                f"chosen={self.chosen}, checkpoint={self.checkpoint.id!r})")


@dataclass(frozen=True)
class Progress:
    """What one iteration did.

    Attributes:
        iteration: its number, from 1.
        steps: the exploration steps of every iteration so far (budgeted by steps=).
        chosen: the cell it explored from.
        explore_steps: the steps this exploration took.
        reached: the cell of the state it ended in; None when the episode ended
            (a submit, a budget), which leaves no state to return to, or when the
            cell function gave None for it (a dead end).
        score: the score of that state (0.0 when the episode ended).
        new: the state was not in the archive.
        improved: the state was, and this way to it was better (higher score, or
            as high in fewer steps): its cell now keeps this checkpoint.
        cells: the cells in the archive after it.
        best: the best cell after it.
    """

    iteration: int
    steps: int
    chosen: Cell
    explore_steps: int
    reached: Cell | None
    score: float
    new: bool
    improved: bool
    cells: int
    best: Cell


class _Archive:
    """The cells, their selection and the checkpoints they hold: no I/O.

    own holds the checkpoints the search took (a deduplicated answer may
    name one it did not, such as an env's pool checkpoint: kept, never
    released); holds counts the cells keeping each checkpoint, so a
    checkpoint two cells share (dedupe) is released after the last."""

    def __init__(self, rng: random.Random, novelty_weight: float, score_weight: float,
                 weight: Callable[[Cell], float] | None) -> None:
        if novelty_weight < 0 or score_weight < 0:
            raise ValueError("novelty_weight and score_weight must be at least 0")
        self.cells: dict[Hashable, Cell] = {}
        self.own: set[str] = set()
        self.holds: dict[str, int] = {}
        self._rng = rng
        self._novelty = novelty_weight
        self._score = score_weight
        self._weight = weight

    def best(self) -> Cell:
        """The cell of highest score, then fewest steps, then found first."""
        return max(self.cells.values(), key=lambda c: (c.score, -c.steps, -c.found_at))

    def weights(self) -> list[float]:
        cells = list(self.cells.values())
        if self._weight is not None:
            return [max(0.0, float(self._weight(c))) for c in cells]
        lo = min(c.score for c in cells)
        hi = max(c.score for c in cells)
        span = hi - lo
        return [self._novelty / math.sqrt(1 + c.chosen) + (self._score * (c.score - lo) / span if span > 0 else 0.0)
                for c in cells]

    def select(self) -> Cell:
        """A cell drawn at random by weights(); each with equal odds when every weight is 0."""
        cells = list(self.cells.values())
        w = self.weights()
        if not any(x > 0 for x in w):
            w = [1.0] * len(cells)
        return self._rng.choices(cells, weights=w)[0]

    def took(self, ck: Checkpoint) -> None:
        """Notes a checkpoint the search took: its own unless dedupe answered with another's."""
        if not ck.deduplicated and ck.id not in self.holds:
            self.own.add(ck.id)

    def offer(self, key: Hashable, ck: Checkpoint, score: float, steps: int, parent: Hashable | None,
              iteration: int) -> tuple[Cell, bool, bool, list[str]]:
        """Files a checkpoint of a state reached: a new cell, a better way to a
        cell (replacing its checkpoint), or a visit. Returns the cell, whether
        it is new, whether it improved, and the checkpoints to release."""
        cell = self.cells.get(key)
        if cell is None:
            cell = Cell(key=key, checkpoint=ck, score=score, steps=steps, parent=parent, found_at=iteration)
            self.cells[key] = cell
            self._hold(ck.id)
            return cell, True, False, []
        cell.visits += 1
        if (score, -steps) > (cell.score, -cell.steps):
            old = cell.checkpoint.id
            cell.checkpoint, cell.score, cell.steps, cell.parent = ck, score, steps, parent
            cell.improved += 1
            self._hold(ck.id)
            return cell, False, True, self._drop(old)
        return cell, False, False, self.unheld(ck.id)

    def _hold(self, id: str) -> None:
        self.holds[id] = self.holds.get(id, 0) + 1

    def _drop(self, id: str) -> list[str]:
        self.holds[id] -= 1
        if self.holds[id] == 0:
            del self.holds[id]
        return self.unheld(id)

    def unheld(self, id: str) -> list[str]:
        """[id] when the search took it and no cell keeps it (it is then no longer its own)."""
        if id in self.own and id not in self.holds:
            self.own.discard(id)
            return [id]
        return []

    def release_all(self, keep: Iterable[Cell | Checkpoint | str]) -> list[str]:
        """Every checkpoint the search took, but keep's, to release; it owns none after."""
        kept = {k.checkpoint.id if isinstance(k, Cell) else k.id if isinstance(k, Checkpoint) else k for k in keep}
        out = sorted(self.own - kept)
        self.own.clear()
        return out


def _budget(iterations: int | None, steps: int | None) -> None:
    if iterations is None and steps is None:
        raise ValueError("give a budget: iterations=, steps= or both")
    if (iterations is not None and iterations < 0) or (steps is not None and steps < 0):
        raise ValueError("iterations and steps must be at least 0")


class _Search(Generic[S]):
    """What GoExplore and AsyncGoExplore share: their arguments and archive."""

    def __init__(self, sandbox: S, policy: Callable[[S], Any], *, score: Callable[[S], Any] | None = None,
                 cell: Callable[[S], Any] | None = None, dedupe: bool = False, explore_steps: int | None = None,
                 novelty_weight: float = 1.0, score_weight: float = 1.0, weight: Callable[[Cell], float] | None = None,
                 seed: int | None = None, report_scores: bool = True) -> None:
        if explore_steps is not None and explore_steps <= 0:
            raise ValueError(f"explore_steps must be positive, not {explore_steps}")
        self.sandbox = sandbox
        self.policy = policy
        self._score_fn = score
        self._cell_fn = cell
        self.dedupe = dedupe
        self.explore_steps = explore_steps
        self.archive = _Archive(random.Random(seed), novelty_weight, score_weight, weight)
        self.report_scores = report_scores
        self.iterations = 0
        self.steps = 0
        self._closed = False

    @property
    def cells(self) -> dict[Hashable, Cell]:
        """The archive: every cell, by key."""
        return self.archive.cells

    @property
    def best(self) -> Cell:
        """The cell of highest score (then fewest steps)."""
        return self.archive.best()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the search is closed: its checkpoints were released")

    def _key(self, ck: Checkpoint) -> Hashable:
        if ck.digest is None:
            raise RuntimeError(f"the server gave no state digest for checkpoint {ck.id}: it computes none, "
                               "so key the archive by a function of the state (cell=)")
        return ck.digest

    def _reportable(self, score: float) -> bool:
        """Whether to report score: reporting is on and the server takes it (a finite number)."""
        return self.report_scores and math.isfinite(score)

    def _limit(self, steps: int | None) -> int | None:
        """The most steps the next exploration may take: explore_steps, within what is left of steps."""
        left = None if steps is None else steps - self.steps
        if left is None:
            return self.explore_steps
        return left if self.explore_steps is None else min(left, self.explore_steps)

    def _progress(self, chosen: Cell, took: int, reached: Cell | None, score: float, new: bool,
                  improved: bool) -> Progress:
        self.steps += took
        return Progress(iteration=self.iterations, steps=self.steps, chosen=chosen, explore_steps=took,
                        reached=reached, score=score, new=new, improved=improved, cells=len(self.archive.cells),
                        best=self.archive.best())


class GoExplore(_Search["Sandbox"]):
    """A Go-Explore search from a Sandbox's current state.

    Args:
        sandbox: the sandbox to search in; the search restores it to its cells'
            checkpoints, so one sandbox serves the whole search.
        policy: explores from a restored state: called with the sandbox, it returns
            the actions to take (an iterable of Actions or shell commands, which may
            be a generator looking at the sandbox between them), which the search
            performs until it runs out, explore_steps are taken or the episode ends;
            or it performs its steps itself (sandbox.run ...) and returns None.
        score: the score of the state the sandbox is in (higher is better);
            default the env verifier's reward (Sandbox.evaluate).
        cell: what identifies the state the sandbox is in (a hashable value; it may
            run commands, as it runs after the checkpoint is taken), or None for a
            state not worth returning to (a dead end), which is not filed and whose
            checkpoint is released; default the checkpoint's state digest, which
            needs a server that computes them.
        dedupe: checkpoints answer with an existing checkpoint of the same state
            (Sandbox.checkpoint(dedupe=True)) instead of keeping a copy.
        explore_steps: the most actions taken from what the policy returns, per
            exploration; default no limit but the budget's.
        novelty_weight, score_weight: a cell's weight in selection is novelty_weight
            / sqrt(1 + times chosen) + score_weight * its score scaled to [0, 1]
            over the archive.
        weight: a weight of a cell instead (a function of the Cell).
        seed: the seed of the selection's random choices.
        report_scores: after each exploration that ends in a state (not in a
            submit or a budget), report that state's score to the ledger as a reward
            of the explored episode (the one the restore started): name "score"
            (SCORE_REWARD), source "goexplore" (SCORE_SOURCE), read back by
            get_trajectory (its Episode.rewards), so that the search's tree can be
            coloured by it. On a server without a ledger it turns itself off at the
            first report; a score that is not a finite number is not reported.
    """

    def start(self) -> Cell:
        """Takes the checkpoint of the sandbox's current state as the first cell
        (run and step do it first when not done)."""
        self._check_open()
        if self.archive.cells:
            return self.archive.best()
        ck = self._checkpoint()
        score = self._score()
        cell, _, _, _ = self.archive.offer(self._cell(ck), ck, score, 0, None, 0)
        return cell

    def step(self, *, steps: int | None = None) -> Progress:
        """One iteration: choose a cell, restore it, explore, file the state
        reached. steps caps the exploration's steps (the budget's remainder)."""
        self.start()
        self.iterations += 1
        chosen = self.archive.select()
        chosen.chosen += 1
        sb = self.sandbox
        restored = sb.restore(chosen.checkpoint)
        first = restored.next_step_index
        limit = self._limit(steps)
        self._explore(limit)
        info = sb.describe()
        took = max(0, info.next_step_index - first)
        if info.state != "ready":
            return self._progress(chosen, took, None, 0.0, False, False)
        ck = self._checkpoint()
        score = self._score()
        self._report(restored.episode_id, score)
        key = self._cell(ck)
        if key is None:  # a state the cell function says is not worth returning to
            self._release(self.archive.unheld(ck.id))
            return self._progress(chosen, took, None, score, False, False)
        reached, new, improved, drop = self.archive.offer(key, ck, score, chosen.steps + took, chosen.key,
                                                          self.iterations)
        self._release(drop)
        return self._progress(chosen, took, reached, score, new, improved)

    def iterate(self, *, iterations: int | None = None, steps: int | None = None,
                stop_at: float | None = None) -> Iterator[Progress]:
        """Runs iterations and yields each one's Progress, until iterations
        iterations ran, steps exploration steps were taken, or a cell scores
        stop_at or more."""
        _budget(iterations, steps)
        self.start()
        ran = 0
        while (iterations is None or ran < iterations) and (steps is None or self.steps < steps):
            if stop_at is not None and self.archive.best().score >= stop_at:
                return
            p = self.step(steps=steps)
            ran += 1
            yield p

    def run(self, *, iterations: int | None = None, steps: int | None = None, stop_at: float | None = None,
            on_progress: Callable[[Progress], Any] | None = None) -> Cell:
        """Runs the search (budget as for iterate(), calling on_progress after
        each iteration) and returns the best cell."""
        for p in self.iterate(iterations=iterations, steps=steps, stop_at=stop_at):
            if on_progress is not None:
                on_progress(p)
        return self.archive.best()

    def restore(self, cell: Cell | None = None) -> Cell:
        """Puts the sandbox at a cell's state (default the best) and returns the cell."""
        self._check_open()
        c = cell if cell is not None else self.archive.best()
        self.sandbox.restore(c.checkpoint)
        return c

    def close(self, *, keep: Iterable[Cell | Checkpoint | str] = ()) -> None:
        """Releases every checkpoint the search took, but those of keep (cells,
        checkpoints or IDs, which are then the caller's to release). The
        sandbox stays where it is. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release(self.archive.release_all(keep))

    def __enter__(self) -> GoExplore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _explore(self, limit: int | None) -> None:
        actions = self.policy(self.sandbox)
        if actions is None or limit == 0:
            return
        for n, a in enumerate(actions, 1):
            r = self.sandbox.step(a)
            if r.step.terminated or r.step.truncated or (limit is not None and n >= limit):
                return

    def _checkpoint(self) -> Checkpoint:
        ck = self.sandbox.checkpoint(wait_for_digest=self._cell_fn is None, dedupe=self.dedupe)
        self.archive.took(ck)
        return ck

    def _score(self) -> float:
        if self._score_fn is None:
            return self.sandbox.evaluate().reward
        return float(self._score_fn(self.sandbox))

    def _cell(self, ck: Checkpoint) -> Hashable:
        if self._cell_fn is None:
            return self._key(ck)
        key: Hashable = self._cell_fn(self.sandbox)
        return key

    def _release(self, ids: Iterable[str]) -> None:
        for id in ids:
            self.sandbox.client.release_checkpoint(id)

    def _report(self, episode_id: str, score: float) -> None:
        if not self._reportable(score):
            return
        try:
            self.sandbox.client.report_reward(episode_id, SCORE_REWARD, score, source=SCORE_SOURCE)
        except DeltagymError as e:
            if e.reason != "LEDGER_DISABLED":
                raise
            self.report_scores = False  # a server without a ledger takes no reward


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class AsyncGoExplore(_Search["AsyncSandbox"]):
    """GoExplore over an AsyncSandbox: the same arguments, where policy, score
    and cell may be coroutine functions, and policy may return an async
    iterable of actions; the same methods, awaited (iterate is an async
    iterator, and the search an async context manager)."""

    async def start(self) -> Cell:
        """As GoExplore.start, awaited."""
        self._check_open()
        if self.archive.cells:
            return self.archive.best()
        ck = await self._checkpoint()
        score = await self._score()
        cell, _, _, _ = self.archive.offer(await self._cell(ck), ck, score, 0, None, 0)
        return cell

    async def step(self, *, steps: int | None = None) -> Progress:
        """As GoExplore.step, awaited."""
        await self.start()
        self.iterations += 1
        chosen = self.archive.select()
        chosen.chosen += 1
        sb = self.sandbox
        restored = await sb.restore(chosen.checkpoint)
        first = restored.next_step_index
        await self._explore(self._limit(steps))
        info = await sb.describe()
        took = max(0, info.next_step_index - first)
        if info.state != "ready":
            return self._progress(chosen, took, None, 0.0, False, False)
        ck = await self._checkpoint()
        score = await self._score()
        await self._report(restored.episode_id, score)
        key = await self._cell(ck)
        if key is None:  # a state the cell function says is not worth returning to
            await self._release(self.archive.unheld(ck.id))
            return self._progress(chosen, took, None, score, False, False)
        reached, new, improved, drop = self.archive.offer(key, ck, score, chosen.steps + took, chosen.key,
                                                          self.iterations)
        await self._release(drop)
        return self._progress(chosen, took, reached, score, new, improved)

    async def iterate(self, *, iterations: int | None = None, steps: int | None = None,
                      stop_at: float | None = None) -> AsyncIterator[Progress]:
        """As GoExplore.iterate, an async iterator."""
        _budget(iterations, steps)
        await self.start()
        ran = 0
        while (iterations is None or ran < iterations) and (steps is None or self.steps < steps):
            if stop_at is not None and self.archive.best().score >= stop_at:
                return
            p = await self.step(steps=steps)
            ran += 1
            yield p

    async def run(self, *, iterations: int | None = None, steps: int | None = None, stop_at: float | None = None,
                  on_progress: Callable[[Progress], Any] | None = None) -> Cell:
        """As GoExplore.run, awaited; on_progress may be a coroutine function."""
        async for p in self.iterate(iterations=iterations, steps=steps, stop_at=stop_at):
            if on_progress is not None:
                await _maybe_await(on_progress(p))
        return self.archive.best()

    async def restore(self, cell: Cell | None = None) -> Cell:
        """As GoExplore.restore, awaited."""
        self._check_open()
        c = cell if cell is not None else self.archive.best()
        await self.sandbox.restore(c.checkpoint)
        return c

    async def close(self, *, keep: Iterable[Cell | Checkpoint | str] = ()) -> None:
        """As GoExplore.close, awaited."""
        if self._closed:
            return
        self._closed = True
        await self._release(self.archive.release_all(keep))

    async def __aenter__(self) -> AsyncGoExplore:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _explore(self, limit: int | None) -> None:
        actions = await _maybe_await(self.policy(self.sandbox))
        if actions is None or limit == 0:
            return
        n = 0
        async for a in _aiter(actions):
            r = await self.sandbox.step(a)
            n += 1
            if r.step.terminated or r.step.truncated or (limit is not None and n >= limit):
                return

    async def _checkpoint(self) -> Checkpoint:
        ck = await self.sandbox.checkpoint(wait_for_digest=self._cell_fn is None, dedupe=self.dedupe)
        self.archive.took(ck)
        return ck

    async def _score(self) -> float:
        if self._score_fn is None:
            return (await self.sandbox.evaluate()).reward
        return float(await _maybe_await(self._score_fn(self.sandbox)))

    async def _cell(self, ck: Checkpoint) -> Hashable:
        if self._cell_fn is None:
            return self._key(ck)
        key: Hashable = await _maybe_await(self._cell_fn(self.sandbox))
        return key

    async def _release(self, ids: Iterable[str]) -> None:
        for id in ids:
            await self.sandbox.client.release_checkpoint(id)

    async def _report(self, episode_id: str, score: float) -> None:
        if not self._reportable(score):
            return
        try:
            await self.sandbox.client.report_reward(episode_id, SCORE_REWARD, score, source=SCORE_SOURCE)
        except DeltagymError as e:
            if e.reason != "LEDGER_DISABLED":
                raise
            self.report_scores = False  # a server without a ledger takes no reward


async def _aiter(actions: Iterable[Action] | AsyncIterable[Action]) -> AsyncIterator[Action]:
    if isinstance(actions, AsyncIterable):
        async for a in actions:
            yield a
    else:
        for a in actions:
            yield a


# The typing of a policy, for those who annotate theirs.
Policy = Callable[["Sandbox"], Iterable[Action] | None]
"""A GoExplore policy: from the sandbox at a restored state, the actions to take, or None when it took its steps itself."""
AsyncPolicy = Callable[["AsyncSandbox"], Awaitable[Iterable[Action] | AsyncIterable[Action] | None]
                       | Iterable[Action] | AsyncIterable[Action] | None]
"""An AsyncGoExplore policy: as Policy, a coroutine function or not, whose actions may come as an async iterable."""
