"""Files with one job: no module of the product is over 500 lines (a longer one is doing more than one thing)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_no_module_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for package in ("zoo", "embed", "webapp")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
