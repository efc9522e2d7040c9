"""Local paths: adapter directories, single files, and directories of many adapters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from zoo.formats.peft import is_peft_dir

ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".zip")  # .zip: a zipped PEFT directory


def expand_paths(paths: Iterable[str | Path], root: Path | None = None) -> list[tuple[Path, str]]:
    """One (source, relative name) per adapter to ingest, in a stable order.

    A PEFT directory or a file is itself one source, named by its own name; any other directory is
    searched recursively for PEFT directories and weight files outside them, each named by its path
    relative to that directory. Directories reached twice (symlink loops, or a link to a folder
    already searched) are searched once. A path that does not exist (or a directory holding nothing
    readable) is kept, so that it is reported as failed.

    With a `root` (resolved), nothing that resolves outside it is walked or returned: see `expand_under`,
    which also says what it left out and why.
    """
    return expand_under(root, paths)[0] if root is not None else _expand(paths, None, [])


def expand_under(root: Path, paths: Iterable[str | Path]) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """`expand_paths` confined to `root` (an import root, resolved): (sources, refused). An entry whose real
    path lies outside the root (a symlink to a file or directory elsewhere, or a PEFT directory holding
    one) is not walked or read: it is refused, with its reason, instead of being returned."""
    refused: list[tuple[Path, str]] = []
    return _expand(paths, root, refused), refused


def escapes(path: Path, root: Path) -> str | None:
    """Why reading `path` would leave `root` (resolved), or None when it and, for a PEFT directory, every
    file in it resolve inside the root."""
    if not path.resolve().is_relative_to(root):
        return f"{path}: resolves outside the import root (a symbolic link?): not read"
    if is_peft_dir(path):
        for entry in sorted(path.iterdir()):
            if not entry.resolve().is_relative_to(root):
                return f"{path}: {entry.name} resolves outside the import root (a symbolic link?): not read"
    return None


def _expand(paths: Iterable[str | Path], root: Path | None, refused: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    out: dict[Path, str] = {}
    for raw in paths:
        path = Path(raw)
        reason = escapes(path, root) if root is not None else None
        if reason is not None:
            refused.append((path, reason))
            continue
        if not path.is_dir() or is_peft_dir(path):
            out.setdefault(path, path.name)
            continue
        found = _scan(path, set(), root, refused)
        for entry in found or [path]:
            out.setdefault(entry, entry.relative_to(path).as_posix() if found else path.name)
    return list(out.items())


def _scan(directory: Path, seen: set[Path], root: Path | None, refused: list[tuple[Path, str]]) -> list[Path]:
    real = directory.resolve()
    if real in seen:
        return []
    seen.add(real)
    found: list[Path] = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        is_dir = entry.is_dir()
        if not is_dir and entry.suffix not in ADAPTER_SUFFIXES:
            continue
        reason = escapes(entry, root) if root is not None else None
        if reason is not None:
            refused.append((entry, reason))
        elif is_dir:
            found.extend([entry] if is_peft_dir(entry) else _scan(entry, seen, root, refused))
        else:
            found.append(entry)
    return found
