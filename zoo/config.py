"""Every setting zoo reads from the environment (a ZOO_* variable, here and nowhere else), and where zoo keeps its
data: one data directory and one database URL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T", int, float, str, bool)


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One ZOO_* setting, read at each use (so a test or `zoo serve` may set it at run time); unset or empty, it
    is `default` ("" for a string: none)."""

    name: str
    default: T
    meaning: str

    def get(self, overrides: Mapping[str, object] | None = None) -> T:
        """Its value: from `overrides` (the web app's config keys), else the environment, else the default."""
        raw = overrides.get(self.name) if overrides and self.name in overrides else os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if isinstance(self.default, bool):
            return str(raw).lower() in ("1", "true", "yes")
        try:
            return type(self.default)(str(raw))
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not {type(self.default).__name__}: {self.meaning}") from None


DATA_DIR = Variable("ZOO_DATA_DIR", "", "the data directory (blobs, indexes, maps; the SQLite file); default $XDG_DATA_HOME/zoo")
DATABASE_URL = Variable("ZOO_DATABASE_URL", "", "the database (postgresql://... or sqlite:///...); default SQLite in the data directory")
MAX_RANK = Variable("ZOO_MAX_RANK", 4096, "the largest LoRA rank accepted")
MAX_MODULES = Variable("ZOO_MAX_MODULES", 4096, "the most modules in one source")
MAX_MODULE_WIDTH = Variable("ZOO_MAX_MODULE_WIDTH", 1 << 19, "the widest side of a module (any tensor of two or more dimensions)")
MAX_HEADER_BYTES = Variable("ZOO_MAX_HEADER_BYTES", 16 << 20, "the largest safetensors JSON header accepted")
MAX_FILE_BYTES = Variable("ZOO_MAX_FILE_BYTES", 4 << 30, "the largest weight file accepted")
STREAM_MIN_BYTES = Variable("ZOO_STREAM_MIN_BYTES", 256 << 20, "safetensors files at least this large are streamed, not held")
MAX_HEAD_BYTES = Variable("ZOO_MAX_HEAD_BYTES", 64 << 20, "the largest PEFT head (its tensors that are not LoRA factors) stored")
HUB_MAX_WAIT_S = Variable("ZOO_HUB_MAX_WAIT_S", 120.0, "seconds one source spends retrying a rate-limited or failing Hub")
JOB_LEASE_S = Variable("ZOO_JOB_LEASE_S", 60.0, "seconds a claimed job item is held without a heartbeat")
FACET_EXACT_ROWS = Variable("ZOO_FACET_EXACT_ROWS", 10_000, "matching adapters up to which catalog facets are counted exactly")
PROBE_CACHE_BYTES = Variable("ZOO_PROBE_CACHE_BYTES", 512 << 20, "bytes of random probes kept for module sketches")
MODULE_STORE_BYTES = Variable("ZOO_MODULE_STORE_BYTES", 2 << 30, "bytes the module store of one space may take")
SPACES_BYTES = Variable("ZOO_SPACES_BYTES", 4 << 30, "bytes the spaces one engine holds loaded may take together")
EMBED_CHUNK_BYTES = Variable("ZOO_EMBED_CHUNK_BYTES", 512 << 20, "bytes of factors read from the blob store at a time when embedding")
RELATION_SAMPLE_BYTES = Variable(
    "ZOO_RELATION_SAMPLE_BYTES", 16 << 20, "bytes (float64) of an adapter's modules the relation step compares; a larger one is sampled"
)
MALLOC_TRIM = Variable("ZOO_MALLOC_TRIM", True, "return freed heap memory to the system after large work (0: off)")
IMPORT_ROOT = Variable("ZOO_IMPORT_ROOT", "", "the directory `POST /api/v1/ingest` may name paths under (none: paths are refused)")
MAX_UPLOAD_BYTES = Variable("ZOO_MAX_UPLOAD_BYTES", 256 << 20, "uploads larger than this are refused with 413")
READ_TOKEN_REQUIRED = Variable("ZOO_READ_TOKEN_REQUIRED", False, "read endpoints need an API token too")
MAX_LABELS = Variable("ZOO_MAX_LABELS", 64, "given labels and test measurements one adapter may have, together")
MAX_LABEL_KEY_CHARS = Variable("ZOO_MAX_LABEL_KEY_CHARS", 128, "the longest label or measurement key (at most 128, the column's width)")
MAX_LABEL_VALUE_CHARS = Variable("ZOO_MAX_LABEL_VALUE_CHARS", 1000, "the longest label value")
MAX_LABEL_BYTES = Variable("ZOO_MAX_LABEL_BYTES", 16 << 10, "UTF-8 bytes of one adapter's labels and measurements, keys and values")
TIME_LIMIT_S = Variable("ZOO_TIME_LIMIT_S", 60.0, "seconds an expensive web call (an upload, a prediction) may take")
CALL_WORKERS = Variable("ZOO_CALL_WORKERS", 2, "threads for expensive web calls, per process")
CALL_QUEUE = Variable("ZOO_CALL_QUEUE", 2, "expensive web calls that may wait for a thread; more are refused with 503")
WEB_JOBS = Variable("ZOO_WEB_JOBS", True, "the web app works on the ingestion jobs it queues (0: it leaves them to `zoo worker`)")
HEADER_TIMEOUT_S = Variable("ZOO_HEADER_TIMEOUT_S", 5.0, "seconds a client has to send a request's headers")
BODY_TIMEOUT_S = Variable("ZOO_BODY_TIMEOUT_S", 120.0, "seconds a client has to send a request's body")
IO_TIMEOUT_S = Variable("ZOO_IO_TIMEOUT_S", 30.0, "seconds one socket read or write may take")
WORKER_CLASS = Variable("ZOO_WORKER_CLASS", "webapp.serve.ZooThreadWorker", "gunicorn's worker class for `zoo serve`")
WORKER_CONNECTIONS = Variable("ZOO_WORKER_CONNECTIONS", 1000, "connections one `zoo serve` worker holds at most")
LOG_FORMAT = Variable("ZOO_LOG_FORMAT", "", "json: log lines as JSON objects with the request id (`zoo serve`, `zoo worker`); else text")
TRUST_REQUEST_ID = Variable("ZOO_TRUST_REQUEST_ID", False, "take a request id from the X-Request-ID header (behind a proxy that sets it)")
BLOB_URL = Variable("ZOO_BLOB_URL", "", "where blobs are kept: s3://bucket/prefix for S3-compatible object storage; none: the data dir")
S3_ENDPOINT_URL = Variable("ZOO_S3_ENDPOINT_URL", "", "the S3 endpoint (http://host:port); none: AWS's (credentials: AWS_* variables)")
S3_PART_BYTES = Variable("ZOO_S3_PART_BYTES", 8 << 20, "the size of one part of a multipart upload (at least 5 MiB)")
S3_MULTIPART_BYTES = Variable("ZOO_S3_MULTIPART_BYTES", 64 << 20, "blobs at least this large go up in parts; smaller, in one checked PUT")
S3_CONCURRENCY = Variable("ZOO_S3_CONCURRENCY", 4, "parts of one blob uploaded at once")
S3_UPLOADS = Variable("ZOO_S3_UPLOADS", 4, "blobs one ingest uploads at once (at least 2), while it works on the next adapters")
S3_MAX_ATTEMPTS = Variable("ZOO_S3_MAX_ATTEMPTS", 5, "attempts of one S3 request, with exponential backoff, before it fails")
S3_TIMEOUT_S = Variable("ZOO_S3_TIMEOUT_S", 30.0, "seconds to connect to the S3 endpoint, and to wait for one read from it")

#: every ZOO_* setting (docs/settings.md lists them)
VARIABLES: tuple[Variable[int] | Variable[float] | Variable[str] | Variable[bool], ...] = (
    DATA_DIR, DATABASE_URL, MAX_RANK, MAX_MODULES, MAX_MODULE_WIDTH, MAX_HEADER_BYTES, MAX_FILE_BYTES, STREAM_MIN_BYTES, MAX_HEAD_BYTES,
    HUB_MAX_WAIT_S, JOB_LEASE_S, FACET_EXACT_ROWS, PROBE_CACHE_BYTES, MODULE_STORE_BYTES, SPACES_BYTES, EMBED_CHUNK_BYTES,
    RELATION_SAMPLE_BYTES, MALLOC_TRIM, IMPORT_ROOT, MAX_UPLOAD_BYTES, READ_TOKEN_REQUIRED, MAX_LABELS, MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS, MAX_LABEL_BYTES, TIME_LIMIT_S, CALL_WORKERS, CALL_QUEUE, WEB_JOBS,
    HEADER_TIMEOUT_S, BODY_TIMEOUT_S, IO_TIMEOUT_S, WORKER_CLASS, WORKER_CONNECTIONS, LOG_FORMAT, TRUST_REQUEST_ID,
    BLOB_URL, S3_ENDPOINT_URL, S3_PART_BYTES, S3_MULTIPART_BYTES, S3_CONCURRENCY, S3_UPLOADS, S3_MAX_ATTEMPTS, S3_TIMEOUT_S,
)  # fmt: skip

#: full checkpoints stored as deltas: the fewest components keeping this share of each delta's energy ...
DEFAULT_ENERGY = 0.9
#: ... and at most this many
DEFAULT_MAX_RANK = 64


def default_data_dir() -> Path:
    if DATA_DIR.get():
        return Path(DATA_DIR.get()).expanduser()
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
    #: where blobs are kept (ZOO_BLOB_URL): "" for the data directory's blobs/, or s3://bucket/prefix
    blob_url: str = ""

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @classmethod
    def load(cls, database_url: str | None = None, data_dir: str | Path | None = None, blob_url: str | None = None) -> Settings:
        """Explicit arguments win over ZOO_DATABASE_URL / ZOO_DATA_DIR / ZOO_BLOB_URL, which win over defaults."""
        ddir = Path(data_dir).expanduser() if data_dir else default_data_dir()
        url = database_url or DATABASE_URL.get() or f"sqlite:///{ddir / 'zoo.db'}"
        return cls(data_dir=ddir, database_url=normalize_database_url(url), blob_url=blob_url or BLOB_URL.get())
