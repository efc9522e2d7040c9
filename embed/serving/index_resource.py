"""`zoo index rebuild|stats`: each serving embedder's index of a space (rebuilt if asked, else its recall@10 against
exact search) and the module store, as one plain dict."""

from __future__ import annotations

from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np

from embed.serving.exact_search import brute_force, recall_at_k
from embed.serving.index_files import BUILD_CHUNK_BYTES, update_index_file
from embed.serving.module_store import update_module_store
from embed.serving.resources import resolve_space
from zoo.errors import NotReadyError
from zoo.store.blobs import BlobStore
from zoo.store.embedders import serving_embedders
from zoo.store.embeddings import embedding_ids, iter_embeddings, load_embeddings
from zoo.store.models import Embedder
from zoo.store.session import Session


class FilteredSearch(TypedDict):
    """How an IVF index searches under a filter."""

    nprobe: int
    subset_rerank: int


#: a serving embedder's index as `zoo index` reports it; recall@10 against exact search unless rebuilt
IndexEntry = TypedDict(
    "IndexEntry",
    {
        "embedder_id": int,
        "method": str,
        "count": int,
        "dim": int,
        "kind": str,
        "codes": str | None,
        "nprobe": int | None,
        "rerank": int | None,  # IVF's
        "filtered": FilteredSearch | None,  # IVF's
        "state": str,
        "recall@10_vs_exact": NotRequired[float],
    },
)


class IndexReport(TypedDict):
    """`zoo index`'s report: each serving embedder's index, and the module store."""

    space: str
    embedders: list[IndexEntry]
    module_store: str


def index_report(session: Session, blobs: BlobStore, data_dir: Path, space_name: str | None, rebuild: bool) -> IndexReport:
    """`zoo index rebuild|stats`: every active embedder's index (rebuilt if asked) and the module store."""
    space = resolve_space(session, space_name)
    embedders = list(serving_embedders(session, space.id).values())
    if not embedders:
        raise NotReadyError(f"space {space.name} has no embeddings yet: run `zoo embed`")
    out: list[IndexEntry] = []
    for e in embedders:
        index, how = update_index_file(session, data_dir, e, rebuild=rebuild)
        entry: IndexEntry = {
            "embedder_id": e.id,
            "method": e.method,
            "count": index.size,
            "dim": index.dim,
            "kind": index.kind,
            "codes": index.codes,
            "nprobe": index.nprobe,
            "rerank": index.rerank if index.ivf else None,
            "filtered": {"nprobe": index.filter_nprobe, "subset_rerank": index.filter_rerank} if index.ivf else None,
            "state": how,
        }
        if not rebuild and index.size:
            ids = embedding_ids(session, e)
            _, sample = load_embeddings(session, e, ids=np.random.default_rng(0).choice(ids, size=min(200, len(ids)), replace=False))
            entry["recall@10_vs_exact"] = recall_at_k(index.search(sample, 10)[1], exact_top_k(session, e, sample, 10))
        out.append(entry)
    return {"space": space.name, "embedders": out, "module_store": update_module_store(session, blobs, data_dir, space, rebuild=rebuild)}


def exact_top_k(session: Session, embedder: Embedder, queries: np.ndarray, k: int) -> np.ndarray:
    """Ids of the exact cosine top-k of each query among the embedder's stored vectors, read a chunk at a time."""
    best_s, best_i = np.full((len(queries), 0), -np.inf, np.float32), np.zeros((len(queries), 0), np.int64)
    for ids, vectors in iter_embeddings(session, embedder, batch=max(1, BUILD_CHUNK_BYTES // (4 * embedder.dim))):
        sims, found = brute_force(ids, vectors, queries, k)
        sims, found = np.concatenate([best_s, sims], axis=1), np.concatenate([best_i, found], axis=1)
        order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(sims, order, axis=1), np.take_along_axis(found, order, axis=1)
    return best_i
