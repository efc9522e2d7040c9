"""API tokens on requests: `Authorization: Bearer <token>` (made with `zoo token create`)."""

from __future__ import annotations

from apiflask import HTTPTokenAuth

from webapp.context import zoo_context
from zoo.store.models import ApiToken
from zoo.store.session import write_transaction
from zoo.store.tokens import verify_token

token_auth = HTTPTokenAuth(scheme="Bearer", description="A token from `zoo token create NAME`")


@token_auth.verify_token
def stamped_token(token: str) -> ApiToken | None:
    """The live token's row, its last use stamped in a write transaction of its own: not in the request's session,
    whose read transaction SQLite cannot turn into a write once another writer (an ingest job) has committed."""
    with write_transaction(zoo_context().sessions) as session:
        return verify_token(session, token)
