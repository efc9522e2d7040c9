"""The one place a source string becomes files to read: local paths pass through, `hf://` sources are fetched
from the Hub (zoo/sources/hub.py). `zoo ingest`, `zoo worker` and the web app's jobs all go through here."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from zoo.errors import InputError, UsageError
from zoo.sources import Origin, hub

if TYPE_CHECKING:
    from zoo.ingest import Ingestor, IngestResult
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


def ingest_source(ingestor: Ingestor, source: str, labels: LabelRow | None = None) -> IngestResult:
    """Ingest one source. A Hub source whose resolved commit is stored already is the duplicate before any
    download; otherwise its files are fetched and ingested with their origin. Failures name the source."""
    from zoo.ingest import IngestResult

    if not hub.is_hub_source(source):
        return ingestor.ingest(Path(source), labels=labels)
    try:
        resolved = hub.resolve(source)
        stored = ingestor.stored_revision(resolved.origin.uri, resolved.sha)
        if stored is not None:
            stored.revision = resolved.sha
            return stored
        path, origin = hub.download(resolved)
    except (InputError, UsageError) as exc:  # a malformed job item fails like any other
        return IngestResult(source, "failed", error=str(exc))
    result = ingestor.ingest(path, labels=labels, origin=origin)
    result.revision = resolved.sha
    if result.error:  # a reader names the file in the Hub cache: name the source instead
        snapshot = str(path if path.is_dir() else path.parent)
        where = f"{origin.uri}@{resolved.sha[:12]}"
        result.error = result.error.replace(str(path), where).replace(snapshot, where)
        if where not in result.error:
            result.error = f"{where}: {result.error}"
    return result
