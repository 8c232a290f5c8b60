"""tools/check_dist.py's sdist check (make python-wheel-test runs it on the real sdist): what it
finds missing or wrong in a source distribution, on small ones made here."""

from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_dist.py"
COMPLETE = {
    "pyproject.toml": "",
    "PKG-INFO": "",
    "README.md": "# deltagym\n\nSee [the docs](https://example.com/docs) and [usage](#usage).\n",
    "deltagym/__init__.py": "",
    "deltagym/_version.py": "",
    "deltagym/py.typed": "",
    "deltagym/_proto/deltagym/v1/env_pb2.py": "",
    "deltagym/_proto/deltagym/v1/env_pb2.pyi": "",
}


@pytest.fixture(scope="module")
def check_dist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sdist(tmp_path: Path, files: dict[str, str], version: str = "1.2.3") -> str:
    path = tmp_path / f"deltagym-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"deltagym-{version}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def test_complete(check_dist: ModuleType, tmp_path: Path) -> None:
    assert check_dist.check_sdist(sdist(tmp_path, COMPLETE), "1.2.3") == []


@pytest.mark.parametrize(("change", "want"), [
    ({"deltagym/py.typed": None}, "no deltagym-1.2.3/deltagym/py.typed"),
    ({"deltagym/_version.py": None}, "no deltagym-1.2.3/deltagym/_version.py"),
    ({"deltagym/_proto/deltagym/v1/env_pb2.pyi": None}, "env_pb2.py has no type stub"),
    ({"deltagym/_proto/deltagym/v1/env_pb2.py": None, "deltagym/_proto/deltagym/v1/env_pb2.pyi": None},
     "no generated message modules"),
    ({"README.md": "See [operations](../../docs/OPERATIONS.md).\n"}, "links to '../../docs/OPERATIONS.md'"),
    ({"README.md": "![diagram](docs/diagram.png)\n"}, "links to 'docs/diagram.png'"),
])
def test_finds(check_dist: ModuleType, tmp_path: Path, change: dict[str, str | None], want: str) -> None:
    files = {k: v for k, v in {**COMPLETE, **change}.items() if v is not None}
    problems = check_dist.check_sdist(sdist(tmp_path, files), "1.2.3")
    assert len(problems) == 1, problems
    assert want in problems[0]


def test_other_version(check_dist: ModuleType, tmp_path: Path) -> None:
    """The sdist's top directory names the version: another version's sdist misses everything."""
    problems = check_dist.check_sdist(sdist(tmp_path, COMPLETE, version="1.2.4"), "1.2.3")
    assert "no deltagym-1.2.3/pyproject.toml" in problems[0]
