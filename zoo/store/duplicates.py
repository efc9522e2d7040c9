"""Which stored adapter an update is: the one with its canonical hash, else a near one within DUPLICATE_RTOL.

Ingest asks before storing (a match is a duplicate), and a search or prediction by file asks before answering (a
match is answered as that stored adapter, so a file and the adapter stored from it get one answer)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from zoo.domain.fingerprint import DUPLICATE_RTOL, NamedFactors, Sketch, may_be_duplicate, relative_distance
from zoo.store.blobs import BlobStore
from zoo.store.repository import Candidate, duplicate_candidates


def stored_duplicate(
    session: Session,
    blobs: BlobStore,
    base_model: str,
    canonical_hash: str,
    structure_hash: str,
    sketch: Sketch | None,
    factors: NamedFactors,
) -> Candidate | None:
    """The stored adapter of `base_model` with this canonical hash, else the first near one (same structure, close
    norm) within DUPLICATE_RTOL of this update. A near candidate's factors are read only when its stored probe values
    do not rule it out (zoo.domain.fingerprint.may_be_duplicate; adapters stored without them are always read)."""
    norm = sketch.norm if sketch is not None else None
    for c in duplicate_candidates(session, base_model, canonical_hash, structure_hash, norm, DUPLICATE_RTOL):
        if c.canonical_hash == canonical_hash:
            return c
        if not c.factors_blob or (sketch is not None and not may_be_duplicate(sketch, c.dw_probes, c.dw_norm)):
            continue
        if relative_distance(factors, blobs.get_factors(c.factors_blob)) <= DUPLICATE_RTOL:
            return c
    return None
