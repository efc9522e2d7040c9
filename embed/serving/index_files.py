"""Index-file upkeep: each embedder's FAISS index file under `DATA/index/`, built from the database's vectors a chunk at
a time, brought up to it by the rows written since it was saved (written by `zoo embed` and `zoo index rebuild`, and by
a node whose data dir lacks one)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from embed.serving.index import IVF_FROM, AdapterIndex, ivf_lists
from embed.serving.search_methods import RAW
from zoo.errors import NotReadyError
from zoo.store.embeddings import deleted_since, embedding_ids, iter_embeddings, load_embeddings, stored_count
from zoo.store.models import Embedder
from zoo.store.session import Session
from zoo.store.spaces import space_version

#: the most lists an IVF index of these embedders probes: raw-factor sketches of unrelated adapters are near-random
#: vectors (independent inits), so no nprobe holds the exact top 10 of a query without relatives (a million synthetic
#: ones tuned to every list: 99 ms a query); the relation step wants only relatives, which share the query's lists
MAX_NPROBE = {RAW: 32}

log = logging.getLogger(__name__)


def index_path(data_dir: Path, embedder_id: int) -> Path:
    return data_dir / "index" / f"embedder-{embedder_id}.index"


def update_index_file(session: Session, data_dir: Path, embedder: Embedder, rebuild: bool = False) -> tuple[AdapterIndex, str]:
    """Bring the embedder's index file up to the database: add the rows written since it was saved, or
    build it from every row (asked, none yet, or the file disagreed). Returns (index, how)."""
    version = space_version(session, embedder.space_id)
    path = index_path(data_dir, embedder.id)
    how = "rebuilt (asked)" if rebuild else "built"
    if path.exists() and not rebuild:
        try:
            index, meta = load_consistent_index(session, path, embedder, version)
            if index.ivf != (index.size >= IVF_FROM):
                how = f"rebuilt ({index.size} vectors outgrew its {index.kind} kind)"
            elif meta["version"] == version:
                return index, "loaded"
            else:
                index.save(path, {"embedder_id": embedder.id, "version": version})
                return index, "updated"
        except ValueError:
            how = "rebuilt (the file disagreed with the database)"
    index = build_index(session, embedder)
    index.save(path, {"embedder_id": embedder.id, "version": version})
    return index, how


#: vectors read from the database at a time while an index is built (bytes)
BUILD_CHUNK_BYTES = 64 << 20


def build_index(session: Session, embedder: Embedder, ivf: bool | None = None) -> AdapterIndex:
    """The embedder's index built from its stored vectors a chunk of BUILD_CHUNK_BYTES at a time: an IVF's quantizer
    and codes are trained on a sample read by id (as AdapterIndex.build draws it), so memory is the index plus one
    chunk, never every vector in float32 (1M Llama-3-8B sketches: 8 GB)."""
    ids = embedding_ids(session, embedder)
    if ivf is None:
        ivf = len(ids) >= IVF_FROM
    if not ivf or not len(ids):
        index = AdapterIndex.exact(embedder.dim)
    else:
        rng = np.random.default_rng(0)
        _, sample = load_embeddings(session, embedder, ids=rng.choice(ids, size=min(len(ids), 64 * ivf_lists(len(ids))), replace=False))
        index = AdapterIndex.trained_ivf(sample, len(ids))
        del sample
    per_chunk = max(1, BUILD_CHUNK_BYTES // (4 * embedder.dim))
    for chunk_ids, vectors in iter_embeddings(session, embedder, ids=ids, batch=per_chunk):
        index.add(chunk_ids, vectors)
    if index.ivf:
        sample_ids = np.random.default_rng(0).choice(ids, size=min(len(ids), 200), replace=False)
        tune_ids, tune = load_embeddings(session, embedder, ids=sample_ids)
        index.tune_nprobe(tune, tune_ids, max_nprobe=MAX_NPROBE.get(embedder.method))
    return index


def load_consistent_index(session: Session, path: Path, embedder: Embedder, version: int) -> tuple[AdapterIndex, dict]:
    """The index file plus the rows written after it; ValueError when it cannot be made to agree with the database."""
    index, meta = AdapterIndex.load(path)
    if meta.get("embedder_id") != embedder.id or int(meta.get("version", -1)) > version:
        raise ValueError(f"{path} was written for another database or embedder")
    index.remove(deleted_since(session, embedder.space_id, int(meta["version"])))  # before adding: an id may come back
    ids, vectors = load_embeddings(session, embedder, after_version=int(meta["version"]))
    index.upsert(ids, vectors)
    stored = stored_count(session, embedder.id)
    if index.size != stored:
        raise ValueError(f"{path} holds {index.size} vectors, the database {stored}")
    return index, meta


def open_index(session: Session, data_dir: Path, embedder: Embedder, version: int) -> tuple[AdapterIndex, str]:
    """A serving node's index of the embedder, as the database has it at `version`, and how it was opened: its file
    loaded and brought up to the database; built and kept where this node has none (a new node, a space embedded on
    another); or, where the file disagrees with the database, answered from the database's vectors while they are
    few (NotReadyError, naming `zoo index rebuild`, above IVF_FROM)."""
    path = index_path(data_dir, embedder.id)
    if not path.exists():
        started = time.perf_counter()
        index, _ = update_index_file(session, data_dir, embedder)
        seconds = time.perf_counter() - started
        log.info("embedder %d: index of %d vectors built on this node in %.2f s (%s)", embedder.id, index.size, seconds, path)
        return index, f"built on this node from the database in {seconds:.2f} s"
    try:
        index, _ = load_consistent_index(session, path, embedder, version)
        return index, "loaded"
    except ValueError as exc:
        problem = str(exc)
    if stored_count(session, embedder.id) > IVF_FROM:
        raise NotReadyError(f"{problem}; run `zoo index rebuild` to rebuild it from the database")
    index = build_index(session, embedder, ivf=False)
    return index, f"answered from the database ({problem}); run `zoo index rebuild` to save an index"
