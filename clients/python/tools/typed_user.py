"""A user's program that make python-wheel-test type-checks (mypy --strict) against the
installed wheel: without the package's py.typed marker mypy refuses the import, and the
names below come from the package's annotations and the generated messages' .pyi stubs."""

import deltagym
from deltagym import errors
from deltagym.search import Cell, GoExplore
from deltagym.types import CheckpointDiff, StateDigest

version: str = deltagym.__version__


def env_names(client: deltagym.Client) -> list[str]:
    names: list[str] = [e.spec.name for e in client.list_envs()]
    return names


def is_missing(e: errors.DeltagymError) -> bool:
    return isinstance(e, errors.NotFound)


def changed_lines(client: deltagym.Client, base: deltagym.Checkpoint, ck: str) -> int:
    diff: CheckpointDiff = client.diff_checkpoints(base, ck, detail="lines")
    return sum(p.lines_added + p.lines_removed for p in diff.paths)


def digest_of(sb: deltagym.Sandbox) -> StateDigest | None:
    return sb.checkpoint(wait_for_digest=True).digest


def search(sb: deltagym.Sandbox) -> float:
    with GoExplore(sb, lambda s: ["true"], cell=lambda s: s.files.read("/work/answer.txt")) as g:
        best: Cell = g.run(iterations=3)
        return best.score
