"""A user's program that make python-wheel-test type-checks (mypy --strict) against the
installed wheel: without the package's py.typed marker mypy refuses the import, and the
names below come from the package's annotations and the generated messages' .pyi stubs."""

import deltagym
from deltagym import errors

version: str = deltagym.__version__


def env_names(client: deltagym.Client) -> list[str]:
    names: list[str] = [e.spec.name for e in client.list_envs()]
    return names


def is_missing(e: errors.DeltagymError) -> bool:
    return isinstance(e, errors.NotFound)
