"""The database's errors under the store's names, for code outside the store to catch, and the retry of a write
that lost a race to a concurrent writer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

T = TypeVar("T")

#: any error of the database or its driver
DatabaseError = SQLAlchemyError
#: a constraint fired: a concurrent writer stored the same row first, or a row written against was deleted
ConstraintError = IntegrityError
#: the database could not be used: unreachable, refused, or (SQLite) locked past its busy timeout
UnavailableError = OperationalError


def driver_message(exc: DatabaseError) -> str:
    """What the driver said (the error's text where no driver error is wrapped)."""
    return str(getattr(exc, "orig", None) or exc)


def retry_conflicts(write: Callable[..., T], *args: object, attempts: int = 3) -> T:
    """`write(*args)`, again when a concurrent writer stored the same rows first (a unique constraint fired: the next
    attempt finds them) or when a SQLite database stayed locked past its busy timeout."""
    for _ in range(attempts - 1):
        try:
            return write(*args)
        except IntegrityError:
            continue
        except OperationalError as exc:
            if "locked" not in str(exc.orig):
                raise
    return write(*args)
