"""The stage after storing, for every way in: newly stored adapters embedded under every serving embedder of their spaces,
the touched spaces' files brought up to date, and the relations found from the weights (zoo.services.relations).
`zoo worker`, `zoo ingest --ray`, the web app's job thread and `zoo ingest` all end an item here, through EmbedBatches.
`zoo ingest`, which embeds once everything is stored, also gives a space never embedded the training-free embedders
(`new_spaces`), as `zoo embed` makes them; a job's batches (every EMBED_EVERY items, before the space's whole module
vocabulary is stored) leave a new base model to `zoo embed`."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from zoo.config import Settings
from zoo.metrics import metrics
from zoo.store.blob_backends import open_blob_store
from zoo.store.session import session_factory
from zoo.store.spaces import find_space

if TYPE_CHECKING:
    from embed.serving.engine import QueryEngine
    from zoo.services.relations import RelationReport

log = logging.getLogger(__name__)

#: newly stored adapters are embedded once this many are waiting (and whenever the queue runs dry)
EMBED_EVERY = 64

#: the outcome states whose adapter is embedded: stored now, or found stored (a duplicate may be one a killed worker
#: stored but never embedded)
STORED = ("done", "duplicate")


class Finished(Protocol):
    """A worker's outcome of an item, as far as the stage reads it."""

    @property
    def state(self) -> str: ...
    @property
    def adapter_id(self) -> int | None: ...


class Bars:
    """A progress bar per stage (embed, relations) on stderr, each made at its stage's first step; disabled ones cost nothing."""

    def __init__(self, enabled: bool | None) -> None:
        self.disable = None if enabled is None else not enabled  # None: tqdm's own test, whether stderr is a terminal
        self.queued = 0  # adapters handed to the embed stage so far
        self.made: dict[str, tqdm] = {}

    def bar(self, stage: str) -> tqdm:
        if stage not in self.made:
            self.made[stage] = tqdm(desc=stage, unit="adapter", total=0, disable=self.disable, file=sys.stderr)
        return self.made[stage]

    def embedded(self, count: int) -> None:
        bar = self.bar("embed")
        bar.total = max(self.queued, bar.n + count)
        bar.update(count)

    def close(self) -> None:
        for bar in self.made.values():
            bar.close()


class EmbedBatches:
    """Collects the adapters that outcomes stored or found; embeds those without vectors every `every` of them (None:
    only when flushed), and when flushed with `files`: then also whatever the touched spaces still lack (a killed
    worker's last batch), brings their files up to date and finds the relations of what is left to scan.
    `progress`: a bar per stage (None: when stderr is a terminal; False: none); `new_spaces`: see the module's note."""

    def __init__(
        self, settings: Settings, every: int | None, device: str | None = None, progress: bool | None = False, new_spaces: bool = False
    ) -> None:
        self.settings, self.every, self.device, self.new_spaces = settings, every, device, new_spaces
        self.sessions = session_factory(settings.database_url)
        self.blobs = open_blob_store(settings)
        self.pending: list[int] = []
        self.touched: set[str] = set()
        self.embedded: Counter[str] = Counter()
        self.relations: dict[str, RelationReport] = {}  # what the relation step did, summed per space
        self.engine: QueryEngine | None = None  # for the relation step's neighbours, made at its first use
        self.bars = Bars(progress)

    def add(self, outcome: Finished) -> None:
        """A worker's outcome: its adapter waits for the next batch if the item stored or found one."""
        if outcome.state in STORED and outcome.adapter_id is not None:
            self.stored(outcome.adapter_id)

    def stored(self, adapter_id: int) -> None:
        """An adapter stored (or found stored) to embed with the next batch."""
        self.pending.append(adapter_id)
        self.bars.queued += 1
        if self.every is not None and len(self.pending) >= self.every:
            self.flush(files=False)

    def _embed(self, ids: list[int]) -> None:
        from embed.serving.embedding_resource import embed_adapters

        done = embed_adapters(self.sessions, self.blobs, self.settings.data_dir, ids, self.device, self.bars.embedded, self.new_spaces)
        for space, count in done.items():
            metrics().embedded.labels(space).inc(count)
        self.embedded.update(done)
        self.touched.update(done)
        for base_model in done:
            self._relations(base_model, ids)

    def _relations(self, base_model: str, ids: list[int] | None) -> None:
        """The relation step (zoo.services.relations) for these newly embedded adapters (None: all the space's still to
        scan); a scan that fails is recorded on the adapter (`zoo lineage` shows it) and logged, never raised."""
        from zoo.services.relations import relation_engine, scan_space

        if self.engine is None:
            self.engine = relation_engine(self.sessions, self.blobs, self.settings.data_dir, self.device)
        bar = self.bars.bar("relations")
        start = bar.n

        def progress(done: int, total: int) -> None:
            bar.total = max(bar.total or 0, start + total)
            bar.update(start + done - bar.n)

        report = scan_space(self.engine, self.sessions, self.blobs, base_model, ids, progress)
        for error in report["errors"]:
            log.warning("relations from the weights in %s: %s", base_model, error)
        self._sum(report)

    def _sum(self, report: RelationReport) -> None:
        """A relation report added to the space's sum (the step's cost weighted by the adapters it scanned)."""
        from zoo.services.relations import REPORTED_ERRORS

        was = self.relations.get(report["space"])
        if was is None:
            self.relations[report["space"]] = {**report, "errors": list(report["errors"])}
            return
        scanned = was["scanned"] + report["scanned"]
        cost = sum(r["ms_per_adapter"] * r["scanned"] for r in (was, report) if r["ms_per_adapter"] is not None)
        was["scanned"], was["edges"], was["failed"] = scanned, was["edges"] + report["edges"], was["failed"] + report["failed"]
        was["errors"] = (was["errors"] + report["errors"])[:REPORTED_ERRORS]
        was["not_ready"], was["ms_per_adapter"] = report["not_ready"], cost / scanned if scanned else None
        was["budget_cut"], was["uncompared"] = was["budget_cut"] + report["budget_cut"], was["uncompared"] + report["uncompared"]
        sizes = [r["largest_mb"] for r in (was, report) if r["largest_mb"] is not None]
        was["largest_mb"] = max(sizes) if sizes else None

    def flush(self, files: bool = True) -> None:
        from embed.serving.embedding_resource import refresh_space_files, unembedded_ids

        if self.pending:
            ids, self.pending = self.pending, []
            self._embed(ids)
        if not files:
            return
        for base_model in sorted(self.touched):
            with self.sessions() as session:
                left = unembedded_ids(session, base_model)
            if left:
                self.bars.queued += len(left)
                self._embed(left)
            with self.sessions() as session:
                space = find_space(session, base_model)
                assert space is not None  # embed_adapters named it: the space it embedded them into
                space_id = space.id
            refresh_space_files(self.sessions, self.blobs, self.settings.data_dir, space_id)
            self._relations(base_model, None)  # whatever an earlier batch left (an index not ready, a killed worker)
        self.touched.clear()

    def close(self) -> None:
        """Close the progress bars."""
        self.bars.close()
