"""`zoo check`: fsck for the zoo. Blobs against rows, orphans and temporary files, index files and
module stores against the database, embeddings against adapters; `--repair` fixes what can be fixed.

What it finds:
- **missing / corrupt blobs**: a row whose blob (its factors', or its PEFT head's) is absent or whose bytes do not hash
  to its digest.
  Data is lost: nothing repairs it (ingest the adapter again).
- **orphans**: blobs no row refers to, and what a killed writer left half-done: temporary files (`.tmp-*`) in
  the data dir, multipart uploads never completed in an S3 bucket (zoo/store/s3_blobs.py). A writer inserts its
  rows, writes its blob, then commits, so a blob younger than the grace period may belong to a transaction
  still open: those are counted as `in_flight`, never removed.
- **indexes**: each serving embedder's index file must load, check itself and agree with the
  database; the module store must be readable; so must the space's map file (embed/serving/maps.py). Repair
  rebuilds them from the database. One this node lacks is no problem: derived files are per-node caches,
  built from the database and the blob store on first use (a new node starts with an empty data dir).
- **stale entries**: every derived structure keyed by adapter id (index files, the module store, the map)
  must hold exactly the ids the database embeds, once the tombstones written since the file are applied
  (as the engine applies them): an entry for an id that is no longer in the database (a deleted adapter's
  vector, factors or point) or a missing one is a problem. Repair rebuilds that file from the database.
- **unembedded adapters**: adapters that fit a space but have no vector under its module sketch.
  Repair embeds them (`zoo embed`).
- **misfits**: adapters of a space's base model with a module whose shape differs from the one the space's
  vocabulary gives that module: they are never embedded nor searched there. Ingest refuses them once the space
  exists; adapters stored under one base model before its space was made (`zoo embed`) can be. Nothing repairs
  them: ingest the adapter again under its own base model (`--base-model`, or none to have it guessed) and delete it.
- **orphaned uploads**: folders under `uploads/` in the data dir (a web upload's files, kept until its job item
  finishes; a search by upload's, kept for the request) that no queued or running job item owns and that nothing
  has written to for the grace period: a worker killed while it copied an upload, or mid-job, leaves them. The
  owner decides first (an item's source inside the folder), the age second (an upload is copied before its job
  exists, and a search's folder has no job). Repair removes them.
- **the text index** (`text/` in the data dir: search by meaning's sentence index, embed/serving/text_index.py): it must load
  (a damaged file, or one of another format, is a problem) and, where its catalog mark is the database's, hold every
  adapter and no other (else it is stale: a problem). One behind the catalog's mark is reported, not counted: the next
  search by meaning brings it up to date. Repair rebuilds it, or removes its files where the `text` extra is not
  installed (the next search by meaning builds it).
- **uploads in the bucket**: with blobs in a bucket, a web upload's folder there (zoo/services/bucket_check.py) that
  no queued or running item owns and nothing has written to for the grace period, reported with its age; a web app
  killed while it put one up, or a worker killed before it removed one, leaves them. Repair removes them.
- **stranded job items**: items left `running` by a lease holder that is gone: its lease ran out, or it was a
  process of this host that has exited (zoo/store/jobs.py `stranded_items`). Repair queues them again (failed
  once out of attempts), as a worker's claim would; an upload they name stays theirs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np

from zoo.config import Settings
from zoo.files import TMP_PREFIX
from zoo.services.bucket_check import BucketUploadCheck, check_bucket_uploads
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.embedders import get_embedder, serving_embedders
from zoo.store.embeddings import deleted_since, embedding_ids
from zoo.store.jobs import StrandedItem, pending_sources, requeue_stranded, stranded_items
from zoo.store.models import EmbeddingSpace
from zoo.store.repository import adapter_blobs, names_and_labels, space_module_shapes
from zoo.store.session import Session, Sessions, session_factory
from zoo.store.spaces import all_spaces, get_space_by_id, space_version

#: seconds a blob or temporary file must be old before `--repair` may remove it
DEFAULT_GRACE_S = 3600.0


class LostBlob(TypedDict):
    """A row whose blob is missing or corrupt."""

    adapter_id: int
    blob: str


class BlobCheck(TypedDict):
    rows: int  # adapters with a blob (factors, head or both)
    missing: list[LostBlob]
    corrupt: list[LostBlob]


class FileCheck(TypedDict):
    """A space's derived file as checked: an embedder's index file (embedder_id, method), its module store
    (module_store) or its map (map)."""

    space: str
    embedder_id: NotRequired[int]
    method: NotRequired[str]
    module_store: NotRequired[str]
    map: NotRequired[str]
    state: str  # "ok", or what is wrong
    stale: NotRequired[bool]  # its ids disagree with the database's: repair rebuilds it
    repaired: NotRequired[bool]


class Unembedded(TypedDict):
    """A space's adapters without a sketch vector."""

    space: str
    count: int
    adapter_ids: list[int]  # the first 20
    repaired: NotRequired[bool]


class Misfit(TypedDict):
    """An adapter with a module whose shape is not the one its space's vocabulary gives it (the first such module)."""

    space: str
    adapter_id: int
    name: str
    module: str
    shape: list[int]  # out, in as stored
    space_shape: list[int]  # out, in in the space


class TextIndexCheck(TypedDict):
    """The text index as checked (the module's doc)."""

    path: str
    state: str  # "ok", "not built", "behind the catalog ...", or what is wrong
    behind: NotRequired[bool]  # its mark is not the catalog's: the next search by meaning updates it (no problem)
    stale: NotRequired[bool]  # its mark is current but its adapters are not the database's
    repaired: NotRequired[str]  # "rebuilt", or "removed" (no `text` extra here)


class UploadCheck(TypedDict):
    orphans: list[str]  # folders under uploads/ no live job item owns, older than the grace period
    in_flight: int  # folders owned by a queued or running item, or written to within the grace period
    removed: int


class JobCheck(TypedDict):
    stranded: list[StrandedItem]
    requeued: int


class CheckReport(TypedDict):
    """What `check` found and repaired."""

    ok: bool
    problems: int
    blobs: BlobCheck
    orphans: list[str]
    temporary_files: list[str]
    in_flight: int
    removed: int
    indexes: list[FileCheck]
    unembedded: list[Unembedded]
    misfits: list[Misfit]
    uploads: UploadCheck
    bucket_uploads: BucketUploadCheck
    jobs: JobCheck
    text_index: TextIndexCheck
    repaired: list[str]


def check(settings: Settings, repair: bool = False, grace_s: float = DEFAULT_GRACE_S) -> CheckReport:
    """The check report: what was found, what was repaired, and `ok` (nothing wrong left)."""
    sessions = session_factory(settings.database_url)
    blobs = open_blob_store(settings)
    with sessions() as session:
        rows = adapter_blobs(session)
    referenced = {str(digest) for _, digest in rows}
    missing: list[LostBlob] = []
    corrupt: list[LostBlob] = []
    for adapter_id, digest in rows:
        state = blobs.verify(str(digest))
        if state != "ok":
            (missing if state == "missing" else corrupt).append({"adapter_id": adapter_id, "blob": str(digest)})

    now = time.time()
    left = blobs.leftovers(referenced, now, grace_s)  # orphan blobs, and blob writes never finished
    stray: list[Path] = []  # derived files' temporary files
    in_flight = left.in_flight
    for path in _files(settings.data_dir):
        if not path.name.startswith(TMP_PREFIX):
            continue
        if now - path.stat().st_mtime < grace_s:
            in_flight += 1
        else:
            stray.append(path)
    orphans, temporary = left.orphans, left.temporary + [str(p) for p in stray]
    removed = 0
    if repair:
        removed = blobs.remove(left.orphans + left.temporary)
        for path in stray:
            path.unlink(missing_ok=True)
            removed += 1

    indexes, unembedded, misfits, repaired = _check_spaces(settings, sessions, blobs, repair)
    jobs = _check_jobs(sessions, repair)
    text_index = _check_text_index(settings, sessions, blobs, repair)
    repaired += [f"text index: {text_index['repaired']}"] if "repaired" in text_index else []
    uploads = _check_uploads(settings.data_dir / "uploads", sessions, repair, grace_s, now)
    bucket_uploads = check_bucket_uploads(blobs, sessions, repair, grace_s, now)  # after _check_jobs, as uploads
    problems = len(missing) + len(corrupt) + (0 if repair else len(orphans) + len(temporary))
    problems += 0 if repair else len(uploads["orphans"]) + len(bucket_uploads["orphans"]) + len(jobs["stranded"])
    problems += sum(1 for i in indexes if i["state"] != "ok" and not i.get("repaired"))
    problems += sum(u["count"] for u in unembedded if not u.get("repaired")) + len(misfits)
    wrong_text = text_index["state"] not in ("ok", "not built") and not text_index.get("behind")  # damaged, or stale
    problems += int(wrong_text and "repaired" not in text_index)
    return {
        "ok": problems == 0,
        "problems": problems,
        "blobs": {"rows": len({adapter_id for adapter_id, _ in rows}), "missing": missing, "corrupt": corrupt},
        "orphans": orphans,
        "temporary_files": temporary,
        "in_flight": in_flight,
        "removed": removed,
        "indexes": indexes,
        "unembedded": unembedded,
        "misfits": misfits,
        "uploads": uploads,
        "bucket_uploads": bucket_uploads,
        "jobs": jobs,
        "text_index": text_index,
        "repaired": repaired,
    }


def _check_text_index(settings: Settings, sessions: Sessions, blobs: BlobStore, repair: bool) -> TextIndexCheck:
    """The text index's files against the database (the module's doc); rebuilt on repair, or removed where the `text`
    extra is missing."""
    from embed.serving import text_index
    from embed.serving.engine import QueryEngine
    from zoo.errors import NotReadyError
    from zoo.store.text_rows import adapter_ids, catalog_mark, predictors

    files = text_index.index_files(settings.data_dir)
    entry: TextIndexCheck = {"path": str(text_index.text_dir(settings.data_dir)), "state": "ok"}
    if not any(f.exists() for f in files):
        return {**entry, "state": "not built"}  # built by the first search by meaning
    held: text_index.TextIndex | None = None
    with sessions() as session:
        try:
            held = text_index.load(settings.data_dir)
        except ValueError as exc:
            entry["state"] = str(exc)
        if held is not None:
            mark, served = catalog_mark(session), {b: e for b, (_, e) in predictors(session).items()}
            if held.mark != mark or held.predictors != served:
                entry["state"], entry["behind"] = f"behind the catalog: it covers {held.mark}, the catalog is at {mark}", True
            else:
                entry["state"] = _same_ids("text index", held.doc_ids, np.array(adapter_ids(session), np.int64))
                if entry["state"] != "ok":
                    entry["stale"], held = True, None  # nothing of it is trusted: everything encoded again
        if repair and entry["state"] != "ok":
            try:
                text_index.rebuild(session, QueryEngine(sessions, blobs, settings.data_dir), held)
                entry["repaired"] = "rebuilt"
            except NotReadyError:
                for f in files:
                    f.unlink(missing_ok=True)
                entry["repaired"] = "removed"
    return entry


def _check_jobs(sessions: Sessions, repair: bool) -> JobCheck:
    """Items whose lease holder is gone, queued again on repair."""
    with sessions() as session:
        stranded = stranded_items(session)
    return {"stranded": stranded, "requeued": requeue_stranded(sessions, stranded) if repair and stranded else 0}


def _check_uploads(root: Path, sessions: Sessions, repair: bool, grace_s: float, now: float) -> UploadCheck:
    """Folders under `root` (the data dir's uploads/) that no queued or running item owns and nothing has written to
    for `grace_s` seconds (the module's doc); removed on repair. Run after `_check_jobs`, so that an item it queued
    again keeps its upload."""
    if not root.is_dir():
        return {"orphans": [], "in_flight": 0, "removed": 0}
    with sessions() as session:
        owned = {Path(source) for source in pending_sources(session)}
    orphans: list[Path] = []
    in_flight = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        if any(source.is_relative_to(folder) for source in owned) or now - _last_written(folder) < grace_s:
            in_flight += 1
        else:
            orphans.append(folder)
    if repair:
        for folder in orphans:
            shutil.rmtree(folder, ignore_errors=True)
    return {"orphans": [str(p) for p in orphans], "in_flight": in_flight, "removed": len(orphans) if repair else 0}


def _last_written(folder: Path) -> float:
    """The newest modification time of a folder and everything in it (a copy under way keeps it fresh)."""
    times = [folder.lstat().st_mtime]
    for path in folder.rglob("*"):
        try:
            times.append(path.lstat().st_mtime)
        except FileNotFoundError:  # removed meanwhile by its request
            continue
    return max(times)


def _files(data_dir: Path) -> Iterator[Path]:
    for sub in ("index", "rerank", "embedders", "map", "text"):  # the blob store finds its own (BlobStore.leftovers)
        root = data_dir / sub
        if root.is_dir():
            yield from (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _check_spaces(
    settings: Settings, sessions: Sessions, blobs: BlobStore, repair: bool
) -> tuple[list[FileCheck], list[Unembedded], list[Misfit], list[str]]:
    """Index files, module stores, maps, missing embeddings and misfits per space (embed/ is imported only here).
    A space with any of them wrong is repaired by `embed_space`: it embeds what is missing and rebuilds
    every index file, module store and map that is missing or disagrees with the database."""
    from embed.serving.embedding_resource import embed_space
    from embed.serving.index_files import index_path, load_consistent_index
    from embed.serving.maps import load_consistent_map, map_embedder, map_path
    from embed.serving.module_store import module_store_path, read_module_store
    from embed.serving.search_methods import SKETCH

    indexes: list[FileCheck] = []
    unembedded: list[Unembedded] = []
    misfits: list[Misfit] = []
    repaired: list[str] = []
    with sessions() as session:
        spaces = sorted(all_spaces(session), key=lambda space: space.id)
    for space in spaces:
        found: list[FileCheck] = []
        with sessions() as session:
            serving = serving_embedders(session, space.id)
            version = space_version(session, space.id)
            embedded = {e.id: embedding_ids(session, e) for e in serving.values()}
            for e in serving.values():
                entry: FileCheck = {"space": space.name, "embedder_id": e.id, "method": e.method, "state": "ok"}
                if not index_path(settings.data_dir, e.id).exists():  # not on this node yet: the engine builds it on first use
                    found.append(entry)
                    continue
                try:
                    index, _ = load_consistent_index(session, index_path(settings.data_dir, e.id), e, version)
                    entry["state"] = _same_ids("index", index.ids, embedded[e.id])
                    if entry["state"] != "ok":
                        entry["stale"] = True  # ids disagree though the count may not: repair rebuilds the file
                except ValueError as exc:
                    entry["state"] = str(exc)
                found.append(entry)
            sketch = serving.get(SKETCH)
            store_path = module_store_path(settings.data_dir, space.id)
            if store_path.exists():
                have = read_module_store(store_path)
                state = "unreadable" if have is None else "ok"
                if have is not None and sketch is not None:
                    held = have[0][~np.isin(have[0], deleted_since(session, space.id, have[3]))]  # as the engine drops them
                    state = _same_ids("module store", held, embedded[sketch.id], missing_ok=True)
                if state != "ok":
                    store_entry: FileCheck = {"space": space.name, "module_store": str(store_path), "state": state}
                    if have is not None:
                        store_entry["stale"] = True
                    found.append(store_entry)
            shown = map_embedder(session, space.id)
            if shown is not None and map_path(settings.data_dir, shown.id).exists():  # (else fitted on first use)
                map_entry: FileCheck = {"space": space.name, "map": str(map_path(settings.data_dir, shown.id)), "state": "ok"}
                try:
                    m, _ = load_consistent_map(session, map_path(settings.data_dir, shown.id), shown, version)
                    map_entry["state"] = _same_ids("map", m.ids, embedded[shown.id])
                    if map_entry["state"] != "ok":
                        map_entry["stale"] = True
                except ValueError as exc:
                    map_entry["state"] = str(exc)
                found.append(map_entry)
            missing, misfit = _fit(session, space, set(embedded[sketch.id].tolist()) if sketch else None)
        bad = [entry for entry in found if entry["state"] != "ok"]
        gap: Unembedded | None = {"space": space.name, "count": len(missing), "adapter_ids": missing[:20]} if missing else None
        if repair and (bad or gap):
            embed_space(sessions, blobs, settings.data_dir, space.base_model)
            _rebuild_stale(sessions, blobs, settings.data_dir, space.id, [entry for entry in bad if entry.get("stale")])
            for entry in bad:
                entry["repaired"] = True
            if gap:
                gap["repaired"] = True
            repaired += [f"{space.name}: rebuilt {e.get('method', 'map' if 'map' in e else 'module store')}" for e in bad]
            repaired += [f"{space.name}: embedded {len(missing)} adapters"] if missing else []
        indexes += found
        unembedded += [gap] if gap else []
        misfits += misfit
    return indexes, unembedded, misfits, repaired


#: ids of stale or missing entries listed in a report
SHOWN_IDS = 20


def _same_ids(what: str, held: np.ndarray, embedded: np.ndarray, missing_ok: bool = False) -> str:
    """ "ok", or which ids the structure holds that the database no longer has (deleted adapters) and, unless
    `missing_ok` (a module store may lag behind: the engine adds what it lacks), which it lacks."""
    extra = np.setdiff1d(held, embedded)
    lacking = np.zeros(0, np.int64) if missing_ok else np.setdiff1d(embedded, held)
    if not len(extra) and not len(lacking):
        return "ok"
    parts = [f"{len(extra)} entries for ids no longer in the database ({extra[:SHOWN_IDS].tolist()})"] if len(extra) else []
    parts += [f"no entry for {len(lacking)} embedded ids ({lacking[:SHOWN_IDS].tolist()})"] if len(lacking) else []
    return f"the {what} holds " + "; ".join(parts)


def _rebuild_stale(sessions: Sessions, blobs: BlobStore, data_dir: Path, space_id: int, stale: list[FileCheck]) -> None:
    """Rebuild from the database each file whose ids disagreed with it (a count that agrees does not make
    `embed_space` rebuild it)."""
    from embed.serving.index_files import update_index_file
    from embed.serving.maps import map_embedder, update_map
    from embed.serving.module_store import update_module_store

    with sessions() as session:
        for entry in stale:
            if "embedder_id" in entry:
                update_index_file(session, data_dir, get_embedder(session, entry["embedder_id"]), rebuild=True)
            elif "module_store" in entry:
                update_module_store(session, blobs, data_dir, get_space_by_id(session, space_id), rebuild=True)
            elif "map" in entry:
                shown = map_embedder(session, space_id)
                assert shown is not None  # a map entry is checked only where the space has a map embedder; none is ever removed
                update_map(session, data_dir, shown, rebuild=True)


def _fit(session: Session, space: EmbeddingSpace, sketched: set[int] | None) -> tuple[list[int], list[Misfit]]:
    """The adapters of the space's base model whose modules all fit its vocabulary but have no sketch vector (those
    not `sketched`; none without a sketch embedder), and those with a module of another shape than the vocabulary's (misfits, by id)."""
    shapes = {str(n): (int(o), int(i)) for n, o, i in space.schema["modules"]}
    fits: dict[int, bool] = {}
    conflicts: dict[int, tuple[str, tuple[int, int], tuple[int, int]]] = {}
    for adapter_id, name, out, inp in space_module_shapes(session, space.base_model):
        want = shapes.get(name)
        fits[adapter_id] = fits.get(adapter_id, True) and want == (out, inp)
        if want is not None and want != (out, inp):
            conflicts.setdefault(adapter_id, (name, (out, inp), want))
    unembedded = sorted(i for i, ok in fits.items() if ok and i not in sketched) if sketched is not None else []
    names = names_and_labels(session, conflicts)
    misfits: list[Misfit] = [
        {"space": space.name, "adapter_id": i, "name": names[i][0], "module": m, "shape": list(have), "space_shape": list(want)}
        for i, (m, have, want) in sorted(conflicts.items())
        if i in names  # deleted meanwhile: gone from the space
    ]
    return unembedded, misfits
