"""Errors that name the file and the reason, for users to act on."""

from __future__ import annotations

from pathlib import Path


class ZooError(Exception):
    """Base class of errors zoo reports to users (no traceback needed)."""


class InputError(ZooError):
    """A file or directory that cannot be read as an adapter; nothing is stored for it."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")
