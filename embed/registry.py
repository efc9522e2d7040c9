"""The store's space, embedder and embedding functions under their former names, for the importers not yet moved to
zoo/store/spaces.py, zoo/store/embedders.py and zoo/store/embeddings.py; it goes when the last of them has moved.

`get_space` here is the store's `find_space` (None for a space not made yet), as it always was here."""

from __future__ import annotations

from zoo.store.embedders import active_embedder, active_embedders, register, serving_embedders
from zoo.store.embeddings import (
    IDS_PER_QUERY,
    deleted_since,
    embedded_ids,
    embedding_ids,
    iter_embeddings,
    load_embeddings,
    store_embeddings,
)
from zoo.store.spaces import bump_version, space_version
from zoo.store.spaces import find_space as get_space

__all__ = [
    "IDS_PER_QUERY",
    "active_embedder",
    "active_embedders",
    "bump_version",
    "deleted_since",
    "embedded_ids",
    "embedding_ids",
    "get_space",
    "iter_embeddings",
    "load_embeddings",
    "register",
    "serving_embedders",
    "space_version",
    "store_embeddings",
]
