"""Settings (zoo/config.py): every ZOO_* variable is declared there, read nowhere else, and listed in docs/settings.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoo import config
from zoo.config import VARIABLES, Variable

ROOT = Path(__file__).resolve().parents[1]
#: variables of the test suite itself, not of zoo
TEST_VARIABLES = {"ZOO_TEST_DATABASE_URL", "ZOO_SCREENSHOTS"}
NAME = re.compile(r"\bZOO_[A-Z0-9_]*[A-Z0-9]\b")


def _sources() -> list[Path]:
    return [p for d in ("zoo", "embed", "webapp") for p in sorted((ROOT / d).rglob("*.py"))]


def test_nothing_but_the_settings_reads_a_zoo_variable() -> None:
    reads = re.compile(r"(environ(\.get)?\s*[\(\[]|getenv\()\s*[\"']ZOO_")
    readers = [str(p.relative_to(ROOT)) for p in _sources() if reads.search(p.read_text())]
    assert readers == []  # zoo/config.py reads each by its declared name


def test_every_variable_named_is_declared_and_documented() -> None:
    declared = {v.name for v in VARIABLES}
    assert len(declared) == len(VARIABLES)
    texts = [p.read_text() for p in [*_sources(), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    named = {m for text in texts for m in NAME.findall(text)} - TEST_VARIABLES
    assert named <= declared, f"named but not declared in zoo/config.py: {sorted(named - declared)}"
    listed = re.findall(r"^\| `(ZOO_[A-Z0-9_]+)` \| ([^|]+) \|", (ROOT / "docs" / "settings.md").read_text(), re.M)
    assert [name for name, _ in listed] == [v.name for v in VARIABLES]
    for (_, shown), v in zip(listed, VARIABLES, strict=True):
        default = ("1" if v.default else "0") if isinstance(v.default, bool) else str(v.default) or "none"
        assert shown.split()[0] == default, v.name


@given(st.integers(0, 2**40))
def test_a_number_is_read_back(value: int) -> None:
    variable = Variable("ZOO_X", 7, "a number")
    assert variable.get({"ZOO_X": str(value)}) == value and variable.get({"ZOO_X": value}) == value
    assert Variable("ZOO_X", 1.5, "seconds").get({"ZOO_X": str(value)}) == float(value)


def test_defaults_overrides_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOO_MAX_RANK", "")
    assert config.MAX_RANK.get() == 4096  # empty is unset
    monkeypatch.setenv("ZOO_MAX_RANK", "12")
    assert config.MAX_RANK.get() == 12 and config.MAX_RANK.get({"ZOO_MAX_RANK": 3}) == 3  # a config key wins
    monkeypatch.setenv("ZOO_MAX_RANK", "lots")
    with pytest.raises(ValueError, match="ZOO_MAX_RANK='lots' is not int"):
        config.MAX_RANK.get()
    for raw, on in (("1", True), ("true", True), ("YES", True), ("0", False), ("no", False)):
        monkeypatch.setenv("ZOO_READ_TOKEN_REQUIRED", raw)
        assert config.READ_TOKEN_REQUIRED.get() is on
