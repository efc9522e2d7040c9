"""Stored times as every page, CLI line and JSON resource shows them: UTC, to the second, ISO 8601."""

from __future__ import annotations

from datetime import UTC, datetime


def as_utc(t: datetime | None) -> datetime | None:
    """A stored time with its zone: SQLite gives naive datetimes back, and every stored time is UTC."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


def iso_seconds(t: datetime | None) -> str | None:
    """`2026-11-25T04:08:30Z` (None stays None), whatever precision and zone the database gave."""
    t = as_utc(t)
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if t is not None else None
