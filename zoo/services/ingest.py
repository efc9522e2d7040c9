"""The ingest pipeline: read → canonicalize → describe → store, one transaction per adapter."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK
from zoo.domain.base_models import guess_base_model
from zoo.domain.canonical import canonicalize_modules, pick_device
from zoo.domain.fingerprint import DUPLICATE_RTOL
from zoo.errors import InputError, UsageError
from zoo.formats import LORA_FORMATS, RawAdapter, adapter_name, open_adapter, parse_adapter
from zoo.labels import LabelRow
from zoo.services.describe import Described, ModuleRow, apply_origin, describe, kept_parts, resolve_base_model
from zoo.services.threads import one_torch_thread, small_work_on_one_thread
from zoo.services.turns import Turn, Turns
from zoo.sources import Origin, hub
from zoo.store import jobs, repository
from zoo.store.adapters import adapter_exists, insert_adapter, previous_version, space_schema, stored_revision
from zoo.store.blobs import BlobStore, BlobWriter, StagedBlob
from zoo.store.duplicates import stored_duplicate
from zoo.store.errors import DatabaseError, driver_message, retry_conflicts
from zoo.store.labels import write_labels
from zoo.store.locks import store_locks
from zoo.store.models import UNKNOWN_BASE, Adapter  # noqa: F401 - UNKNOWN_BASE: tests import it here
from zoo.store.session import Connection, Session, Sessions, autocommit_reads, write_transaction


@dataclass(frozen=True)
class IngestOptions:
    base_model: str | None = None  # overrides what the files say; with neither, it is guessed from the shapes
    base_checkpoint: Path | None = None  # for full checkpoints: deltas against this
    energy: float = DEFAULT_ENERGY
    max_rank: int = DEFAULT_MAX_RANK
    device: str | None = None  # default: cuda when available, else cpu


class StoredHead(TypedDict):
    """A head stored with an adapter: its tensors' names, their bytes and the blob holding them."""

    tensors: list[str]
    bytes: int
    blob: str


@dataclass
class IngestResult:
    source: str
    status: str  # ingested | duplicate | failed
    adapter_id: int | None = None
    canonical_hash: str | None = None
    error: str | None = None
    name: str | None = None
    #: a duplicate's stored adapter: its name (its id is adapter_id)
    duplicate_of: str | None = None
    notes: list[str] = field(default_factory=list)
    #: what the caller should hear of though the adapter was stored (a base model its shapes contradict)
    warnings: list[str] = field(default_factory=list)
    #: the commit a Hub source was pinned to
    revision: str | None = None
    #: seconds spent in each stage (read, canonicalize, describe, store), for job statistics and bench.ingest
    timings: dict[str, float] = field(default_factory=dict)
    #: the PEFT head stored with a new adapter (its tensors that are not LoRA factors: zoo.services.file_parts)
    head: StoredHead | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Ingestor:
    """Ingests sources one at a time into one database and blob store (or several at once through `ingest_sources`: one
    worked on while the ones before it upload their blobs and store, in order; zoo.services.turns).

    `record_duplicates_as`: a run that is not a job (`zoo ingest`) records each duplicate's source where a job
    records its own (zoo.store.jobs.record_duplicate, one job of the run's, named by this), in the transaction that
    found the duplicate; a job's worker leaves it None, as finishing the item records it."""

    def __init__(
        self,
        sessions: Sessions,
        blobs: BlobStore,
        options: IngestOptions | None = None,
        record_duplicates_as: str | None = None,
    ) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.options = options or IngestOptions()
        self.device = pick_device(self.options.device)
        self.record_duplicates_as = record_duplicates_as
        self.duplicates_job: int | None = None  # the run's job of duplicates, once one is committed
        self._turns = Turns()  # one source worked on at a time; stores one at a time, in the order of the turns

    def turn(self) -> Turn:
        """The next working turn (and its place in the store order), once the source before has done its work."""
        return self._turns.take()

    def ingest(
        self,
        path: Path,
        source_uri: str | None = None,
        labels: LabelRow | None = None,
        origin: Origin | None = None,
        turn: Turn | None = None,
    ) -> IngestResult:
        """Ingest one source (and attach its given labels; `origin`: what its source says about it, stored
        on the row). Whatever goes wrong becomes a failed result naming the file and the reason, never an
        exception: bad input, a reader's unexpected error (its type is in the reason), a database that
        stays busy.

        Files already stored are recognized before any math: when the weight file's SHA-256, the base model
        and the config values the update depends on match a stored adapter's, it is the duplicate (see
        `_stored_copy`). `timings` has seconds per stage: read, canonicalize, describe, store (which includes waiting for
        the blob's upload, and, several at a time, for the stores before it). `turn`: this source's working turn, taken by
        the caller (ingest_sources), else here; finished here, however the ingest ends."""
        source = source_uri or (origin.uri if origin else str(path))
        timings: dict[str, float] = {}
        turn = turn or self.turn()
        try:
            return self._ingest(Path(path), source, labels, origin, timings, turn)
        except InputError as exc:
            return IngestResult(source, "failed", error=str(exc), timings=timings)
        except DatabaseError as exc:
            error = f"{path}: database error ({type(exc).__name__}: {_first_line(driver_message(exc))})"
            return IngestResult(source, "failed", error=error, timings=timings)
        except Exception as exc:  # noqa: BLE001 - a batch goes on past any one file
            return IngestResult(source, "failed", error=f"{path}: {type(exc).__name__}: {_first_line(exc)}", timings=timings)
        finally:
            turn.finish()

    def _ingest(
        self, path: Path, source: str, labels: LabelRow | None, origin: Origin | None, timings: dict[str, float], turn: Turn
    ) -> IngestResult:
        lap = _Laps(timings)
        raw = open_adapter(path)
        named = self._named_base(raw, origin)
        lap("read")
        result = None
        found = self._copy_row(raw, named[0] if named else None)  # read without waiting for the stores before
        if found is not None:
            with turn.in_order():  # it may attach labels and record a duplicate: after the stores before it
                result = self._stored_copy(raw, source, found, labels)
        lap("store")
        if result is None:
            # LoRA formats are read, canonicalized and described on one torch thread (the blob is written on another):
            # their kernels are per module, or batched over modules of a few MB to a few hundred MB, and on a busy
            # machine (load 6 on 2 cores) a Llama-3-8B r16 adapter's canonicalization took 3.3-8.4 s on two threads
            # against 0.8-1.1 s on one, an SDXL adapter's 1.5-11.8 s against 0.8-0.9 s; unloaded, one thread and the
            # blob's thread keep up with two. A checkpoint's (against a base) factorizes whole matrices, which threads
            # do speed up.
            with one_torch_thread(raw.format in LORA_FORMATS):
                result = self._ingest_update(raw, source, named, labels, origin, lap, turn)
        lap("store")
        result.source, result.timings = source, timings
        return result

    def _named_base(self, raw: RawAdapter, origin: Origin | None) -> tuple[str, str] | None:
        """The base model named for the files and who named it: --base-model over the source (a Hub card's) over the
        files (a config's often local path); None when nobody did (it is guessed from the shapes once read)."""
        if self.options.base_model:
            return self.options.base_model, "--base-model"
        if origin is not None and origin.base_model:
            return origin.base_model, "the source"
        return (raw.base_model, "the files") if raw.base_model else None

    def _ingest_update(
        self,
        raw: RawAdapter,
        source: str,
        named_base: tuple[str, str] | None,
        labels: LabelRow | None,
        origin: Origin | None,
        lap: _Laps,
        turn: Turn,
    ) -> IngestResult:
        """Read the tensors of files not stored yet, canonicalize, describe and store them; the blob is written and
        fsynced (or uploaded) meanwhile, on a thread of its own (see zoo.store.blobs). `named_base`: the base model and
        who named it (`_named_base`). The turn is given back once described: the head's blob (if any) goes up, and the
        store waits for the blob and for the stores before it, while the next source is worked on. A copy of a source
        still in flight (not found by `_stored_copy`) is found by the store's duplicate check, which runs after it."""
        opts = self.options
        data = parse_adapter(raw, opts.base_checkpoint, opts.energy, opts.max_rank)
        base_model, warnings = resolve_base_model(data, named_base)
        parts = kept_parts(raw, data)
        lap("read")
        with small_work_on_one_thread(data):
            canonical = canonicalize_modules(data.modules, self.device) if data.modules else []
            lap("canonicalize")
            named = [(m.name, f) for m, f in zip(data.modules, canonical, strict=True)]
            blob = BlobWriter(self.blobs, named) if canonical else None
            head: StagedBlob | None = None
            try:
                described = describe(data, source, base_model, canonical, parts.kernels)
                if origin is not None:
                    apply_origin(described.adapter, origin, labels)
                lap("describe")
                turn.release()  # the next source is worked on while this one's blobs go up and its rows wait their turn
                head = self.blobs.stage_tensors(parts.head) if parts.head else None
                with turn.in_order():
                    result = retry_conflicts(self._store, described, labels, blob, head)
            finally:
                if blob is not None:  # a duplicate's or a failed write's file; once committed there is none left
                    blob.discard()
                if head is not None:
                    BlobStore.discard(head)
        result.notes, result.warnings = list(data.notes), warnings
        if result.status == "ingested" and head is not None and parts.head:
            result.head = {"tensors": sorted(parts.head), "bytes": head.size, "blob": head.digest}
        return result

    def _stored_copy(
        self, raw: RawAdapter, source: str, found: tuple[repository.StoredCopy, str], labels: LabelRow | None
    ) -> IngestResult | None:
        """The duplicate result for files already stored, without reading tensors: `found`, the stored copy `_copy_row`
        found and its base model. Given labels are attached to it as on any duplicate (unless it has them already), and
        the source recorded (with `record_duplicates_as`). None when it was deleted meanwhile."""
        match, base_model = found
        if labels is None:
            same = True
        else:
            with autocommit_reads(self.sessions) as conn:
                same = repository.has_labels(conn, match.id, labels.attributes, labels.measurements)
        locks = store_locks(base_model, match.structure_hash, match.dw_norm, DUPLICATE_RTOL)
        attach = labels if labels is not None and not same else None
        if (attach or self.record_duplicates_as) and not retry_conflicts(self._confirm_copy, match.id, locks, attach, source):
            return None
        return IngestResult(
            str(raw.path), "duplicate", match.id, match.canonical_hash, name=adapter_name(raw.path), duplicate_of=match.name
        )

    def _copy_row(self, raw: RawAdapter, base_model: str | None) -> tuple[repository.StoredCopy, str] | None:
        """A stored adapter of this base model from a weight file with the same SHA-256, in the same format, with the
        same config values the update depends on (a full checkpoint only while no --base makes it a delta), and that
        base model; with none named, the one guessed for such a stored copy (`_guessed_copy_base`). Read without a
        transaction; None where there is none."""
        if raw.format is None or (raw.format == "checkpoint" and self.options.base_checkpoint):
            return None
        with autocommit_reads(self.sessions) as conn:  # reads only: no transaction around them
            base_model = base_model or _guessed_copy_base(conn, raw)
            if base_model is None:
                return None
            rows = repository.stored_copies(conn, raw.weights.sha256, base_model, raw.format)
        match = next((r for r in rows if all((r.config or {}).get(k) == v for k, v in raw.settings.items())), None)
        return None if match is None else (match, base_model)

    def stored_revision(self, uri: str, revision: str) -> IngestResult | None:
        """The duplicate result when an adapter of this source at this revision is stored already (answered before
        anything is downloaded), else None."""
        row = stored_revision(self.sessions, uri, revision)
        if row is None or self.record_duplicates_as and not retry_conflicts(self._confirm_copy, row.id, [], None, uri):
            return None
        note = f"{uri} at revision {revision} is stored already (adapter {row.id}): same revision, nothing downloaded"
        return IngestResult(
            uri, "duplicate", row.id, row.canonical_hash, name=row.name, duplicate_of=row.name, notes=[note], revision=revision
        )

    def _confirm_copy(self, adapter_id: int, locks: list[str], labels: LabelRow | None, source: str) -> bool:
        """A source found to be a stored adapter: its given labels attached (under the store's locks and the adapter's
        label lock, zoo.store.labels.write_labels) and its source recorded (with `record_duplicates_as`), in one
        transaction; False if the adapter is gone."""
        with write_transaction(self.sessions, *locks) as session:
            if not adapter_exists(session, adapter_id):
                return False
            if labels is not None:
                write_labels(session, adapter_id, labels.attributes, labels.measurements)
            job = self._record_duplicate(session, adapter_id, source)
        self._committed(job)
        return True

    def _record_duplicate(self, session: Session, adapter_id: int, source: str) -> int | None:
        """Record the duplicate in the caller's transaction (with `record_duplicates_as`), unless its source is known for
        the adapter already (its own source, ingested again, or one recorded before); the run's job id, to keep once
        that transaction has committed (`_committed`)."""
        if self.record_duplicates_as is None or jobs.source_known(session, adapter_id, source):
            return None
        return jobs.record_duplicate(session, self.duplicates_job, source, adapter_id, self.record_duplicates_as)

    def _committed(self, job: int | None) -> None:
        if job is not None:
            self.duplicates_job = job

    def _find_duplicate(self, session: Session, d: Described) -> repository.Candidate | None:
        """The stored adapter this one is (zoo.store.duplicates.stored_duplicate)."""
        a = d.adapter
        return stored_duplicate(session, self.blobs, a.base_model, a.canonical_hash, a.structure_hash, d.sketch, d.factors)

    def _store(self, d: Described, labels: LabelRow | None, blob: BlobWriter | None = None, head: StagedBlob | None = None) -> IngestResult:
        """One transaction (rows, labels and the search document), serialized with writers of updates it could
        duplicate (see zoo.store.locks.store_locks) so that the duplicate check sees every earlier one's update; a
        duplicate's labels are written under its label lock too (zoo.store.labels.write_labels), and its source
        recorded (`record_duplicates_as`). The blob, written and fsynced meanwhile (`blob`), is put under its digest
        (idempotently, by content) after the rows are inserted and before they commit, and is never deleted here: a
        committed row always has its blob; a blob left by a transaction that failed is an orphan for `zoo check --repair`.
        A PEFT head's blob (`head`, staged before) goes the same way."""
        a = d.adapter
        with write_transaction(self.sessions, *store_locks(a.base_model, a.structure_hash, a.dw_norm, DUPLICATE_RTOL)) as session:
            check_space_fits(session, a, d.modules)
            dup = self._find_duplicate(session, d)
            if dup is None:
                return self._insert(session, d, labels, blob, head)
            if labels is not None:
                write_labels(session, dup.id, labels.attributes, labels.measurements)
            job = self._record_duplicate(session, dup.id, a.source_uri)
        self._committed(job)
        return IngestResult(a.source_uri, "duplicate", dup.id, dup.canonical_hash, name=a.name, duplicate_of=dup.name)

    def _insert(
        self, session: Session, d: Described, labels: LabelRow | None, blob: BlobWriter | None, head: StagedBlob | None
    ) -> IngestResult:
        """A new adapter's rows, labels, search document and blobs, in `_store`'s transaction."""
        a = d.adapter
        if a.source_revision is not None:  # a new revision of a stored source is its next version
            a.previous_version_id = previous_version(session, a.source_uri, a.source_revision)
        given = {lb.key: lb.value for lb in a.labels} | (labels.attributes if labels else {})
        measured = labels.measurements if labels else {}
        if blob is not None:
            a.factors_blob = blob.digest()
        a.head_blob = head.digest if head is not None else None
        insert_adapter(session, a, d.modules, given, measured)
        if blob is not None:
            self.blobs.commit(blob.staged())
        if head is not None:
            self.blobs.commit(head)
        return IngestResult(a.source_uri, "ingested", a.id, a.canonical_hash, name=a.name)


class _Laps:
    """Adds the seconds since the previous lap to a stage's total."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings, self.t = timings, time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
        self.t = now


def ingest_source(
    ingestor: Ingestor, source: str, labels: LabelRow | None = None, recorded_as: str | None = None, turn: Turn | None = None
) -> IngestResult:
    """Ingest one source. A Hub source whose resolved commit is stored already is the duplicate before any
    download; otherwise its files are fetched and ingested with their origin. Failures name the source. A local
    source is stored as `recorded_as` where given (a web upload's, whose files are a copy on this node), and its
    failures name that. `turn`: the Ingestor's working turn, taken by the caller (ingest_sources)."""
    if not hub.is_hub_source(source):
        result = ingestor.ingest(Path(source), source_uri=recorded_as, labels=labels, turn=turn)
        if recorded_as and result.error:
            result.error = result.error.replace(source, recorded_as)
        return result
    try:
        resolved = hub.resolve(source)
        stored = ingestor.stored_revision(resolved.origin.uri, resolved.sha)
        if stored is not None:
            stored.revision = resolved.sha
            return stored
        path, origin = hub.download(resolved)
    except (InputError, UsageError) as exc:  # a malformed job item fails like any other
        return IngestResult(source, "failed", error=str(exc))
    result = ingestor.ingest(path, labels=labels, origin=origin, turn=turn)
    result.revision = resolved.sha
    if result.error:  # a reader names the file in the Hub cache: name the source instead
        snapshot = str(path if path.is_dir() else path.parent)
        where = f"{origin.uri}@{resolved.sha[:12]}"
        result.error = result.error.replace(str(path), where).replace(snapshot, where)
        if where not in result.error:
            result.error = f"{where}: {result.error}"
    return result


def ingest_sources(ingestor: Ingestor, queue: Iterable[tuple[str, LabelRow | None]]) -> Iterator[IngestResult]:
    """ingest_source of each (source, labels), the results in the queue's order, several at a time: the next source is
    read, canonicalized and described while the ones before it upload their blobs and wait their turn to store
    (zoo.services.turns). As many sources are in flight as the blob store writes blobs at once
    (`ingestor.blobs.writes_at_once`), each one's blob staged as soon as it is canonicalized: the data dir's two (one
    blob written and fsynced while the next adapter is worked on, which takes longer), a bucket's ZOO_S3_UPLOADS (an
    upload, 0.3-0.6 s for a Llama-3-8B r16 adapter's 21 MB at 4 layers on this machine, takes longer than the next
    adapter's work, so uploads overlap each other as well as that work). Stores still go one at a time, in the queue's
    order, so a source finds every one before it stored (a copy of one is its duplicate, as one at a time)."""
    depth = max(2, ingestor.blobs.writes_at_once)
    pending: deque[tuple[Future[IngestResult], Turn]] = deque()
    with ThreadPoolExecutor(depth, thread_name_prefix="zoo-ingest") as pool:
        try:
            for source, labels in queue:
                turn = ingestor.turn()  # once the source before has done its work
                pending.append((pool.submit(_ingest_in_turn, ingestor, source, labels, turn), turn))
                while pending and (pending[0][0].done() or len(pending) >= depth):
                    yield pending.popleft()[0].result()
            while pending:
                yield pending.popleft()[0].result()
        finally:
            for future, turn in pending:  # stopped early: what has not begun never will
                if future.cancel():
                    turn.finish()


def _ingest_in_turn(ingestor: Ingestor, source: str, labels: LabelRow | None, turn: Turn) -> IngestResult:
    """ingest_source in the turn given, which is finished however it ends (a Hub source stored already takes none)."""
    try:
        return ingest_source(ingestor, source, labels, turn=turn)
    finally:
        turn.finish()


def _guessed_copy_base(conn: Connection, raw: RawAdapter) -> str | None:
    """The base model guessed for a stored copy of these files (same weight file, same format), read from its stored
    module shapes: the same bytes have the same modules, so the guess for these files, before their tensors are read."""
    copies = repository.stored_copy_shapes(conn, raw.weights.sha256, raw.format or "")
    return next((base for base, shapes in copies if guess_base_model(shapes).base_model == base), None)


def check_space_fits(session: Session, a: Adapter, modules: list[ModuleRow]) -> None:
    """Refuse an adapter whose module shapes conflict with the embedding space of its base model (it
    would break embedding and training for the whole space)."""
    schema = space_schema(session, a.base_model)
    if not schema or not modules:
        return
    known = {str(n): (int(o), int(i)) for n, o, i in schema["modules"]}
    for m in modules:
        want, have = known.get(str(m["name"])), (m["out_features"], m["in_features"])
        if want is not None and want != have:
            raise InputError(
                a.source_uri,
                f"module {m['name']} is {have[0]}×{have[1]} but {want[0]}×{want[1]} in the space of base model "
                f"{a.base_model!r}: not an adapter of that base (pass --base-model to store it elsewhere)",
            )


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
