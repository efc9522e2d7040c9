"""SQLAlchemy 2.0 typed models. The schema itself is created only by the Alembic migrations."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, ClassVar, TypedDict

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Computed,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import TSVECTOR
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from zoo.domain.base_models import UNKNOWN_PREFIX


class Base(DeclarativeBase):
    if TYPE_CHECKING:
        # every model is mapped to a table of its own (DeclarativeBase types it as any FROM clause)
        __table__: ClassVar[Table]


#: SQLite's full-text index of `adapter_text` (an FTS5 virtual table and its shadow tables), made by
#: migration 0005 and kept outside this metadata
SQLITE_FTS_TABLE = "adapter_text_fts"
#: the base_model of adapters stored, before base models were guessed from shapes, without one named
UNKNOWN_BASE = "unknown"


def named_base_model(base_model: str) -> str | None:
    """A stored base_model as the name of a model, None when it names none: UNKNOWN_BASE, or the space of an adapter's
    own shapes that no known family fits (zoo.domain.base_models, `unknown-<hash>`)."""
    return None if base_model == UNKNOWN_BASE or base_model.startswith(UNKNOWN_PREFIX) else base_model


def on_dialect(dialect: str) -> Callable[[object, str | None, str, bool, object], bool]:
    """An Alembic `include_object` hook: leave out indexes (`Index.ddl_if`) and columns (`info["dialect"]`)
    declared for another dialect, and SQLite's FTS5 tables."""

    def include(obj: object, name: str | None, type_: str, reflected: bool, compare_to: object) -> bool:
        if type_ == "table" and name and name.startswith(SQLITE_FTS_TABLE):
            return False
        declared = obj if not reflected else compare_to
        ddl_if = getattr(declared, "_ddl_if", None)
        only = ddl_if.dialect if ddl_if is not None else getattr(declared, "info", {}).get("dialect")
        return only in (None, dialect)

    return include


class Adapter(Base):
    """One ingested update (LoRA adapter or checkpoint delta), unique by canonical hash per base model."""

    __tablename__ = "adapter"
    __table_args__ = (
        UniqueConstraint("base_model", "canonical_hash", name="uq_adapter_base_model_canonical_hash"),
        Index("ix_adapter_base_model_structure_hash_dw_norm", "base_model", "structure_hash", "dw_norm"),  # near-duplicate look-up
        # the catalog's `source` filter is a prefix (LIKE 'p%'): PostgreSQL reads it through a pattern index whatever the
        # database's collation (migration 0012); SQLite's LIKE ignores case and uses no index anyway
        Index("ix_adapter_source_uri_prefix", "source_uri", postgresql_ops={"source_uri": "text_pattern_ops"}).ddl_if(dialect="postgresql"),
        # ids are never handed out twice (migration 0011), so nothing keyed by a deleted adapter's id (index, module store,
        # map, the engine's names) can be mistaken for a later one's; PostgreSQL's serial ids never come back anyway
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    source_uri: Mapped[str] = mapped_column(Text, index=True)
    #: the commit sha a Hub source resolved to (None for local files)
    source_revision: Mapped[str | None] = mapped_column(String(64))
    #: the Hub repo's owner (None for local files)
    author: Mapped[str | None] = mapped_column(String(128), index=True)
    #: what the source said about the adapter beyond its files (Hub: datasets, downloads, likes, pipeline tag, the card's
    #: base_model and its relation, ...)
    source_metadata: Mapped[dict] = mapped_column(JSON, default=dict, server_default="{}")
    #: the adapter stored from the same source at an earlier revision
    previous_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("adapter.id", ondelete="SET NULL", name="fk_adapter_previous_version_id_adapter")
    )
    base_model: Mapped[str] = mapped_column(String(255), index=True)
    format: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer)
    alpha: Mapped[float | None] = mapped_column(Float)
    target_modules: Mapped[list | None] = mapped_column(JSON)
    task_type: Mapped[str | None] = mapped_column(String(64))
    canonical_hash: Mapped[str] = mapped_column(String(64))
    structure_hash: Mapped[str] = mapped_column(String(64), index=True)
    dw_norm: Mapped[float | None] = mapped_column(Float, index=True)
    #: the update's raw probe values z_j·||dW|| (zoo.domain.fingerprint.Sketch.raw), which rule out most near-duplicate
    #: candidates without reading their factors; None for full checkpoints and adapters stored before 0010
    dw_probes: Mapped[list | None] = mapped_column(JSON)
    file_sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    factors_blob: Mapped[str | None] = mapped_column(String(64))
    #: a PEFT adapter's tensors that are not LoRA factors (its head: modules_to_save, ...), by their names in
    #: extra_tensors, as a blob of their own (zoo.services.file_parts); None when it has none, they were past
    #: ZOO_MAX_HEAD_BYTES, or it was stored before 0016
    head_blob: Mapped[str | None] = mapped_column(String(64))
    #: what the relation step needs of the factors as read from the file, which are not kept
    #: (zoo.domain.transforms.FactorSummary.as_json: precisions, exact zeros); None for full checkpoints and before 0014
    factor_summary: Mapped[dict | None] = mapped_column(JSON)
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    file_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    extra_tensors: Mapped[dict] = mapped_column(JSON, default=dict)
    notes: Mapped[list] = mapped_column(JSON, default=list)
    license: Mapped[str | None] = mapped_column(String(128))
    tags: Mapped[list | None] = mapped_column(JSON)
    card: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), index=True)  # catalog: newest first

    modules: Mapped[list[Module]] = relationship(back_populates="adapter", cascade="all, delete-orphan", order_by="Module.id")
    labels: Mapped[list[Label]] = relationship(back_populates="adapter", cascade="all, delete-orphan", order_by="Label.key")
    measurements: Mapped[list[Measurement]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", order_by="Measurement.metric"
    )


class Module(Base):
    """One module of an adapter: shape, rank and spectrum. Canonical factors live in the blob store."""

    __tablename__ = "module"
    __table_args__ = (UniqueConstraint("adapter_id", "name", name="uq_module_adapter_id_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(512))
    layer_index: Mapped[int | None] = mapped_column(Integer)
    module_type: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # linear | conv | embedding | full
    out_features: Mapped[int] = mapped_column(Integer)
    in_features: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)  # nominal LoRA rank r
    canonical_rank: Mapped[int | None] = mapped_column(Integer)  # numerically nonzero components
    alpha: Mapped[float | None] = mapped_column(Float)
    scale: Mapped[float | None] = mapped_column(Float)
    transposed: Mapped[bool] = mapped_column(Boolean, default=False)
    #: a conv module's kernel, [in_channels, k...] (its product is in_features); None for other kinds, when the file
    #: does not give it, and before 0016
    kernel: Mapped[list | None] = mapped_column(JSON)
    singular_values: Mapped[list] = mapped_column(JSON)
    spectral_norm: Mapped[float] = mapped_column(Float)
    frobenius_norm: Mapped[float] = mapped_column(Float)
    stable_rank: Mapped[float] = mapped_column(Float)
    effective_rank: Mapped[float] = mapped_column(Float)
    power_law_alpha: Mapped[float | None] = mapped_column(Float)
    power_law_xmin: Mapped[float | None] = mapped_column(Float)
    power_law_ks: Mapped[float | None] = mapped_column(Float)

    adapter: Mapped[Adapter] = relationship(back_populates="modules")


class Label(Base):
    """A known (given) or predicted attribute of an adapter: task, dataset, style, ..."""

    __tablename__ = "label"
    __table_args__ = (
        UniqueConstraint("adapter_id", "key", "source", name="uq_label_adapter_id_key_source"),
        # label filters are equality look-ups: a hash index on PostgreSQL (no size limit on values), a
        # covering index on SQLite (its rows sit among embedding blobs: reading them is the slow part)
        Index("ix_label_value", "value", postgresql_using="hash").ddl_if(dialect="postgresql"),
        Index("ix_label_key_value", "key", "value", "source", "adapter_id").ddl_if(dialect="sqlite"),
        {"sqlite_autoincrement": True},  # label ids only grow (migration 0011): the engine reads the rows above its mark
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), index=True)
    key: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(16), default="given")  # given | predicted
    model_version: Mapped[str | None] = mapped_column(String(64))

    adapter: Mapped[Adapter] = relationship(back_populates="labels")


class AdapterText(Base):
    """An adapter's search document (see zoo/store/catalog.py), rewritten with the adapter and its given labels.
    PostgreSQL keeps its tsvector in a generated column under a GIN index; SQLite indexes it with an FTS5
    table (migration 0005)."""

    __tablename__ = "adapter_text"
    __table_args__ = (Index("ix_adapter_text_document_tsv", "document_tsv", postgresql_using="gin").ddl_if(dialect="postgresql"),)

    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), primary_key=True)
    document: Mapped[str] = mapped_column(Text)
    #: PostgreSQL only: stored, so that matching and ranking read it instead of parsing the document again
    document_tsv: Mapped[str | None] = mapped_column(
        TSVECTOR, Computed("to_tsvector('simple'::regconfig, document)", persisted=True), deferred=True, info={"dialect": "postgresql"}
    )


class Measurement(Base):
    """A measured performance number of an adapter (for training and scoring predictors)."""

    __tablename__ = "measurement"
    __table_args__ = (UniqueConstraint("adapter_id", "metric", "split", name="uq_measurement_adapter_id_metric_split"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), index=True)
    metric: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[float] = mapped_column(Float)
    split: Mapped[str] = mapped_column(String(32), default="test")

    adapter: Mapped[Adapter] = relationship(back_populates="measurements")


class EmbeddingSpace(Base):
    """A base model and its module vocabulary: adapters that fit it can be embedded and compared."""

    __tablename__ = "embedding_space"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    base_model: Mapped[str] = mapped_column(String(255), index=True)
    schema: Mapped[dict] = mapped_column(JSON)
    #: bumped in the same transaction as every write of the space's embeddings (see zoo/store/spaces.py)
    version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    embedders: Mapped[list[Embedder]] = relationship(back_populates="space", cascade="all, delete-orphan", order_by="Embedder.id")


class Embedder(Base):
    """One way of embedding a space: a trained W2T checkpoint or the training-free dW sketch."""

    __tablename__ = "embedder"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    space_id: Mapped[int] = mapped_column(ForeignKey("embedding_space.id", ondelete="CASCADE"), index=True)
    method: Mapped[str] = mapped_column(String(32))  # w2t | dw_sketch
    objective: Mapped[str | None] = mapped_column(String(32))
    checkpoint: Mapped[str | None] = mapped_column(Text)  # directory under the data dir
    dim: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    space: Mapped[EmbeddingSpace] = relationship(back_populates="embedders")


class Embedding(Base):
    """An adapter's vector under one embedder (float32 bytes)."""

    __tablename__ = "embedding"
    __table_args__ = (
        UniqueConstraint("adapter_id", "embedder_id", name="uq_embedding_adapter_id_embedder_id"),
        Index("ix_embedding_embedder_id_version", "embedder_id", "version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), index=True)
    embedder_id: Mapped[int] = mapped_column(ForeignKey("embedder.id", ondelete="CASCADE"), index=True)
    vector: Mapped[bytes] = mapped_column(LargeBinary)
    #: the space's version that wrote this row: a reader that has seen version v loads rows above v
    version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class ApiToken(Base):
    """A token for the REST API; only its SHA-256 is stored. Its scope (read, write, admin) is what it may do."""

    __tablename__ = "api_token"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class JobOptions(TypedDict, total=False):
    """A job's ingest options (its `options` column; zoo/runners/worker.py `ingest_options` reads them). Unset:
    ingest's default."""

    base_model: str | None  # overrides what the files say
    base_checkpoint: str  # full checkpoints: deltas against this
    energy: float
    max_rank: int
    import_root: str  # the web app's: every item's path must stay under it when it is read
    request_id: str  # the web request that made the job: its items' log lines carry it (zoo/logs.py)
    upload: str  # the web app's upload folder under the data dir (uploads/<hex>), in the bucket too where blobs are
    upload_name: str  # what was uploaded: the file's name, or the names of a PEFT directory's two files joined by "+"


class StoredLabels(TypedDict):
    """A job item's given labels (its `labels` column)."""

    attributes: dict[str, str]
    measurements: dict[str, float]


class Job(Base):
    """A batch of sources to ingest, with a state per item (see zoo/store/jobs.py)."""

    __tablename__ = "job"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), default="ingest")
    state: Mapped[str] = mapped_column(String(16), default="queued", index=True)  # queued | running | done | cancelled
    options: Mapped[JobOptions] = mapped_column(JSON, default=dict)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    items: Mapped[list[JobItem]] = relationship(back_populates="job", cascade="all, delete-orphan", order_by="JobItem.id")


class JobItem(Base):
    """One source of a job: queued | running | done | duplicate | failed (with its reason)."""

    __tablename__ = "job_item"
    __table_args__ = (
        Index("ix_job_item_job_id_state", "job_id", "state"),
        Index("ix_job_item_state_lease_expires_at", "state", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"))
    source: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    adapter_id: Mapped[int | None] = mapped_column(ForeignKey("adapter.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: the worker holding a running item, and until when: a lease not renewed by its heartbeat returns the item to the queue
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: seconds per ingest stage (fetch, read, describe, store, ...) of the last attempt
    timings: Mapped[dict[str, float] | None] = mapped_column(JSON)
    #: the source's given labels, from a labels CSV
    labels: Mapped[StoredLabels | None] = mapped_column(JSON)
    #: what ingest warned of though it stored the source (a named base model its module shapes contradict), and its
    #: notes (the base model guessed from the shapes, a head not stored): what `zoo ingest` prints for the source
    warnings: Mapped[list[str] | None] = mapped_column(JSON)
    notes: Mapped[list[str] | None] = mapped_column(JSON)

    job: Mapped[Job] = relationship(back_populates="items")


#: the relations found from the weights (zoo.domain.relations): transforms of one update, merges, continuations
RELATIONS = ("identical", "rescaled", "cast", "truncated", "pruned", "merge", "continuation")


class RelationParameters(TypedDict, total=False):
    """A found relation's parameters (the `parameters` column): those of its type only."""

    scale: float  # transforms: dW_child = scale·T(dW_parent)
    steps: list[str]  # transforms: every step applied, in order (e.g. rescaled, cast)
    precision: str  # cast: bf16 | fp16
    kept_rank: dict[str, int]  # truncated: per module
    sparsity: float  # pruned: share of zero entries in A and B
    weight: float  # merge: this parent's weight
    combination: str  # merge: cat | svd | linear | weighted_sum | approximate
    parents: int  # merge: how many parents it has (one row each)
    direction_confidence: float  # continuation: that the parent came first


class AdapterRelation(Base):
    """A relation found from the weights: `child` is `relation` of `parent` (a merge has one row per
    parent). Written by the relation step after embedding (zoo/services/relations.py); deleting either adapter
    deletes the row."""

    __tablename__ = "adapter_relation"
    __table_args__ = (
        UniqueConstraint("child_id", "parent_id", "relation", name="uq_adapter_relation_child_id_parent_id_relation"),
        Index("ix_adapter_relation_parent_id_relation", "parent_id", "relation"),  # derived_from=ID; an adapter as parent
        Index("ix_adapter_relation_relation_child_id", "relation", "child_id"),  # relation=merge
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    child_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"))
    parent_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"))
    relation: Mapped[str] = mapped_column(String(16))  # one of RELATIONS
    parameters: Mapped[RelationParameters] = mapped_column(JSON, default=dict)
    #: the named numbers the detector decided on (residuals, cosines, statistics)
    evidence: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    confidence: Mapped[float] = mapped_column(Float)
    #: the detector's version (zoo.domain.relations.DETECTOR)
    detector: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class RelationScan(Base):
    """An adapter's relations looked for among its nearest neighbours by a detector version: an adapter without a row
    of the current version is scanned by the next relation step; `error` says why a scan failed (it is tried again), and
    `read_budget` which budget left neighbours out (it is tried again under a larger one)."""

    __tablename__ = "relation_scan"

    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"), primary_key=True)
    detector: Mapped[str] = mapped_column(String(32))
    #: the space's version when its neighbours were searched: adapters embedded after it were not among them
    space_version: Mapped[int] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)
    #: the read budget (bytes, ZOO_EMBED_CHUNK_BYTES) under which it was compared with fewer neighbours than the step
    #: compares; a step with a larger budget scans it again. None: not cut
    read_budget: Mapped[int | None] = mapped_column(BigInteger)
    scanned_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class DeletedAdapter(Base):
    """A deleted adapter's id, stamped with the version of its space that the deletion wrote: query
    engines and index files drop it from their indexes when they catch up past that version."""

    __tablename__ = "deleted_adapter"
    __table_args__ = (Index("ix_deleted_adapter_space_id_version", "space_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(Integer)
    space_id: Mapped[int] = mapped_column(ForeignKey("embedding_space.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(BigInteger)
    deleted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class CatalogChange(Base):
    """A change to the catalog's texts that leaves no newer row behind: a given label removed alone, an adapter
    deleted. Ids only grow (migration 0018), so the largest is part of what an index of the texts covers
    (zoo.store.text_rows.catalog_mark)."""

    __tablename__ = "catalog_change"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(Integer)
    what: Mapped[str] = mapped_column(String(32))  # label removed | adapter deleted
    changed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
