"""The examples run as programs against the fixture's server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from deltagym import Client, env_service_pb2 as es

from .conftest import REPO

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The default image `make image` builds (Debian with python3 and git), which the fixture's own
# Busybox image is not.
DEBIAN = REPO / ".data/images/default/rootfs"


@pytest.mark.parametrize(("name", "needs_ledger"), [("grpo_group.py", True), ("mcts_search.py", False)])
def test_example(server, name, needs_ledger):
    if needs_ledger:
        server.require_ledger()
    env = {**os.environ, "DELTAGYM_ADDR": server.addr}
    p = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    if name == "grpo_group.py":
        assert "counted=8" in p.stdout and p.stdout.count("advantage=") == 8
    else:
        assert "answer '42' reward 1.0" in p.stdout


def test_staged_service_repair(server):
    """Under the same budget, a search that returns to whole checkpoints finishes the repair; one
    that restarts from the best state's git diff loses the database and cannot."""
    if not (DEBIAN / "usr/bin/python3").exists():
        pytest.skip(f"the default image is not built ({DEBIAN}; make image): the example needs its python3")
    name = f"debian-{uuid.uuid4().hex[:8]}"
    # The server reads images only below its import root; cp -a keeps the image's device nodes.
    subprocess.run(["cp", "-a", str(DEBIAN), str(server.data / "imports" / name)], check=True)
    with Client(server.addr) as c:
        c.import_image(name, name, format=es.IMAGE_FORMAT_ROOTFS_DIR)
    env = {**os.environ, "DELTAGYM_ADDR": server.addr}
    p = subprocess.run([sys.executable, str(EXAMPLES / "staged_service_repair.py"), "--image", name, "--trials", "2",
                        "--attempts", "50"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"git-diff restart: (\d+)/2 solved; full checkpoint: (\d+)/2 solved", p.stdout)
    assert m, p.stdout
    git_diff, full = int(m.group(1)), int(m.group(2))
    assert full > git_diff and full == 2, p.stdout
