"""Hugging Face Hub sources: `hf://owner/repo[@revision][/subfolder]`, pinned to the commit sha the revision
resolves to, downloading only the files the adapter's format needs into the standard Hub cache.

Two steps, so that a revision already stored is answered before any weight is downloaded: `resolve` asks the
Hub (model info with file sizes) for the commit sha, the files to fetch and the origin, and refuses what is over
the limits; `download` fetches those files at that sha and checks them against the sizes and hashes listed.
Every failure is an InputError naming the source. HF_ENDPOINT and the cache (HF_HOME, HF_HUB_CACHE) are read at
call time; HF_HUB_OFFLINE is read by huggingface_hub when it is imported: offline, sources resolve from the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from zoo import config
from zoo.errors import InputError, UsageError
from zoo.formats.safe_load import max_file_bytes
from zoo.sources import Origin

SCHEME = "hf://"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_REVISION = re.compile(r"^[\w.-]{1,255}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
CONFIG = "adapter_config.json"
#: PEFT weights, preferred first
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: diffusers' name for a LoRA file, preferred among several .safetensors
DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"
CARD = "README.md"
#: model cards past this are not downloaded (the card is text for search, not weights)
MAX_CARD_BYTES = 1 << 20
RELATIONS = ("adapter", "finetune", "merge", "quantized")
T = TypeVar("T")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None
    subfolder: str

    @property
    def uri(self) -> str:
        """The source without its revision: versions of one source share it."""
        return SCHEME + self.repo_id + (f"/{self.subfolder}" if self.subfolder else "")


@dataclass(frozen=True)
class Resolved:
    """A source pinned to a commit: the files to fetch with their expected (size, sha256 or git blob id, is LFS),
    the path to read relative to the snapshot, and what the repo says about the adapter."""

    source: str
    ref: HubRef
    sha: str
    files: dict[str, tuple[int | None, str | None, bool]]
    target: str
    origin: Origin


def is_hub_source(source: str) -> bool:
    return source.startswith(SCHEME)


def parse(source: str) -> HubRef:
    """`hf://owner/repo[@revision][/subfolder]` → HubRef; UsageError when malformed."""
    if not is_hub_source(source):
        raise UsageError(f"{source}: not a Hub source (hf://owner/repo[@revision][/subfolder])")
    parts = source[len(SCHEME) :].split("/")
    if len(parts) < 2:
        raise UsageError(f"{source}: name the repo as hf://owner/repo[@revision][/subfolder]")
    name, at, revision = parts[1].partition("@")
    repo_id, sub = f"{parts[0]}/{name}", parts[2:]
    if not _REPO.match(repo_id) or ".." in repo_id:
        raise UsageError(f"{source}: {repo_id!r} is not a Hub repo id (owner/repo)")
    if at and not _REVISION.match(revision):
        raise UsageError(f"{source}: {revision!r} is not a revision (a branch, tag or commit sha)")
    if any(p in ("", ".", "..") for p in sub):
        raise UsageError(f"{source}: the subfolder must be a relative path without empty, '.' or '..' parts")
    return HubRef(repo_id, revision or None, "/".join(sub))


def max_wait_s() -> float:
    """Longest time one source spends retrying a rate-limited or failing Hub (ZOO_HUB_MAX_WAIT_S, default 120)."""
    return config.HUB_MAX_WAIT_S.get()


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _cache_dir() -> str | None:
    """The Hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _retrying(source: str, call: Callable[[], T]) -> T:
    """call(), again after a 429 (waiting its Retry-After), a 5xx or a connection error, with exponential backoff,
    until ZOO_HUB_MAX_WAIT_S is spent (counting the time the calls themselves take); then an InputError."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    deadline, delay = time.monotonic() + max_wait_s(), 1.0
    while True:
        try:
            return call()
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status != 429 and (status is None or status < 500):
                raise
            after = exc.response.headers.get("Retry-After", "") if exc.response is not None else ""
            wait = float(after) if after.isdigit() else delay
            reason = f"the Hub answered {status}" + (f" (Retry-After: {after} s)" if after else "")
        except httpx2.TransportError as exc:
            wait, reason = delay, f"network error ({type(exc).__name__}: {str(exc)[:200]})"
        if time.monotonic() + wait > deadline:
            raise InputError(source, f"{reason}; gave up after ZOO_HUB_MAX_WAIT_S={max_wait_s():g} s of retries")
        time.sleep(wait)
        delay = min(delay * 2, 30.0)


def _hub_errors(source: str, ref: HubRef, call: Callable[[], T]) -> T:
    """call() with the Hub's errors as InputErrors naming the source."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return _retrying(source, call)
    except GatedRepoError:
        raise InputError(source, "gated repo: accept its conditions on the Hub and set HF_TOKEN (or log in)") from None
    except RepositoryNotFoundError:
        raise InputError(source, "no such repo on the Hub, or a private one this token cannot read (set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise InputError(source, f"no revision {ref.revision!r} in {ref.repo_id}") from None
    except RemoteEntryNotFoundError:
        raise InputError(source, "a listed file is missing on the Hub (the repo changed meanwhile): try again") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        if offline():
            raise InputError(source, "not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it") from None
        raise InputError(source, f"the Hub could not be reached: {_first_line(exc)}") from None
    except HfHubHTTPError as exc:
        raise InputError(source, f"the Hub refused it: {_first_line(exc)}") from None
    except OSError as exc:  # the client's consistency check: the bytes received are not the size listed
        raise InputError(source, f"download failed: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def choose(ref: HubRef, sizes: Mapping[str, int | None], source: str) -> tuple[list[str], str]:
    """The files to download (PEFT's config and weights, else one LoRA .safetensors; the card when present) and
    the path to read, both relative to the snapshot; refuses missing adapters and files over ZOO_MAX_FILE_BYTES."""
    sub = ref.subfolder
    if sub in sizes:  # the subfolder names one file
        chosen, target = [sub], sub
    else:
        prefix = f"{sub}/" if sub else ""
        here = {n[len(prefix) :] for n in sizes if n.startswith(prefix) and "/" not in n[len(prefix) :]}
        if CONFIG in here:
            weights = next((f for f in PEFT_WEIGHTS if f in here), None)
            if weights is None:
                raise InputError(source, f"{CONFIG} without {' or '.join(PEFT_WEIGHTS)}: no adapter weights")
            chosen, target = [prefix + CONFIG, prefix + weights], sub or "."
        else:
            tensors = sorted(f for f in here if f.endswith(".safetensors"))
            if DIFFUSERS_LORA in tensors:
                tensors = [DIFFUSERS_LORA]
            if len(tensors) != 1:
                found = "no .safetensors file" if not tensors else f"{len(tensors)} .safetensors files ({', '.join(tensors[:5])})"
                raise InputError(
                    source,
                    f"no adapter to read: neither a PEFT adapter ({CONFIG}) nor one LoRA file ({found}); name one: hf://owner/repo/FILE",
                )
            chosen = [prefix + tensors[0]]
            target = chosen[0]
    for f in chosen:
        size = sizes.get(f)
        if size is not None and size > max_file_bytes():
            raise InputError(source, f"{f} is {size} bytes, over the limit of {max_file_bytes()} bytes (ZOO_MAX_FILE_BYTES)")
    card_size = sizes.get(CARD, MAX_CARD_BYTES + 1) if CARD in sizes else None
    card = [CARD] if card_size is not None and card_size <= MAX_CARD_BYTES else []
    return chosen + card, target


def _relation(card: dict[str, Any], tags: list[str]) -> str | None:
    """The card's base_model_relation, else the one the Hub's base_model:<relation>:<id> tags give."""
    given = card.get("base_model_relation")
    if isinstance(given, str) and given in RELATIONS:
        return given
    for tag in tags:
        parts = tag.split(":")
        if len(parts) >= 3 and parts[0] == "base_model" and parts[1] in RELATIONS:
            return parts[1]
    return None


def _names(value: object) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value] if isinstance(value, list) else []


def _clean(value: object) -> Any:
    """Metadata as JSON that PostgreSQL accepts (no NUL characters)."""
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {str(k).replace("\x00", ""): _clean(v) for k, v in value.items()}
    return value


def origin_of(ref: HubRef, sha: str, card: dict[str, Any], tags: list[str], info: Any = None) -> Origin:
    """What the repo says about the adapter: its card's metadata and tags, and (online) the Hub's model info."""
    bases = _names(card.get("base_model")) or [t.split(":")[-1] for t in tags if t.startswith("base_model:") and t.count(":") >= 2]
    metadata = {
        "datasets": _names(card.get("datasets")),
        "card_base_model": list(dict.fromkeys(bases)),
        "base_model_relation": _relation(card, tags),
        "pipeline_tag": getattr(info, "pipeline_tag", None) or card.get("pipeline_tag"),
        "library_name": getattr(info, "library_name", None) or card.get("library_name"),
        "downloads": getattr(info, "downloads", None),
        "likes": getattr(info, "likes", None),
        "last_modified": info.last_modified.isoformat() if getattr(info, "last_modified", None) else None,
    }
    license_ = card.get("license")
    return Origin(
        uri=ref.uri,
        name=ref.uri[len(SCHEME) :],
        revision=sha,
        author=_clean(str(getattr(info, "author", None) or ref.repo_id.split("/")[0]))[:128],
        license=_clean(str(license_))[:128] if license_ else None,
        tags=_clean(tags),
        metadata=_clean({k: v for k, v in metadata.items() if v not in (None, [])}),
    )


def resolve(source: str) -> Resolved:
    """Pin a source to a commit and choose its files (nothing is downloaded); offline, from the local cache."""
    ref = parse(source)
    if offline():
        return _resolve_cached(source, ref)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint())
    info = _hub_errors(source, ref, lambda: api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True))
    if not info.sha or not _SHA.match(info.sha):
        raise InputError(source, f"the Hub gave no commit sha for revision {ref.revision or 'main'}")
    siblings = {s.rfilename: s for s in info.siblings or []}
    names, target = choose(ref, {n: (s.lfs.size if s.lfs else s.size) for n, s in siblings.items()}, source)
    files = {n: _expected(siblings[n]) for n in names}
    card = info.card_data.to_dict() if info.card_data is not None else {}
    return Resolved(source, ref, info.sha, files, target, origin_of(ref, info.sha, card, [str(t) for t in info.tags or []], info))


def _expected(sibling: Any) -> tuple[int | None, str | None, bool]:
    if sibling.lfs:
        return sibling.lfs.size, sibling.lfs.sha256, True
    return sibling.size, sibling.blob_id, False


def _resolve_cached(source: str, ref: HubRef) -> Resolved:
    """Offline: the commit the cache holds for the revision (a sha, or a branch or tag it recorded) and its files."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(_cache_dir() or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    revision = ref.revision or "main"
    ref_file = storage / "refs" / revision
    sha = revision if _SHA.match(revision) else (ref_file.read_text().strip() if ref_file.is_file() else None)
    snapshot = storage / "snapshots" / sha if sha else None
    if snapshot is None or not snapshot.is_dir():
        raise InputError(source, f"revision {revision} is not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it")
    sizes = {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
    names, target = choose(ref, sizes, source)
    card: dict[str, Any] = {}
    if CARD in names:
        from huggingface_hub import ModelCard

        card = ModelCard((snapshot / CARD).read_text(errors="replace"), ignore_metadata_errors=True).data.to_dict()
    tags = _names(card.get("tags"))
    return Resolved(source, ref, str(sha), {n: (sizes[n], None, False) for n in names}, target, origin_of(ref, str(sha), card, tags))


def cached_path(uri: str, sha: str) -> Path | None:
    """Where the Hub cache holds a source (hf://owner/repo[/subfolder], no revision) at commit `sha`, as `download` left
    it; None when the cache does not hold it or the source is not a Hub one. Reads the cache only, never the network."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        ref = parse(uri)
    except UsageError:
        return None
    if ref.revision is not None or not _SHA.match(sha):
        return None
    storage = Path(_cache_dir() or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    path = storage / "snapshots" / sha / ref.subfolder
    return path if path.exists() else None


def download(resolved: Resolved) -> tuple[Path, Origin]:
    """Fetch the resolved files at their commit into the Hub cache (files already cached are not fetched again),
    check them against the sizes and hashes listed, and return the path to read with the origin (the card's text
    added). A file whose bytes are not those listed (the repo changed under the download) is dropped from the
    cache and the source fails: trying again fetches it anew."""
    from huggingface_hub import snapshot_download

    r = resolved
    patterns = list(r.files)
    local = Path(
        _hub_errors(
            r.source,
            r.ref,
            lambda: snapshot_download(r.ref.repo_id, revision=r.sha, allow_patterns=patterns, cache_dir=_cache_dir(), endpoint=_endpoint()),
        )
    )
    for name, expected in r.files.items():
        _verify(r.source, local / name, name, *expected)
    _record_ref(local.parent.parent, r.ref.revision or "main", r.sha)
    origin = r.origin
    card_file = local / CARD
    if CARD in r.files and card_file.is_file():
        origin = replace(origin, card=card_file.read_text(errors="replace").replace("\x00", ""))
    return local / r.target, origin


def _record_ref(storage: Path, revision: str, sha: str) -> None:
    """Record in the cache's refs/ which commit the branch or tag was (the download was pinned to the sha, so the
    client did not), so that offline mode finds it."""
    if _SHA.match(revision) or not (storage / "snapshots" / sha).is_dir():
        return
    ref = storage / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == sha:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(sha)
    tmp.replace(ref)


def _verify(source: str, path: Path, name: str, size: int | None, digest: str | None, lfs: bool) -> None:
    if not path.is_file():
        raise InputError(source, f"{name} was not downloaded")
    data_size = path.stat().st_size
    if digest is None and size is None:
        return
    h = hashlib.sha256() if lfs else hashlib.sha1(f"blob {data_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if (size is not None and data_size != size) or (digest is not None and h.hexdigest() != digest):
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise InputError(source, f"{name} changed on the Hub after it was listed (its bytes are not those listed): try again")


def crawl(
    base_model: str, search: str | None = None, author: str | None = None, library: str | None = None, limit: int | None = None
) -> list[str]:
    """The Hub's adapters of a base model (its `base_model:adapter:ID` tag) as hf:// sources, every page followed."""
    from huggingface_hub import HfApi

    if not base_model or any(c.isspace() for c in base_model):
        raise UsageError(f"{base_model!r} is not a Hub model id")
    api = HfApi(endpoint=_endpoint())
    filters = [f"base_model:adapter:{base_model}", *([library] if library else [])]
    what = f"adapters of {base_model}"

    def listing() -> list[str]:
        return [SCHEME + m.id for m in api.list_models(filter=filters, search=search, author=author, limit=limit)]

    try:
        return _hub_errors(what, HubRef(base_model, None, ""), listing)
    except InputError as exc:
        raise UsageError(f"listing the Hub's {exc}") from None


def fetch(source: str) -> tuple[Path, Origin]:
    """Resolve and download one Hub source: the local directory (or file) to read, and its origin."""
    return download(resolve(source))
