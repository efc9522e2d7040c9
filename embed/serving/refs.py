"""What a search or prediction asks about, typed at the door it came in by: a stored adapter's id, a file uploaded to
the web app, or a path on the command line's machine. A string is never guessed at deep inside (a query "42" read as
a file named 42 whenever the server's working directory held one): the web app builds only StoredId and
UploadedFile, so no request reads a path of its choosing, and the command line's rule (cli_ref) does not look at the
file system."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StoredId:
    """A stored adapter, by its id."""

    id: int

    @property
    def text(self) -> str:
        return str(self.id)


@dataclass(frozen=True)
class UploadedFile:
    """A file (or the directory of an upload's files) the web app received and laid out; read, never stored."""

    path: Path

    @property
    def text(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class LocalPath:
    """A path on the command line's machine, as the user wrote it; read, never stored."""

    path: str

    @property
    def text(self) -> str:
        return self.path


AdapterRef = StoredId | UploadedFile | LocalPath


def cli_ref(text: str) -> AdapterRef:
    """The command line's query argument: a bare run of ASCII digits is always a stored adapter's id, anything else is
    a path (a file named 1 is `./1`). Decided from the text alone, whatever files the working directory holds."""
    if text.isascii() and text.isdigit():
        return StoredId(int(text))
    return LocalPath(text)
