"""The import rule: the contracts in pyproject.toml's [tool.importlinter] hold.

A layer imports only the layers below it (the command line over webapp, over the runners, the services, embed, storage,
sources, file readers and the math); the math imports no database, web or file library; serving does not import
training; migrations import nothing live; no cycles.
No import breaks the rule: the contracts list no exception (ignore_imports), and KNOWN_EXCEPTIONS keeps it so; an
exception that no longer matches an import would fail too (import-linter's unmatched_ignore_imports_alerting = "error").
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ignore_imports entries over all the contracts: none is left, and none may come back
KNOWN_EXCEPTIONS = 0


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept() -> None:
    script = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_known_exceptions_only_shrink() -> None:
    contracts = _contracts()
    exceptions = [i for c in contracts for i in c.get("ignore_imports", [])]
    assert len(exceptions) <= KNOWN_EXCEPTIONS, "a new upward import: fix it instead of listing it"
    # an exception that no longer matches an import fails the contracts, not just a warning
    assert all(c.get("unmatched_ignore_imports_alerting", "error") == "error" for c in contracts)
    # exact imports only: a wildcard could hide new upward imports
    assert all("*" not in i for i in exceptions)


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore is its module's own: another module that needs it gets a public name."""
    found = []
    for package in ("zoo", "embed", "webapp"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found += [
                        f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
    assert not found, found


PACKAGES = ("zoo", "embed", "webapp")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _private_names_of_packages() -> set[str]:
    """Every private name our packages define: module-level and class-level functions, classes and assignments, and the
    attributes their methods set on `self`."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def _defined_in(tree: ast.Module) -> set[str]:
    """The names a test or bench file defines itself (its own helpers' private attributes are its own)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) in ("self", "cls"):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
    return found


def private_names_reached(path: Path, ours: set[str]) -> list[str]:
    """Where a file reaches a private name of our packages: an import of one, an attribute of that name (on a module of
    ours or on one of our objects), or the name as a string (what monkeypatch.setattr and mock.patch.object take)."""
    tree = ast.parse(path.read_text(), str(path))
    own = _defined_in(tree)
    formatted = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}  # parts of f-strings
    reached = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            reached += [f"import {node.module}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in ours and node.attr not in own:
            reached.append(f"attribute {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in ours and node.value not in own and id(node) not in formatted:
            reached.append(f"string {node.value!r}")
    return [f"{path.relative_to(ROOT)}:{r}" for r in reached]


def test_tests_and_benchmarks_reach_no_private_name_of_our_packages() -> None:
    """Tests and benchmarks use what the packages offer: a piece they need is public, under a public name."""
    ours = _private_names_of_packages()
    found = [
        r for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py")) for r in private_names_reached(path, ours)
    ]
    assert not found, "\n".join(found)
