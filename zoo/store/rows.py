"""Stored rows as the resources show them: a row's columns under their own names, its times as ISO seconds."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from zoo.timestamps import iso_seconds


def columns(row: object, names: Iterable[str]) -> dict[str, Any]:
    """The row's attributes `names`, in that order, each under its own name; a time as `iso_seconds` writes it."""
    return {name: _shown(getattr(row, name)) for name in names}


def _shown(value: object) -> object:
    return iso_seconds(value) if isinstance(value, datetime) else value
