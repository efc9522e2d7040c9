"""The ingest pipeline: read → canonicalize → describe → store, one transaction per adapter."""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from zoo.blobs import BlobStore
from zoo.canonical import CanonicalFactors, canonicalize_batched
from zoo.db import repository
from zoo.db.catalog import refresh_search_text
from zoo.db.models import Adapter, EmbeddingSpace, Label, Module
from zoo.db.session import write_transaction
from zoo.errors import InputError
from zoo.fingerprint import DUPLICATE_RTOL, canonical_hash, fingerprint, relative_distance, structure_hash
from zoo.formats import (
    DEFAULT_ENERGY,
    DEFAULT_MAX_RANK,
    AdapterData,
    LoraModule,
    layer_index,
    module_type,
    read_adapter,
)
from zoo.formats.limits import MAX_ADAPTER_NAME
from zoo.labels import LabelRow, source_labels
from zoo.sources import Origin
from zoo.spectra import Spectrum, matrix_spectrum, spectrum_from_singular_values

UNKNOWN_BASE = "unknown"


@dataclass(frozen=True)
class IngestOptions:
    base_model: str | None = None  # overrides what the files say
    base_checkpoint: Path | None = None  # for full checkpoints: deltas against this
    energy: float = DEFAULT_ENERGY
    max_rank: int = DEFAULT_MAX_RANK
    device: str | None = None  # default: cuda when available, else cpu


@dataclass
class IngestResult:
    source: str
    status: str  # ingested | duplicate | failed
    adapter_id: int | None = None
    canonical_hash: str | None = None
    error: str | None = None
    name: str | None = None
    notes: list[str] = field(default_factory=list)
    #: seconds spent in each stage (read, describe, store), for job statistics and bench.ingest
    timings: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def canonicalize_modules(modules: list[LoraModule], device: torch.device) -> list[CanonicalFactors]:
    """Canonical factors of every module, batched by rank, returned on the CPU in input order."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(modules):
        groups[m.rank].append(i)
    out: list[CanonicalFactors | None] = [None] * len(modules)
    for idx in groups.values():
        As = [modules[i].A.to(device) for i in idx]
        Bs = [modules[i].B.to(device) for i in idx]
        scale = [modules[i].scale for i in idx]
        for i, f in zip(idx, canonicalize_batched(As, Bs, scale), strict=True):
            out[i] = CanonicalFactors(f.U.cpu(), f.S.cpu(), f.V.cpu())
    return [f for f in out if f is not None]


def file_digest(paths: Iterable[Path]) -> tuple[str, int]:
    """SHA-256 and total size of the weight files."""
    h = hashlib.sha256()
    size = 0
    for p in paths:
        with p.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
    return h.hexdigest(), size


def _module_row(name: str, kind: str, shape: tuple[int, int], spec: Spectrum, **extra: object) -> Module:
    return Module(
        name=name,
        layer_index=layer_index(name),
        module_type=module_type(name),
        kind=kind,
        out_features=shape[0],
        in_features=shape[1],
        singular_values=spec.singular_values,
        spectral_norm=spec.spectral_norm,
        frobenius_norm=spec.frobenius_norm,
        stable_rank=spec.stable_rank,
        effective_rank=spec.effective_rank,
        power_law_alpha=spec.power_law_alpha,
        power_law_xmin=spec.power_law_xmin,
        power_law_ks=spec.power_law_ks,
        **extra,
    )


@dataclass
class _Described:
    """An adapter ready to store: rows to write and, for LoRA-like updates, its canonical factors."""

    adapter: Adapter
    factors: list[tuple[str, CanonicalFactors]]


def describe(data: AdapterData, source_uri: str, options: IngestOptions, device: torch.device) -> _Described:
    """Canonicalize, compute spectra and hashes; no database access."""
    sha, size = file_digest(data.weight_files)
    base_model = options.base_model or data.base_model or UNKNOWN_BASE
    factors: list[tuple[str, CanonicalFactors]] = []
    rows: list[Module] = []
    if data.modules:
        canon = canonicalize_modules(data.modules, device)
        for m, f in zip(data.modules, canon, strict=True):
            factors.append((m.name, f))
            rows.append(
                _module_row(
                    m.name,
                    m.kind,
                    (int(f.U.shape[0]), int(f.V.shape[0])),
                    spectrum_from_singular_values(f.S.numpy()),
                    rank=m.rank,
                    canonical_rank=f.rank,
                    alpha=m.alpha,
                    scale=m.scale,
                    transposed=m.transposed,
                )
            )
        shapes = [(n, int(f.U.shape[0]), int(f.V.shape[0])) for n, f in factors]
        chash = canonical_hash(factors)
        _, norm = fingerprint(factors)
        dw_norm: float | None = norm
    else:
        for fm in data.full_matrices:
            rows.append(_module_row(fm.name, "full", (int(fm.weight.shape[0]), int(fm.weight.shape[1])), matrix_spectrum(fm.weight)))
        shapes = [(fm.name, int(fm.weight.shape[0]), int(fm.weight.shape[1])) for fm in data.full_matrices]
        chash, dw_norm = sha, None  # nothing to canonicalize: identical files are the duplicates
    config = data.config
    adapter = Adapter(
        name=(data.path.stem if data.path.is_file() else data.path.name)[:MAX_ADAPTER_NAME],
        source_uri=source_uri,
        base_model=base_model,
        format=data.format,
        rank=config.get("r"),
        alpha=config.get("lora_alpha"),
        target_modules=config.get("target_modules"),
        task_type=config.get("task_type"),
        canonical_hash=chash,
        structure_hash=structure_hash(shapes),
        dw_norm=dw_norm,
        file_sha256=sha,
        size_bytes=size,
        config=config,
        file_metadata=data.metadata,
        extra_tensors=data.extra_tensors,
        notes=data.notes,
        modules=rows,
    )
    return _Described(adapter, factors)


class Ingestor:
    """Ingests sources one at a time into one database and blob store."""

    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, options: IngestOptions | None = None) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.options = options or IngestOptions()
        self.device = pick_device(self.options.device)

    def ingest(
        self, path: Path, source_uri: str | None = None, labels: LabelRow | None = None, origin: Origin | None = None
    ) -> IngestResult:
        """Ingest one source (and attach its given labels; `origin`: what its source says about it, stored
        on the row). Whatever goes wrong becomes a failed result naming the file and the reason, never an
        exception: bad input, a reader's unexpected error (its type is in the reason), a database that
        stays busy."""
        source = source_uri or (origin.uri if origin else str(path))
        timings: dict[str, float] = {}
        t = time.perf_counter()
        try:
            data = read_adapter(path, self.options.base_checkpoint, self.options.energy, self.options.max_rank)
            timings["read"], t = time.perf_counter() - t, time.perf_counter()
            described = describe(data, source, self.options, self.device)
            if origin is not None:
                apply_origin(described.adapter, origin, labels)
            timings["describe"], t = time.perf_counter() - t, time.perf_counter()
        except InputError as exc:
            return IngestResult(source, "failed", error=str(exc), timings=timings)
        except Exception as exc:  # noqa: BLE001 - a batch goes on past any one file
            return IngestResult(source, "failed", error=f"{path}: {type(exc).__name__}: {_first_line(exc)}", timings=timings)
        try:
            result = self._store_with_retries(described, labels)
        except InputError as exc:
            return IngestResult(source, "failed", error=str(exc), timings=timings)
        except SQLAlchemyError as exc:
            error = f"{path}: database error ({type(exc).__name__}: {_first_line(exc.orig or exc)})"
            return IngestResult(source, "failed", error=error, timings=timings)
        timings["store"] = time.perf_counter() - t
        result.source = source
        result.notes = list(data.notes)
        result.timings = timings
        return result

    def ingest_many(self, paths: Iterable[Path], labels: dict[Path, LabelRow] | None = None) -> Iterator[IngestResult]:
        """Every path in turn, each in its own transaction, with its labels (see zoo.labels.assign_rows) if any."""
        for p in paths:
            yield self.ingest(p, labels=(labels or {}).get(p))

    def _find_duplicate(self, session: Session, d: _Described) -> Adapter | None:
        a = d.adapter
        same = repository.by_canonical_hash(session, a.base_model, a.canonical_hash)
        if same is not None or a.dw_norm is None:
            return same
        for cand in repository.near_duplicates(session, a.base_model, a.structure_hash, a.dw_norm, DUPLICATE_RTOL):
            if cand.factors_blob and relative_distance(d.factors, self.blobs.get_factors(cand.factors_blob)) <= DUPLICATE_RTOL:
                return cand
        return None

    def _store_with_retries(self, d: _Described, labels: LabelRow | None, attempts: int = 3) -> IngestResult:
        """`_store`, again when a concurrent writer stored the same update first (the unique constraint
        fired: the next attempt finds it and reports a duplicate, with the labels attached) or when a
        SQLite database stayed locked past its busy timeout."""
        for _ in range(attempts - 1):
            try:
                return self._store(d, labels)
            except IntegrityError:
                continue
            except OperationalError as exc:
                if "locked" not in str(exc.orig):
                    raise
        return self._store(d, labels)

    def _store(self, d: _Described, labels: LabelRow | None) -> IngestResult:
        """One transaction (rows, labels and the search document), serialized per (base model, structure)
        so that the duplicate check sees every earlier writer's update. The blob is written (idempotently, by content) after the rows are
        inserted and before they commit, and is never deleted here: a committed row always has its blob; a blob left by a transaction
        that failed is an orphan for `zoo check --repair`."""
        a = d.adapter
        with write_transaction(self.sessions, f"ingest:{a.base_model}:{a.structure_hash}") as session:
            check_space_fits(session, a)
            dup = self._find_duplicate(session, d)
            if dup is None:
                blob = self.blobs.encode_factors(d.factors) if d.factors else None
                a.factors_blob = blob[0] if blob else None
                session.add(a)
                session.flush()  # a database failure here leaves neither rows nor a blob
                if blob:
                    self.blobs.write(*blob)
            if labels is not None:
                repository.replace_labels(session, (dup or a).id, labels.attributes, labels.measurements)
            if dup is None or labels is not None:
                session.flush()
                refresh_search_text(session, [(dup or a).id])
            if dup is None:
                return IngestResult(a.source_uri, "ingested", a.id, a.canonical_hash, name=a.name)
            return IngestResult(a.source_uri, "duplicate", dup.id, dup.canonical_hash, name=a.name)


def apply_origin(a: Adapter, origin: Origin, labels: LabelRow | None = None) -> None:
    """Copy what the source said onto the adapter row, with the given labels it implies (zoo.labels.source_labels:
    stored with a new adapter only, never over a stored one's)."""
    a.source_uri, a.source_revision, a.author = origin.uri, origin.revision, origin.author
    a.license, a.tags, a.card = origin.license, list(origin.tags) or None, origin.card
    a.source_metadata = dict(origin.metadata)
    a.labels = [Label(key=k, value=v, source="given") for k, v in source_labels(origin.metadata, labels).items()]


def check_space_fits(session: Session, a: Adapter) -> None:
    """Refuse an adapter whose module shapes conflict with the embedding space of its base model (it
    would break embedding and training for the whole space)."""
    schema = session.scalars(select(EmbeddingSpace.schema).where(EmbeddingSpace.base_model == a.base_model)).first()
    if not schema or not a.modules:
        return
    known = {str(n): (int(o), int(i)) for n, o, i in schema["modules"]}
    for m in a.modules:
        want = known.get(m.name)
        if want is not None and want != (m.out_features, m.in_features):
            raise InputError(
                a.source_uri,
                f"module {m.name} is {m.out_features}×{m.in_features} but {want[0]}×{want[1]} in the space of base model "
                f"{a.base_model!r}: not an adapter of that base (pass --base-model to store it elsewhere)",
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
