"""The README's Quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _quickstart() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the Quickstart has a python block"
    return match.group(1)


def test_quickstart_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_quickstart(), "README.md", "exec"), {})
    # The per-step stats call prints what the comment beside it says.
    assert capsys.readouterr().out.split() == ["1", "100", "0", "0%"]
