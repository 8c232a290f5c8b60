"""Checks the SDK's distributions the way a user meets them (make python-wheel-test).

    check_dist.py sdist SDIST VERSION
        (any Python) the source distribution holds what a wheel is built from: the
        package, its generated messages with their .pyi stubs, py.typed, the README,
        whose links all work on PyPI's page (none is a path in the repository).
    check_dist.py installed VERSION [EXTRA]
        (the Python of a fresh venv holding the wheel and only its dependencies, run with
        -I so that the source tree is not on sys.path) every public module imports; a
        module that needs an extra fails with an ImportError that names it, as
        `pip install "deltagym[EXTRA]"` would give it. With EXTRA installed, the modules
        that named it import.

Exits 1 with a line per problem.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
import tarfile
from pathlib import Path, PurePosixPath

# The modules the SDK's documentation names: each must be in the wheel and import with the bare
# install, but for those that need an extra. Every other public module is found and checked too.
DOCUMENTED = ("deltagym", "deltagym.aio", "deltagym.errors", "deltagym.gym", "deltagym.raw", "deltagym.search",
              "deltagym.types")
NEEDS_EXTRA = {"deltagym.gym": "gym", "deltagym.gym_vector": "gym", "deltagym.integrations.skyrl": "skyrl"}
EXTRA_RE = re.compile(r"\[([a-z0-9][a-z0-9_.-]*)\]")
# A Markdown link or image whose target is a path: PyPI shows the README away from the
# repository, where such a target is not found.
RELATIVE_LINK_RE = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)")


def check_sdist(path: str, version: str) -> list[str]:
    problems = []
    root = PurePosixPath(f"deltagym-{version}")
    with tarfile.open(path) as tf:
        names = {PurePosixPath(n) for n in tf.getnames()}
        readme = tf.extractfile(str(root / "README.md")) if root / "README.md" in names else None
        text = readme.read().decode() if readme else ""
    problems += [f"README.md links to {t!r}, which PyPI's page cannot reach: link to the repository's URL instead"
                 for t in RELATIVE_LINK_RE.findall(text)]
    for want in ("pyproject.toml", "README.md", "PKG-INFO", "deltagym/__init__.py", "deltagym/_version.py",
                 "deltagym/py.typed"):
        if root / want not in names:
            problems.append(f"{path}: no {root / want}")
    problems += _stubs_missing({n.relative_to(root) for n in names if n.is_relative_to(root)}, path)
    return problems


def _stubs_missing(files: set[PurePosixPath], where: str) -> list[str]:
    """Every generated message module (*_pb2.py) needs its .pyi beside it."""
    pb2 = [f for f in files if f.name.endswith("_pb2.py")]
    if not pb2:
        return [f"{where}: no generated message modules (deltagym/_proto/**/*_pb2.py)"]
    return [f"{where}: {f} has no type stub {f.with_suffix('.pyi')}" for f in sorted(pb2) if f.with_suffix(".pyi") not in files]


def check_installed(version: str, extra: str) -> list[str]:
    problems = []
    dist = md.distribution("deltagym")
    import deltagym

    if "site-packages" not in (deltagym.__file__ or ""):
        problems.append(f"deltagym imports from {deltagym.__file__}, not from an installed wheel")
    if dist.version != version or deltagym.__version__ != version:
        problems.append(f"version: distribution {dist.version}, deltagym.__version__ {deltagym.__version__}, want {version}")
    # The files the wheel installed (its RECORD) that are still there.
    files = {PurePosixPath(str(f)) for f in dist.files or () if Path(str(dist.locate_file(f))).exists()}
    if PurePosixPath("deltagym/py.typed") not in files:
        problems.append("the wheel has no deltagym/py.typed: type checkers would ignore the package's annotations")
    problems += _stubs_missing(files, "wheel")
    extras = set(dist.metadata.get_all("Provides-Extra") or ())
    meta = dist.metadata.json
    if str(meta.get("description_content_type", "")).split(";")[0] != "text/markdown" or not meta.get("description"):
        problems.append("the package's description is not the Markdown README")

    modules = sorted(set(DOCUMENTED) | set(_public_modules(deltagym.__path__)))
    for name in modules:
        err = _import(name)
        if extra:
            if err is not None and NEEDS_EXTRA.get(name) == extra:
                problems.append(f"{name} does not import with the extra {extra!r} installed: {err!r}")
            continue
        if err is None:
            if name in NEEDS_EXTRA:
                problems.append(f"{name} imports without the extra {NEEDS_EXTRA[name]!r}: is the extra still needed?")
            continue
        named = set(EXTRA_RE.findall(str(err))) & extras
        if not isinstance(err, ImportError) or not named:
            problems.append(f"{name} does not import with the bare install, and its error names no extra of {sorted(extras)} "
                            f"(say: pip install \"deltagym[EXTRA]\"): {err!r}")
        elif name in NEEDS_EXTRA and NEEDS_EXTRA[name] not in named:
            problems.append(f"{name}'s ImportError names {sorted(named)}, want the extra {NEEDS_EXTRA[name]!r}: {err}")
    return problems


def _public_modules(path: list[str]) -> list[str]:
    # onerror: a package that fails to import is reported by the import below, with its error.
    found = pkgutil.walk_packages(path, "deltagym.", onerror=lambda _name: None)
    return [m.name for m in found if not any(part.startswith("_") for part in m.name.split("."))]


def _import(name: str) -> BaseException | None:
    try:
        importlib.import_module(name)
    except Exception as e:
        return e
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "sdist":
        problems = check_sdist(argv[1], argv[2])
    elif len(argv) in (2, 3) and argv[0] == "installed":
        problems = check_installed(argv[1], argv[2] if len(argv) == 3 else "")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(f"check_dist: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
