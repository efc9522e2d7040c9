"""The storage boundary: SQL lives in zoo/store (and migrations); every other module reaches the database through it.

pyproject.toml's import contract forbids `sqlalchemy` to a list of modules; this keeps that list complete, so a module
added to zoo/ later is under the rule too.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = "zoo.store"


def _boundary() -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "forbidden" and c["forbidden_modules"] == ["sqlalchemy"]]
    return contract


def test_every_module_but_the_store_is_under_the_sql_rule() -> None:
    modules = [p for p in (ROOT / "zoo").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    top = {f"zoo.{p.stem if p.is_file() else p.name}" for p in modules}
    expected = (top - {"zoo.__init__", "zoo.__main__", STORE}) | {"embed", "webapp"}
    assert set(_boundary()["source_modules"]) == expected


def test_no_module_outside_the_store_names_sqlalchemy() -> None:
    """Not even a type import: callers take `Session` and friends from zoo.store.session."""
    found = [
        str(path.relative_to(ROOT))
        for package in ("zoo", "embed", "webapp")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not path.is_relative_to(ROOT / "zoo" / "store") and "sqlalchemy" in path.read_text()
    ]
    assert not found, found
