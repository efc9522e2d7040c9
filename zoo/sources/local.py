"""Local paths: adapter directories, single files, and directories of many adapters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from zoo.formats.peft import is_peft_dir

ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".zip")  # .zip: a zipped PEFT directory


def expand_paths(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """One (source, relative name) per adapter to ingest, in a stable order.

    A PEFT directory or a file is itself one source, named by its own name; any other directory is
    searched recursively for PEFT directories and weight files outside them, each named by its path
    relative to that directory. Directories reached twice (symlink loops, or a link to a folder
    already searched) are searched once. A path that does not exist (or a directory holding nothing
    readable) is kept, so that it is reported as failed.
    """
    out: dict[Path, str] = {}
    for raw in paths:
        path = Path(raw)
        if not path.is_dir() or is_peft_dir(path):
            out.setdefault(path, path.name)
            continue
        found = _scan(path, set())
        for entry in found or [path]:
            out.setdefault(entry, entry.relative_to(path).as_posix() if found else path.name)
    return list(out.items())


def _scan(root: Path, seen: set[Path]) -> list[Path]:
    real = root.resolve()
    if real in seen:
        return []
    seen.add(real)
    found: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            found.extend([entry] if is_peft_dir(entry) else _scan(entry, seen))
        elif entry.suffix in ADAPTER_SUFFIXES:
            found.append(entry)
    return found
