"""What a metrics scrape reads from the database (webapp/metrics.py): a few grouped counts on indexed columns, cheap
enough for every scrape."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from zoo.store.models import Adapter, EmbeddingSpace, JobItem

_ITEM_STATES = select(JobItem.state, func.count()).group_by(JobItem.state)
_SPACE_VERSIONS = select(EmbeddingSpace.name, EmbeddingSpace.version)
_ADAPTERS = select(func.count()).select_from(Adapter)


def item_states(session: Session) -> dict[str, int]:
    """Job items by state (queued, running, done, duplicate, failed, cancelled), of every job."""
    return {str(state): int(count) for state, count in session.execute(_ITEM_STATES)}


def space_versions(session: Session) -> dict[str, int]:
    """Each space's version, by name: it rises with every write of the space's embeddings."""
    return {str(name): int(version) for name, version in session.execute(_SPACE_VERSIONS)}


def adapter_count(session: Session) -> int:
    """Adapters stored."""
    return int(session.scalar(_ADAPTERS) or 0)
