"""The one place a source string becomes files to read: local paths pass through, `hf://` sources are fetched
from the Hub (zoo/sources/hub.py). `zoo ingest`, `zoo worker` and the web app's jobs all go through here. Sources yield
files and never call ingest: zoo.services.ingest.ingest_source ingests what they yield."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from zoo.sources import Origin, hub

if TYPE_CHECKING:
    from zoo.labels import LabelRow


def is_remote(source: str) -> bool:
    """Whether the source is fetched (a Hub source) rather than read where it is."""
    return hub.is_hub_source(source)


def job_sources(paths: Iterable[str], label_rows: dict[str, LabelRow] | None = None) -> tuple[list[str], dict[str, LabelRow]]:
    """A job's sources from command-line paths: `hf://` sources as given (a malformed one is a usage error
    here), local paths expanded (zoo.sources.local) to absolute paths; and each local source's labels CSV row."""
    from zoo.labels import assign_rows
    from zoo.sources.local import expand_paths

    paths = list(paths)
    remote = [p for p in paths if is_remote(p)]
    for source in remote:
        hub.parse(source)
    local = expand_paths([p for p in paths if not is_remote(p)])
    labels = assign_rows(label_rows, local) if label_rows else {}
    sources = [str(path.absolute()) for path, _ in local]
    return [*sources, *remote], {str(path.absolute()): row for path, row in labels.items()}


def fetch_source(source: str) -> tuple[Path, Origin | None]:
    """The local path to read for a source and what its source says about it (None for local paths)."""
    if hub.is_hub_source(source):
        return hub.fetch(source)
    return Path(source), None
