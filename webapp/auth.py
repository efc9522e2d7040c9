"""API tokens on requests: `Authorization: Bearer <token>` (made with `zoo token create`)."""

from __future__ import annotations

from apiflask import HTTPTokenAuth

from webapp.context import db
from zoo.db.models import ApiToken
from zoo.tokens import verify_token

token_auth = HTTPTokenAuth(scheme="Bearer", description="A token from `zoo token create NAME`")


@token_auth.verify_token
def _verify(token: str) -> ApiToken | None:
    session = db()
    row = verify_token(session, token)
    session.commit()  # the last-use stamp
    return row
