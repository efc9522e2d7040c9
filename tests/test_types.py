"""The type check: mypy, as pyproject.toml's [tool.mypy] sets it (zoo, embed and webapp; unused `# type: ignore`
comments are errors too), finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 45 s without mypy's cache (a fresh clone, CI), seconds with it
def test_mypy_finds_no_error() -> None:
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
