"""Embedding spaces: one per base model, found by name, with the version that orders writes of their embeddings.

Every write of a space's embeddings bumps the space's `version` first, in the same transaction,
and stamps the rows it writes with the new version. The UPDATE takes the space row's lock, so
writers of one space commit in version order, and a reader that has seen version v learns of
everything newer by loading the rows stamped above v: no O(N) check.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from zoo.errors import SpaceNotFoundError
from zoo.store.models import EmbeddingSpace

_BY_NAME = select(EmbeddingSpace).where(EmbeddingSpace.name == bindparam("name"))


def find_space(session: Session, name: str) -> EmbeddingSpace | None:
    """The space named `name`, or None: for callers to whom a space not made yet is no error."""
    return session.scalars(_BY_NAME, {"name": name}).one_or_none()


def get_space(session: Session, name: str) -> EmbeddingSpace:
    """The space named `name` (one indexed read); SpaceNotFoundError, naming the spaces there are, when there is none."""
    space = find_space(session, name)
    if space is None:
        raise SpaceNotFoundError(name, space_names(session))
    return space


def get_space_by_id(session: Session, space_id: int) -> EmbeddingSpace:
    """The space of this id (one that exists: sqlalchemy's NoResultFound otherwise)."""
    return session.get_one(EmbeddingSpace, space_id)


_BASE_OF = select(EmbeddingSpace.base_model).where(EmbeddingSpace.name == bindparam("name"))


def space_base_model(session: Session, name: str) -> str | None:
    """The base model of the space named `name`, through Core (no ORM work on the query path); None if there is none."""
    return session.connection().execute(_BASE_OF, {"name": name}).scalar()


def space_bases(session: Session) -> list[tuple[str, str]]:
    """(name, base model) of each space, by name."""
    rows = session.execute(select(EmbeddingSpace.name, EmbeddingSpace.base_model).order_by(EmbeddingSpace.name))
    return [(str(n), str(b)) for n, b in rows]


def space_names(session: Session) -> list[str]:
    """The names of the zoo's spaces, sorted."""
    return list(session.scalars(select(EmbeddingSpace.name).order_by(EmbeddingSpace.name)))


def all_spaces(session: Session) -> list[EmbeddingSpace]:
    """The zoo's spaces, by name."""
    return list(session.scalars(select(EmbeddingSpace).order_by(EmbeddingSpace.name)))


def ensure_space(session: Session, base_model: str, modules: Sequence[tuple[str, int, int]]) -> EmbeddingSpace:
    """The space of a base model, its module vocabulary ((name, out, in) triples) widened to include `modules`."""
    space = find_space(session, base_model)
    if space is None:
        schema = {"base_model": base_model, "modules": [list(m) for m in modules]}
        space = EmbeddingSpace(name=base_model, base_model=base_model, schema=schema)
        session.add(space)
        session.flush()
        return space
    known = {str(n): (int(o), int(i)) for n, o, i in space.schema["modules"]}
    new = [(n, o, i) for n, o, i in modules if n not in known]
    if new:  # a module name keeps the shape it has: ingest refuses adapters that disagree with it
        merged = sorted([(n, o, i) for n, (o, i) in known.items()] + new)
        space.schema = {"base_model": space.base_model, "modules": [list(m) for m in merged]}
        session.flush()
    return space


def bump_version(session: Session, space_id: int) -> int:
    """Increment the space's version (taking its row lock until commit) and return the new value."""
    session.execute(update(EmbeddingSpace).where(EmbeddingSpace.id == space_id).values(version=EmbeddingSpace.version + 1))
    return int(session.execute(select(EmbeddingSpace.version).where(EmbeddingSpace.id == space_id)).scalar_one())


_VERSION = select(EmbeddingSpace.version).where(EmbeddingSpace.id == bindparam("space_id"))


def space_version(session: Session, space_id: int) -> int:
    """The space's version: one indexed read through Core (every query asks it)."""
    return int(session.connection().execute(_VERSION, {"space_id": space_id}).scalar() or 0)
