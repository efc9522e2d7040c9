"""The memory budgets of serving and embedding, from the settings (zoo/config.py)."""

from __future__ import annotations

from zoo import config


def module_store_budget() -> int:
    """Bytes the module store of one space may take (ZOO_MODULE_STORE_BYTES, default 2 GiB)."""
    return config.MODULE_STORE_BYTES.get()


def spaces_budget() -> int:
    """Bytes the spaces one engine holds loaded may take together (ZOO_SPACES_BYTES, default 4 GiB: two spaces whose
    module stores are at the 2 GiB limit); the space being queried is kept even when it alone passes it."""
    return config.SPACES_BYTES.get()


def embed_chunk_bytes() -> int:
    """Bytes of float32 factors read from the blob store at a time (ZOO_EMBED_CHUNK_BYTES, default 512 MiB) when a
    space's adapters are embedded or put in its module store: with the embedders' own working memory, what
    `zoo embed` holds at once besides the module store, whatever the zoo's size."""
    return config.EMBED_CHUNK_BYTES.get()
