"""A stored adapter's weight file read back from where it was ingested.

Only an adapter's LoRA factors are stored (canonical, in the blob store); the file's other tensors (a classifier
head, PEFT's modules_to_save) are recorded by name and shape only. An export that needs them reads the source
itself: the local path it was ingested from, or the Hub cache at the commit it was pinned to. The file is used only
when its SHA-256 is the one recorded at ingest, so that an export never writes tensors other than those ingested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.errors import InputError
from zoo.formats import open_adapter
from zoo.formats.peft import is_peft_dir
from zoo.formats.safe_load import SAFETENSORS_SUFFIX, parse_tensors
from zoo.sources import hub

#: single files looked at in a source folder that is not a PEFT directory (a Hub snapshot of a single-file LoRA)
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class SourceFile:
    """The tensors of a source's weight file, by their names in the file, and where it was found."""

    path: Path
    tensors: dict[str, torch.Tensor]


def read_source(uri: str, revision: str | None, sha256: str) -> SourceFile | None:
    """The weight file an adapter was ingested from (`uri`, `revision`: its recorded source), or None when it is no
    longer where it was, is unreadable, or its bytes are not those ingested (another SHA-256)."""
    where = hub.cached_path(uri, revision or "") if hub.is_hub_source(uri) else Path(uri)
    if where is None or not sha256:
        return None
    for path in _candidates(where):
        try:
            raw = open_adapter(path)
            if raw.weights.sha256 != sha256:
                continue
            tensors, _ = parse_tensors(raw.weights)
        except (InputError, OSError):
            continue
        return SourceFile(raw.path, tensors)
    return None


def _candidates(where: Path) -> list[Path]:
    """What to open at a source's path: itself, or the .safetensors files of a folder that is not a PEFT directory."""
    try:
        if where.is_dir() and not is_peft_dir(where):
            return sorted(p for p in where.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file())[:MAX_CANDIDATES]
        return [where] if where.is_file() or is_peft_dir(where) else []  # a regular file: never a device or a pipe
    except OSError:
        return []
