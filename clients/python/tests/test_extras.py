"""The SDK works without Gymnasium; deltagym.gym says how to get it."""

from __future__ import annotations

import subprocess
import sys


def test_core_without_gymnasium():
    # A None entry in sys.modules makes "import gymnasium" fail as if it were not installed.
    code = (
        "import sys; sys.modules['gymnasium'] = None\n"
        "import deltagym, deltagym.grpo, deltagym.tree, deltagym.aio\n"
        "try:\n"
        "    import deltagym.gym\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert 'pip install "deltagym[gym]"' in out and '"./clients/python[gym]" from a checkout' in out
