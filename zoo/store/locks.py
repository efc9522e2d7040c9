"""Every lock a writer takes, in one place: the keys (an update's duplicate window, a space's embeddings, an adapter's
labels) and taking them in a write transaction (zoo.store.session.write_transaction). On PostgreSQL a key is a
transaction-level advisory lock; SQLite has one writer at a time and needs none. Imports no torch: every command
opens a session."""

from __future__ import annotations

import hashlib
import math

from sqlalchemy import text
from sqlalchemy.orm import Session


def take_locks(session: Session, *lock_keys: str) -> None:
    """Take these locks in the session's write transaction (write_transaction), held until it ends: on PostgreSQL a
    transaction-level advisory lock per key (in sorted order), waiting for a transaction holding one; a lock the
    transaction holds already is taken again at no cost. On SQLite nothing: the transaction is its only writer."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        for key in sorted(set(lock_keys)):
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": advisory_key(key)})


def advisory_key(key: str) -> int:
    """A signed 64-bit lock id for a text key."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


def label_lock(adapter_id: int) -> str:
    """The lock key of an adapter's labels (and search document)."""
    return f"labels:{adapter_id}"


def space_lock(base_model: str) -> str:
    """The lock key that serializes writers of one space's embedders and embeddings."""
    return f"space:{base_model}"


def store_locks(base_model: str, structure: str, dw_norm: float | None, rtol: float) -> list[str]:
    """The locks a writer of an update takes so that the duplicate check sees every update it could duplicate:
    per (base model, structure) and bucket of log ||dW||, those of every norm within `rtol` (the duplicate
    tolerance, zoo.domain.fingerprint.DUPLICATE_RTOL) of its own (two or three buckets). A duplicate's norm lies in
    that window (| ||x|| - ||y|| | <= ||x - y||), so two writers of duplicates share a bucket, while writers of
    different updates of one structure go on at once. Updates without a norm (full checkpoints, deduplicated by file
    hash) take one lock per structure."""
    stem = f"ingest:{base_model}:{structure}"
    if dw_norm is None or not dw_norm > 0 or not math.isfinite(dw_norm):
        return [stem]
    low, high = norm_window(dw_norm, rtol)
    width = 2 * -math.log1p(-rtol)  # a bucket of log ||dW||: the window spans at most two boundaries
    return [f"{stem}:{b}" for b in range(math.floor(math.log(low) / width), math.floor(math.log(high) / width) + 1)]


def norm_window(dw_norm: float, rtol: float) -> tuple[float, float]:
    """The norms an update within `rtol` of one of norm dw_norm can have."""
    return dw_norm * (1 - rtol), dw_norm / (1 - rtol)
