"""A stored LoRA adapter written back as files: a PEFT directory (or its zip), a diffusers-style or a
kohya-style `.safetensors` file, rebuilt from its canonical form.

Each module's update is stored as U·diag(S)·Vᵀ = s·B·A with the file's scaling s (alpha/r, or
alpha/√r with rsLoRA) folded into S. An export writes B = U·√S and A = √S·Vᵀ at the canonical rank
k = len(S) with alpha = k, so the file's scaling is 1 and its effective update is the stored one.
Keys are the exact inverse of the readers in zoo/formats (same module names, same suffixes), so
ingesting an export finds the stored adapter as a duplicate.

A PEFT adapter's other tensors (its head: modules_to_save, ...) and each conv module's kernel (the factors hold only
the flattened in·kh·kw) are stored at ingest (zoo/services/file_parts.py). For an adapter stored before they were
(or whose head was past ZOO_MAX_HEAD_BYTES), they are read from the source file where it still is as ingested
(zoo/services/source_file.py); where it is not, a PEFT export leaves the head out and clears what PEFT cannot load
without it (modules_to_save, and a task type that wraps a head), saying so in its notes (`export_notes`), and an
adapter with a conv module whose kernel is not known is refused.

Refused besides: stored checkpoints (spectra only, or truncated low-rank deltas named by state-dict keys: not LoRA
adapters) and DoRA adapters (their magnitude vectors are not stored).
"""

from __future__ import annotations

import io
import json
import math
import re
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import save

from zoo.domain.canonical import CanonicalFactors
from zoo.domain.fingerprint import NamedFactors
from zoo.domain.kohya_names import is_kohya_name, kohya_names
from zoo.errors import InputError, NotFoundError, StorageError, UsageError
from zoo.formats import LORA_FORMATS
from zoo.formats.cloneofsimo import FORMAT as CLONEOFSIMO
from zoo.formats.kohya import DORA_SCALE
from zoo.formats.kohya import PAIRS as SINGLE_FILE_PAIRS
from zoo.formats.peft import CONFIG_NAME, WEIGHT_NAMES
from zoo.formats.peft import KEY_PREFIX as PEFT_PREFIX
from zoo.formats.peft import PAIRS as PEFT_PAIRS
from zoo.services.file_parts import FileParts, file_parts, needs_file
from zoo.services.source_file import read_source
from zoo.store import repository
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter, named_base_model
from zoo.store.session import Session, read_snapshot

T = TypeVar("T")
FORMATS = ("peft", "diffusers", "kohya")
#: stored formats whose updates are LoRA adapters (the others are checkpoints)
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_KOHYA_PAIR, _DIFFUSERS_PAIR = SINGLE_FILE_PAIRS[0], SINGLE_FILE_PAIRS[2]
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same adapter always zips to the same bytes
#: PEFT task types whose model wraps a task head in modules_to_save (PeftModelForSequenceClassification, ...): PEFT
#: loads such an adapter only with the head's tensors
HEAD_TASKS = ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS")


@dataclass(frozen=True)
class ModuleLayout:
    kind: str  # linear | conv | embedding
    transposed: bool  # the stored update is (B·A)ᵀ of PEFT's factors (embeddings, fan_in_fan_out layers)
    kernel: tuple[int, ...] | None = None  # a conv module's (in_channels, k...), as stored or read from the source file


@dataclass(frozen=True)
class ExportMeta:
    """What an export needs to know of a stored adapter besides its factors."""

    adapter_id: int
    name: str
    format: str
    base_model: str | None  # None when unknown
    config: dict
    modules: dict[str, ModuleLayout]
    extra_tensors: tuple[str, ...] = ()
    #: where the adapter was ingested from (a path or hf:// source)
    source_uri: str = ""
    #: a PEFT adapter's tensors that are not LoRA factors (its head), by their names in extra_tensors; None when it
    #: has none or they are neither stored nor in the source file as ingested
    heads: dict[str, torch.Tensor] | None = None
    #: the source file the head was read from, for an adapter stored before heads were (None: the store, or no head)
    head_from: str | None = None


def lora_factors(f: CanonicalFactors) -> tuple[torch.Tensor, torch.Tensor]:
    """(A k×in, B out×k) with B·A = U·diag(S)·Vᵀ: B = U·√S, A = √S·Vᵀ. A zero update (k = 0) is
    written as rank 1 zeros, as no format has rank 0."""
    if f.rank == 0:
        return f.V.new_zeros(1, f.V.shape[0]), f.U.new_zeros(f.U.shape[0], 1)
    root = f.S.sqrt()
    return (f.V * root).T.contiguous(), (f.U * root).contiguous()


def export_files(factors: NamedFactors, meta: ExportMeta, fmt: str) -> dict[str, bytes]:
    """The files of an export in format `fmt` (peft | diffusers | kohya), by file name."""
    check_exportable(meta, fmt)
    if fmt == "peft":
        heads = {PEFT_PREFIX + name: t for name, t in (meta.heads or {}).items()}  # PEFT loads them by these keys
        config = json.dumps(peft_config(factors, meta, meta.heads is not None), indent=2, sort_keys=True) + "\n"
        return {CONFIG_NAME: config.encode(), WEIGHT_NAMES[0]: _safetensors({**_peft_tensors(factors, meta), **heads}, {})}
    header = {"ss_sd_model_name": meta.base_model} if meta.base_model else {}  # the header key the reader takes the base from
    if fmt == "diffusers" and not _kohya_named(meta):
        return {DIFFUSERS_WEIGHT_NAME: _safetensors(_single_file_tensors(factors, meta, {}, _DIFFUSERS_PAIR, alpha=False), header)}
    tensors = _safetensors(_single_file_tensors(factors, meta, _kohya_file_names(meta), _KOHYA_PAIR, alpha=True), header)
    return {DIFFUSERS_WEIGHT_NAME if fmt == "diffusers" else f"{file_stem(meta)}.safetensors": tensors}


def export_zip(factors: NamedFactors, meta: ExportMeta) -> bytes:
    """The PEFT export as a zip holding one directory named after the adapter."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in export_files(factors, meta, "peft").items():
            info = zipfile.ZipInfo(f"{file_stem(meta)}/{name}", date_time=_ZIP_DATE)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def check_exportable(meta: ExportMeta, fmt: str) -> None:
    """Refuse an unknown format and what cannot be written as a LoRA file (see the module docstring)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    what = f"adapter {meta.adapter_id} ({meta.name})"
    if meta.format not in LORA_FORMATS:
        raise UsageError(f"{what} is a {meta.format}, not a LoRA adapter: only LoRA adapters ({', '.join(LORA_FORMATS)}) can be exported")
    if meta.config.get("use_dora") or any(k.endswith(DORA_SCALE) for k in meta.extra_tensors):  # kohya files stored before use_dora
        raise UsageError(f"{what} is a DoRA adapter: its magnitude vectors are not stored, so it cannot be written back")
    if meta.format == CLONEOFSIMO:
        raise UsageError(
            f"{what} is a cloneofsimo lora_diffusion file: its modules are named by the order lora_diffusion injected them "
            "(unet:0, ...), not by their paths in the model, so no format can name them for a library to load"
        )
    full = sorted(name for name, m in meta.modules.items() if m.kind == "full")
    if full:
        raise UsageError(f"{what}: module {full[0]} is stored as its spectrum only (full rank): there are no factors to write back")
    conv = sorted(name for name, m in meta.modules.items() if m.kind == "conv" and m.kernel is None)
    if conv:
        raise UsageError(
            f"{what}: module {conv[0]} is a conv layer whose kernel size is not stored (stored before kernels were), nor "
            f"read from a source file at {meta.source_uri} with the bytes ingested, so it cannot be written back"
        )
    if fmt == "kohya" or (fmt == "diffusers" and _kohya_named(meta)):
        _kohya_file_names(meta)


def _kohya_file_names(meta: ExportMeta) -> dict[str, str]:
    """Each module's name in a file of kohya's layout (its kohya name, else its own); two modules of one name refused."""
    names = {name: kohya or name for name, kohya in kohya_names(list(meta.modules)).items()}
    clash = Counter(names.values()).most_common(1)
    if clash and clash[0][1] > 1:
        twins = sorted(n for n, k in names.items() if k == clash[0][0])
        raise UsageError(f"adapter {meta.adapter_id} ({meta.name}): modules {twins[0]} and {twins[1]} have one kohya name, {clash[0][0]}")
    return names


def exportable_formats(meta: ExportMeta) -> list[str]:
    """The formats an export of the adapter is written in (those `check_exportable` does not refuse)."""
    out = []
    for fmt in FORMATS:
        try:
            check_exportable(meta, fmt)
        except UsageError:
            continue
        out.append(fmt)
    return out


def _conv_shaped(A: torch.Tensor, B: torch.Tensor, kernel: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix pair as a conv module's factors when `kernel` is given: A r × in × k…, B out × r × 1…."""
    if kernel is None:
        return A, B
    if math.prod(kernel) != A.shape[1]:
        raise StorageError(f"the kernel {list(kernel)} does not match the stored module's {A.shape[1]} inputs")
    return A.reshape(A.shape[0], *kernel), B.reshape(*B.shape, *([1] * (len(kernel) - 1)))


def export_notes(meta: ExportMeta, fmt: str) -> list[str]:
    """What a user should know of an export in format `fmt`: where the adapter's head came from (the source file, for
    an adapter stored before heads were) or why it is left out, the PEFT config values cleared without it, and module
    names kept where kohya has none."""
    what = f"{len(meta.extra_tensors)} tensors that are not LoRA factors ({_listed(meta.extra_tensors, 3)})"
    notes: list[str] = []
    if fmt == "peft" and meta.head_from is not None:
        notes.append(f"{what} are not stored: written from the source file {meta.head_from} (the bytes ingested, by SHA-256)")
    elif meta.extra_tensors and (fmt != "peft" or meta.heads is None):
        gone = f"the source is not at {meta.source_uri} as ingested" if fmt == meta.format == "peft" else f"{fmt} has no place for them"
        notes.append(f"{what} are {'not stored and ' if fmt == 'peft' else ''}{gone}: not exported")
    unnamed = sorted(name for name, kohya in kohya_names(list(meta.modules)).items() if kohya is None)
    if fmt == "kohya" and unnamed:
        notes.append(
            f"{len(unnamed)} modules are not an SD UNet's or text encoder's ({_listed(unnamed, 2)}): they keep their stored names, "
            "which A1111 and ComfyUI may not load"
        )
    if fmt == "diffusers" and _kohya_named(meta):
        notes.append("the modules have kohya-ss names: written in kohya's layout, which diffusers' load_lora_weights converts")
    task = meta.config.get("task_type")
    if fmt == "peft" and task in HEAD_TASKS and meta.heads is None:
        notes.append(f"task_type {task} cleared: PEFT loads a {task} adapter only with its head, which this export lacks")
    return notes


def _listed(names: Sequence[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def file_stem(meta: ExportMeta) -> str:
    """The adapter's name made safe as a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", meta.name).strip("._-") or f"adapter-{meta.adapter_id}"


def peft_config(factors: NamedFactors, meta: ExportMeta, with_heads: bool) -> dict[str, object]:
    """adapter_config.json: r and lora_alpha the most common rank (scaling 1), exact-name patterns for the other modules;
    modules_to_save and a task type that wraps a head only `with_heads` (the export holds the head's tensors)."""
    ranks = {name: max(f.rank, 1) for name, f in factors}
    counts = Counter(ranks.values())
    r = max(counts, key=lambda k: (counts[k], k))
    pattern = {f"^{re.escape(name)}": k for name, k in ranks.items() if k != r}
    task = meta.config.get("task_type")
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": meta.base_model,
        "task_type": task if with_heads or task not in HEAD_TASKS else None,
        "modules_to_save": meta.config.get("modules_to_save") if with_heads else None,
        "target_modules": meta.config.get("target_modules") or sorted(ranks),
        "r": r,
        "lora_alpha": r,
        "rank_pattern": pattern,
        "alpha_pattern": pattern,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": any(m.transposed and m.kind == "linear" for m in meta.modules.values()),
        "lora_dropout": 0.0,
        "bias": "none",
        "inference_mode": True,
    }


def _peft_tensors(factors: NamedFactors, meta: ExportMeta) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, f in factors:
        layout = meta.modules[name]
        A, B = _conv_shaped(*lora_factors(f), layout.kernel)
        if layout.transposed:  # PEFT's factors give dWᵀ: (B·A)ᵀ = Aᵀ·Bᵀ
            A, B = B.T.contiguous(), A.T.contiguous()
        a_suffix, b_suffix = PEFT_PAIRS[1] if layout.kind == "embedding" else PEFT_PAIRS[0]
        out[PEFT_PREFIX + name + a_suffix], out[PEFT_PREFIX + name + b_suffix] = A, B
    return out


def _kohya_named(meta: ExportMeta) -> bool:
    """Whether an adapter's modules have kohya-ss names (a diffusers export writes them in kohya's layout, which
    diffusers' loader converts: there is no diffusers name to give them without the model)."""
    return any(is_kohya_name(name) for name in meta.modules)


def _single_file_tensors(
    factors: NamedFactors, meta: ExportMeta, names: dict[str, str], pair: tuple[str, str], alpha: bool
) -> dict[str, torch.Tensor]:
    """down/A and up/B factors in the layout of the layer's stored weight (dW = up·down; conv kernels as the source's)
    under each module's name in `names` (else its own), with an alpha = rank tensor if asked."""
    out: dict[str, torch.Tensor] = {}
    for stored, f in factors:
        A, B = _conv_shaped(*lora_factors(f), meta.modules[stored].kernel)
        name = names.get(stored, stored)
        out[name + pair[0]], out[name + pair[1]] = A, B
        if alpha:
            out[f"{name}.alpha"] = A.new_tensor(float(A.shape[0]))
    return out


def _safetensors(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> bytes:
    return save(tensors, metadata={"format": "pt", **header})


def load_for_export(session: Session, blobs: BlobStore, adapter_id: int) -> tuple[NamedFactors, ExportMeta]:
    """A stored adapter's canonical factors (none for a spectra-only checkpoint) and what its export needs."""
    adapter = _adapter(session, adapter_id)
    factors = _read_blob(blobs, adapter_id, "factors", adapter.factors_blob, blobs.get_factors) if adapter.factors_blob else []
    return factors, _meta(blobs, adapter, with_head=True)


def load_meta(session: Session, blobs: BlobStore, adapter_id: int, with_head: bool = True) -> ExportMeta:
    """What an export of a stored adapter needs besides its factors; without its head (`with_head` False), what
    `check_exportable` asks."""
    return _meta(blobs, _adapter(session, adapter_id), with_head)


def _adapter(session: Session, adapter_id: int) -> Adapter:
    """The adapter with its modules, read in one snapshot (zoo.store.session.read_snapshot, where the session's
    transaction has not begun): on PostgreSQL a delete committed between the adapter's statement and its modules'
    would otherwise leave an adapter without modules, whose export fails on its first factor (KeyError)."""
    adapter = repository.get_adapter(read_snapshot(session), adapter_id, with_modules=True)
    if adapter is None:
        raise NotFoundError(f"no adapter with id {adapter_id}: see `zoo list`")
    return adapter


def _meta(blobs: BlobStore, adapter: Adapter, with_head: bool) -> ExportMeta:
    """The head and conv kernels from the store; for an adapter stored before they were kept (or whose head was past
    ZOO_MAX_HEAD_BYTES), from its source file where that is still the file ingested (see the module docstring)."""
    extra = tuple(adapter.extra_tensors or ())
    modules = {m.name: ModuleLayout(m.kind, m.transposed, tuple(m.kernel) if m.kernel else None) for m in adapter.modules}
    heads = _read_blob(blobs, adapter.id, "head", adapter.head_blob, blobs.get) if with_head and adapter.head_blob else None
    head_lacking = with_head and heads is None and needs_file(adapter.format, {}, extra)
    kernels_lacking = {m.name: m.in_features for m in adapter.modules if m.kind == "conv" and not m.kernel}
    head_from = None
    source = read_source(adapter.source_uri, adapter.source_revision, adapter.file_sha256) if head_lacking or kernels_lacking else None
    if source is not None:
        try:
            parts = file_parts(source.raw, adapter.format, kernels_lacking, extra if head_lacking else ())
        except InputError:  # read as ingested, yet unreadable now: as if it were gone
            parts = FileParts(None, {})
        modules |= {name: replace(modules[name], kernel=kernel) for name, kernel in parts.kernels.items()}
        if parts.head is not None:
            heads, head_from = parts.head, str(source.path)
    return ExportMeta(
        adapter_id=adapter.id,
        name=adapter.name,
        format=adapter.format,
        base_model=named_base_model(adapter.base_model),
        config=adapter.config or {},
        modules=modules,
        extra_tensors=extra,
        source_uri=adapter.source_uri,
        heads=heads,
        head_from=head_from,
    )


def _read_blob(blobs: BlobStore, adapter_id: int, what: str, digest: str, read: Callable[[str], T]) -> T:
    try:
        return read(digest)
    except (OSError, SafetensorError) as exc:
        raise StorageError(
            f"adapter {adapter_id}: its {what} blob {digest} is missing or unreadable ({type(exc).__name__}): "
            "see `zoo check`, and ingest the adapter again"
        ) from None
