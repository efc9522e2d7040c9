"""Files that are replaced whole: a reader (or a process after a crash) sees the old file or the new one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

#: temporary files of unfinished writes start with this (`zoo check` finds those a crash left)
TMP_PREFIX = ".tmp-"


def replace_durably(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `target`, fsync it, rename it over `target` and fsync the
    directory, so that the rename itself survives a crash. A failed write leaves no temporary file."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX, suffix=target.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with tmp.open("rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
