"""A stored adapter's weight file read back from where it was ingested.

Ingest stores what an export needs besides the canonical factors (zoo/services/file_parts.py: a PEFT head, conv
kernels); an adapter stored before it did has only the names and shapes of its head's tensors. An export of such an
adapter reads them from its source: the local path it was ingested from, or the Hub cache at the commit it was pinned
to. The file is used only when its SHA-256 is the one recorded at ingest, so that an export never writes tensors
other than those ingested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zoo.errors import InputError
from zoo.formats import RawAdapter, open_adapter
from zoo.formats.peft import is_peft_dir
from zoo.formats.safe_load import SAFETENSORS_SUFFIX
from zoo.sources import hub

#: single files looked at in a source folder that is not a PEFT directory (a Hub snapshot of a single-file LoRA)
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class SourceFile:
    """A source's files as read, and where they were found."""

    path: Path
    raw: RawAdapter


def read_source(uri: str, revision: str | None, sha256: str) -> SourceFile | None:
    """The weight file an adapter was ingested from (`uri`, `revision`: its recorded source), or None when it is no
    longer where it was, is unreadable, or its bytes are not those ingested (another SHA-256)."""
    where = hub.cached_path(uri, revision or "") if hub.is_hub_source(uri) else Path(uri)
    if where is None or not sha256:
        return None
    for path in _candidates(where):
        try:
            raw = open_adapter(path)
        except (InputError, OSError):
            continue
        if raw.weights.sha256 == sha256:
            return SourceFile(raw.path, raw)
    return None


def _candidates(where: Path) -> list[Path]:
    """What to open at a source's path: itself, or the .safetensors files of a folder that is not a PEFT directory."""
    try:
        if where.is_dir() and not is_peft_dir(where):
            return sorted(p for p in where.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file())[:MAX_CANDIDATES]
        return [where] if where.is_file() or is_peft_dir(where) else []  # a regular file: never a device or a pipe
    except OSError:
        return []
