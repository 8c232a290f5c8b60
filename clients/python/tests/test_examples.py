"""The examples run as programs against the fixture's server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
