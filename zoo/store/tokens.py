"""API tokens for the REST API's write endpoints: made once, shown once, stored as SHA-256."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime
from typing import TypedDict

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from zoo.errors import NotFoundError, UsageError
from zoo.store.models import ApiToken
from zoo.timestamps import iso_seconds

PREFIX = "zoo_"


class TokenSummary(TypedDict):
    """An API token as listed (never the token itself)."""

    id: int
    name: str
    created_at: str | None
    last_used_at: str | None
    revoked_at: str | None


class NewToken(TokenSummary):
    """A token just made, with the token: shown once."""

    token: str


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str) -> tuple[ApiToken, str]:
    """A new token named `name`: (its row, the token itself, which is not stored and cannot be shown again)."""
    if not name.strip() or len(name) > 128:
        raise UsageError("a token needs a name of 1 to 128 characters")
    token = PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name.strip(), token_sha256=digest(token))
    session.add(row)
    session.flush()
    return row, token


def verify_token(session: Session, token: str) -> ApiToken | None:
    """The live token row for `token`, its last use stamped; None when unknown or revoked."""
    row = session.scalars(select(ApiToken).where(ApiToken.token_sha256 == digest(token), ApiToken.revoked_at.is_(None))).one_or_none()
    if row is not None:
        session.execute(update(ApiToken).where(ApiToken.id == row.id).values(last_used_at=datetime.now(UTC)))
    return row


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
    return {
        "id": t.id,
        "name": t.name,
        "created_at": iso_seconds(t.created_at),
        "last_used_at": iso_seconds(t.last_used_at),
        "revoked_at": iso_seconds(t.revoked_at),
    }
