"""API tokens: made once, shown once, stored as SHA-256, each with a scope that says what it may do.

Scopes, each including the ones before it: `read` (every read, and reads under ZOO_READ_TOKEN_REQUIRED), `write`
(ingest, labels), `admin` (delete adapters; what `zoo token` does). A new token is `read` unless another is asked for:
a token handed out without thought then reads and cannot change the zoo.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, TypedDict, cast, get_args

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from zoo.errors import NotFoundError, UsageError
from zoo.store.models import ApiToken
from zoo.store.rows import columns
from zoo.timestamps import as_utc

PREFIX = "zoo_"

Scope = Literal["read", "write", "admin"]
#: every scope, from the least to the most a token may do; each includes those before it
SCOPES: tuple[Scope, ...] = get_args(Scope)
#: the scope of a token made without one
DEFAULT_SCOPE: Scope = "read"
#: a token's last use is stamped at most this often (a stamp is a write: one per request halved SQLite's reads)
STAMP_EVERY = timedelta(minutes=1)


def covers(held: str, needed: str) -> bool:
    """Whether a token of scope `held` may do what needs `needed`."""
    return held in SCOPES and SCOPES.index(parse_scope(held)) >= SCOPES.index(parse_scope(needed))


def parse_scope(value: str) -> Scope:
    """`value` as a scope; a usage error naming the scopes otherwise."""
    for scope in SCOPES:
        if value == scope:
            return scope
    raise UsageError(f"no token scope {value!r}: one of {', '.join(SCOPES)}")


class TokenSummary(TypedDict):
    """An API token as listed (never the token itself)."""

    id: int
    name: str
    scope: str
    created_at: str | None
    last_used_at: str | None
    revoked_at: str | None


class NewToken(TokenSummary):
    """A token just made, with the token: shown once."""

    token: str


@dataclass(frozen=True)
class LiveToken:
    """A token that is neither unknown nor revoked, as a request sees it."""

    id: int
    name: str
    scope: Scope
    last_used_at: datetime | None

    def stamp_due(self, now: datetime) -> bool:
        return self.last_used_at is None or now - self.last_used_at >= STAMP_EVERY


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, scope: str = DEFAULT_SCOPE) -> tuple[ApiToken, str]:
    """A new token named `name` of `scope`: (its row, the token itself, which is not stored and cannot be shown again)."""
    if not name.strip() or len(name) > 128:
        raise UsageError("a token needs a name of 1 to 128 characters")
    token = PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name.strip(), token_sha256=digest(token), scope=parse_scope(scope))
    session.add(row)
    session.flush()
    return row, token


def find_token(session: Session, token: str) -> LiveToken | None:
    """The live token `token` is (one indexed read); None when unknown or revoked."""
    row = session.execute(
        select(ApiToken.id, ApiToken.name, ApiToken.scope, ApiToken.last_used_at).where(
            ApiToken.token_sha256 == digest(token), ApiToken.revoked_at.is_(None)
        )
    ).one_or_none()
    if row is None:
        return None
    return LiveToken(row.id, row.name, parse_scope(row.scope), as_utc(row.last_used_at))


def stamp_use(session: Session, token: LiveToken, now: datetime) -> None:
    """Stamp the token's last use, unless another request stamped it within STAMP_EVERY."""
    stale = (ApiToken.last_used_at.is_(None)) | (ApiToken.last_used_at < now - STAMP_EVERY)
    session.execute(update(ApiToken).where(ApiToken.id == token.id, stale).values(last_used_at=now))


def list_tokens(session: Session) -> list[TokenSummary]:
    return [token_summary(t) for t in session.scalars(select(ApiToken).order_by(ApiToken.id))]


def revoke_token(session: Session, token_id: int) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFoundError(f"no API token with id {token_id}: see `zoo token list`")
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
    return row


def token_summary(t: ApiToken) -> TokenSummary:
    return cast(TokenSummary, columns(t, ("id", "name", "scope", "created_at", "last_used_at", "revoked_at")))
