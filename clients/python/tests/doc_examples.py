"""The runnable example of a docs/integrations page: the ```python block of
its "## Example" section, which the page's test runs against the server."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[3] / "docs" / "integrations"


def example(page: str) -> str:
    text = (DOCS / page).read_text()
    section = text.split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"{page}: the Example section has {len(blocks)} python blocks, not one"
    return str(blocks[0])


def run_example(page: str) -> dict[str, object]:
    """Runs the page's example in a namespace of its own; returns it."""
    ns: dict[str, object] = {"__name__": f"docs.integrations.{page}"}
    exec(compile(example(page), str(DOCS / page), "exec"), ns)  # the repository's own docs
    return ns
