"""Local paths: adapter directories, single files, and directories of many adapters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from zoo.formats.peft import is_peft_dir

ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """One entry per adapter to ingest, in a stable order.

    A PEFT directory or a file is itself one source; any other directory is searched
    recursively for PEFT directories and weight files outside them. A path that does not
    exist (or a directory holding nothing readable) is kept, so that it is reported as failed.
    """
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir() or is_peft_dir(path):
            out.append(path)
            continue
        found = _scan(path)
        out.extend(found or [path])
    return list(dict.fromkeys(out))


def _scan(root: Path) -> list[Path]:
    found: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            found.extend([entry] if is_peft_dir(entry) else _scan(entry))
        elif entry.suffix in ADAPTER_SUFFIXES:
            found.append(entry)
    return found
