"""Where zoo keeps its data: one data directory and one database URL."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: full checkpoints stored as deltas: the fewest components keeping this share of each delta's energy ...
DEFAULT_ENERGY = 0.9
#: ... and at most this many
DEFAULT_MAX_RANK = 64


def default_data_dir() -> Path:
    if os.environ.get("ZOO_DATA_DIR"):
        return Path(os.environ["ZOO_DATA_DIR"]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "zoo"


def normalize_database_url(url: str) -> str:
    """Use psycopg 3 for plain postgresql:// URLs (SQLAlchemy would pick psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    database_url: str

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @classmethod
    def load(cls, database_url: str | None = None, data_dir: str | Path | None = None) -> Settings:
        """Explicit arguments win over ZOO_DATABASE_URL / ZOO_DATA_DIR, which win over defaults."""
        ddir = Path(data_dir).expanduser() if data_dir else default_data_dir()
        url = database_url or os.environ.get("ZOO_DATABASE_URL") or f"sqlite:///{ddir / 'zoo.db'}"
        return cls(data_dir=ddir, database_url=normalize_database_url(url))
