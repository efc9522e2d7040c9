"""From a read adapter to what ingest stores: its base model, its module rows, hashes and sketch, what its source
said, and the parts of its file an export needs besides the factors; no database access."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zoo.domain.base_models import contradiction, guess_base_model
from zoo.domain.canonical import CanonicalFactors
from zoo.domain.fingerprint import Sketch, canonical_hash, sketch, structure_hash
from zoo.domain.spectra import Spectrum, spectrum_from_singular_values
from zoo.domain.transforms import FactorSummary
from zoo.formats import AdapterData, RawAdapter, adapter_name, layer_index, module_type
from zoo.formats.limits import MAX_ADAPTER_NAME
from zoo.labels import LabelRow, source_labels
from zoo.services.file_parts import FileParts, file_parts, max_head_bytes, needs_file
from zoo.services.threads import one_torch_thread
from zoo.sources import Origin
from zoo.store.models import Adapter, Label
from zoo.store.repository import ModuleFields


class ModuleRow(ModuleFields):
    """A module table row (without its adapter id), for one bulk insert per adapter."""

    out_features: int
    in_features: int


def _module_row(
    name: str,
    kind: str,
    shape: tuple[int, int],
    spec: Spectrum,
    rank: int | None = None,
    canonical_rank: int | None = None,
    alpha: float | None = None,
    scale: float | None = None,
    transposed: bool = False,
    kernel: tuple[int, ...] | None = None,
) -> ModuleRow:
    """A module's row: its name, shape and spectrum, with its LoRA rank, alpha and scale and a conv module's kernel
    where it has them."""
    return {
        "name": name,
        "layer_index": layer_index(name),
        "module_type": module_type(name),
        "kind": kind,
        "out_features": shape[0],
        "in_features": shape[1],
        "rank": rank,
        "canonical_rank": canonical_rank,
        "alpha": alpha,
        "scale": scale,
        "transposed": transposed,
        "kernel": list(kernel) if kernel is not None else None,
        "singular_values": spec.singular_values,
        "spectral_norm": spec.spectral_norm,
        "frobenius_norm": spec.frobenius_norm,
        "stable_rank": spec.stable_rank,
        "effective_rank": spec.effective_rank,
        "power_law_alpha": spec.power_law_alpha,
        "power_law_xmin": spec.power_law_xmin,
        "power_law_ks": spec.power_law_ks,
    }


@dataclass
class Described:
    """An adapter ready to store: its row, its module rows and, for LoRA-like updates, its canonical factors and
    their sketch (the blob is staged after: see Ingestor._ingest)."""

    adapter: Adapter
    modules: list[ModuleRow]
    factors: list[tuple[str, CanonicalFactors]]
    sketch: Sketch | None


def describe(
    data: AdapterData,
    source_uri: str,
    base_model: str,
    canonical: list[CanonicalFactors],
    kernels: Mapping[str, tuple[int, ...]] | None = None,
) -> Described:
    """Spectra, hashes and rows of a read adapter from its modules' canonical factors (module by module, on one
    torch thread: see one_torch_thread), with its conv modules' `kernels` (zoo.services.file_parts); no database access."""
    with one_torch_thread(bool(data.modules)):
        return _describe(data, source_uri, base_model, canonical, kernels or {})


def _describe(
    data: AdapterData, source_uri: str, base_model: str, canonical: list[CanonicalFactors], kernels: Mapping[str, tuple[int, ...]]
) -> Described:
    factors: list[tuple[str, CanonicalFactors]] = []
    rows: list[ModuleRow] = []
    if data.modules:
        for m, f in zip(data.modules, canonical, strict=True):
            factors.append((m.name, f))
            rows.append(
                _module_row(
                    m.name,
                    m.kind,
                    (int(f.U.shape[0]), int(f.V.shape[0])),
                    spectrum_from_singular_values(f.S.numpy()),
                    rank=m.rank,
                    canonical_rank=f.rank,
                    alpha=m.alpha,
                    scale=m.scale,
                    transposed=m.transposed,
                    kernel=kernels.get(m.name),
                )
            )
        shapes = [(n, int(f.U.shape[0]), int(f.V.shape[0])) for n, f in factors]
        summary = FactorSummary.of({m.name: m for m in data.modules}, dict(factors)).as_json()
        sk = sketch(factors)
        chash, dw_norm = canonical_hash(factors, sk.fingerprint), sk.norm
    else:
        rows.extend(_module_row(fm.name, "full", fm.shape, fm.spectrum) for fm in data.full_matrices)
        shapes = [(fm.name, *fm.shape) for fm in data.full_matrices]
        chash, dw_norm, sk, summary = data.file_sha256, None, None, None  # nothing to canonicalize: identical files are the duplicates
    config = data.config
    adapter = Adapter(
        name=adapter_name(data.path),
        source_uri=source_uri,
        base_model=base_model,
        format=data.format,
        rank=config.get("r"),
        alpha=config.get("lora_alpha"),
        target_modules=config.get("target_modules"),
        task_type=config.get("task_type"),
        canonical_hash=chash,
        structure_hash=structure_hash(shapes),
        dw_norm=dw_norm,
        dw_probes=sk.raw if sk else None,
        file_sha256=data.file_sha256,
        size_bytes=data.size_bytes,
        factors_blob=None,
        factor_summary=summary,
        config=config,
        file_metadata=data.metadata,
        extra_tensors=data.extra_tensors,
        notes=data.notes,
    )
    return Described(adapter, rows, factors, sk)


def kept_parts(raw: RawAdapter, data: AdapterData) -> FileParts:
    """What an export needs of the read file besides the factors (zoo.services.file_parts): a PEFT head and conv
    kernels; a head past ZOO_MAX_HEAD_BYTES is noted on the adapter, not stored."""
    kinds = {m.name: m.kind for m in data.modules}
    if not needs_file(data.format, kinds, list(data.extra_tensors)):
        return FileParts(None, {})
    convs = {m.name: m.shape[1] for m in data.modules if m.kind == "conv"}
    parts = file_parts(raw, data.format, convs, list(data.extra_tensors), max_head_bytes())
    if parts.why_not:
        data.notes.append(f"the head ({len(data.extra_tensors)} tensors that are not LoRA factors) is not stored: {parts.why_not}")
    return parts


def resolve_base_model(data: AdapterData, named: tuple[str, str] | None) -> tuple[str, list[str]]:
    """The base model to store an adapter under, and warnings. Named (with who named it): that name, as given, with a
    warning when the module shapes name another known family (zoo.domain.base_models.contradiction); not named: the
    family its shapes name (or its own `unknown-<hash>` space), noted on the adapter as guessed."""
    shapes = [(m.name, *m.shape) for m in data.modules] or [(fm.name, *fm.shape) for fm in data.full_matrices]
    guess = guess_base_model(shapes)
    if named is None:
        data.notes.append(guess.describe())
        return guess.base_model, []
    base_model, by = named
    why = contradiction(base_model, guess)
    return base_model, [f"{data.path}: {why} (named by {by}; stored under {base_model!r} as named)"] if why else []


def apply_origin(a: Adapter, origin: Origin, labels: LabelRow | None = None) -> None:
    """Copy what the source said onto the adapter row, with the given labels it implies (zoo.labels.source_labels:
    stored with a new adapter only, never over a stored one's)."""
    a.source_uri, a.source_revision, a.author = origin.uri, origin.revision, origin.author
    if origin.name:
        a.name = origin.name[:MAX_ADAPTER_NAME]
    a.license, a.tags, a.card = origin.license, list(origin.tags) or None, origin.card
    a.source_metadata = dict(origin.metadata)
    a.labels = [Label(key=k, value=v, source="given") for k, v in source_labels(origin.metadata, labels).items()]
