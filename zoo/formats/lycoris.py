"""LyCORIS single-file adapters: LoHa (`hada_*`), LoKr (`lokr_*`) and full (`diff`) modules, each read as the
exact update LyCORIS applies, dW = s·B·A (conv kernels flattened to out × in·kh·kw, as everywhere in zoo).

- LoKr: dW = s·kron(W1, W2), each side stored whole or as a product w_a·w_b (a conv second side possibly in
  Tucker form). kron(B1·A1, B2·A2) = kron(B1, B2)·kron(A1, A2): an exact B·A of rank r1·r2, a side stored whole
  (a × c) taken at rank min(a, c) (I·W or W·I).
- LoHa: dW = s·(B1·A1) ⊙ (B2·A2) = B·A, with B[o, (i, j)] = B1[o, i]·B2[o, j] (the row-wise Kronecker, or
  face-splitting, product) and A[(i, j), c] = A1[i, c]·A2[j, c] (the column-wise Khatri–Rao product): rank r1·r2.
- full: dW stored whole.
Plain LoRA/LoCon modules (`lora_down`/`lora_up`) in such a file are read as the kohya reader reads them, and every
module is named by its model path where the model tables know its kohya name, as kohya files are.

s is LyCORIS's alpha/dim, as its training forward applies it: dim is the rank of a factored side (the rows of w1_b,
else of w2_b), a missing or zero alpha means alpha = dim, and a LoKr with both sides whole has s = 1.

A module whose exact rank exceeds half its smaller side (or the rank limit) is no useful low-rank update: a file
made only of such modules is read as full-rank deltas, their exact spectra only (as a checkpoint without a base);
in a file with low-rank modules too, they are kept exact at that rank. DoRA's `dora_scale` and a `scalar` are
recorded (by shape) and not applied; bias and norm deltas (`diff_b`, `w_norm`, `b_norm`) are recorded the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.domain.spectra import Spectrum, singular_values, spectrum_from_singular_values
from zoo.errors import InputError
from zoo.formats.kohya import DORA_SCALE, PAIRS, dora_note, kohya_base_model, kohya_scaling, model_named, pair_config, read_pairs
from zoo.formats.limits import check_widths, max_rank
from zoo.formats.records import AdapterData, FullMatrix, LoraModule, check_finite, check_pair

LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t1", "lokr_t2")
FULL = ("diff",)
#: LyCORIS writes LoCon modules in kohya's layout
LOCON = tuple(s.lstrip(".") for s in PAIRS[0]) + ("lora_mid.weight",)
#: per-module tensors recorded, not applied: alpha is read; the others change what dW means (see the docstring)
RECORDED = ("alpha", "dora_scale", "scalar", "diff_b", "w_norm", "b_norm")
#: LyCORIS algorithms whose update is no B·A (a rotation, a rescaling, a generalized LoRA with a bias term)
REFUSED = {
    "oft_blocks": "OFT/BOFT (a rotation of the weight)",
    "rescale": "OFT/BOFT (a rotation of the weight)",
    "on_input": "IA3 (a rescaling of the weight)",
    "a1.weight": "GLoRA",
    "lambda_layer": "T-LoRA",
}
#: tensor names that make a file LyCORIS's: its own algorithms' (LoCon files are kohya's layout, read as kohya)
CLAIMED = LOHA + LOKR + FULL + ("oft_blocks", "on_input", "lambda_layer")
PARAMS = LOHA + LOKR + FULL + LOCON + RECORDED + tuple(REFUSED)
#: most float32 elements one module's factors (or its dense update) may take once built: 1 GiB
MAX_BUILT_ELEMENTS = 1 << 28


def is_lycoris(keys: list[str]) -> bool:
    """Whether a file's tensor names include a LyCORIS algorithm's."""
    return any(_split(k)[1] in CLAIMED for k in keys)


def _split(key: str) -> tuple[str, str]:
    """(module stem, parameter name) of a tensor name; ("", key) for a name no LyCORIS parameter ends."""
    for param in PARAMS:
        if key.endswith("." + param):
            return key[: -len(param) - 1], param
    return "", key


@dataclass
class _Update:
    """One module's exact update, scale·B·A, with a way to its singular values that need not build B·A."""

    name: str
    algo: str
    kind: str
    alpha: float
    scale: float
    shape: tuple[int, int]
    rank: int
    factors: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # (A rank × in, B out × rank), unscaled
    singular_values: Callable[[], torch.Tensor]  # of the unscaled update

    @property
    def low_rank(self) -> bool:
        return self.rank <= min(self.shape) // 2 and self.rank <= max_rank()


def read_lycoris(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> AdapterData:
    """The modules of a LyCORIS file, each its exact update (see the module docstring)."""
    stems: dict[str, dict[str, str]] = {}
    extra: dict[str, list[int]] = {}
    for key in tensors:
        stem, param = _split(key)
        if param in REFUSED:
            raise InputError(path, f"{key}: LyCORIS {REFUSED[param]} modules are not a low-rank update B·A and cannot be canonicalized")
        if stem:
            stems.setdefault(stem, {})[param] = key
        else:
            extra[key] = _recorded(path, key, tensors)
    updates: list[_Update] = []
    locon: dict[str, torch.Tensor] = {}
    for stem in sorted(stems):
        keys = stems[stem]
        algos = [name for name, params in (("loha", LOHA), ("lokr", LOKR), ("full", FULL), ("locon", LOCON)) if set(keys) & set(params)]
        if len(algos) > 1:
            raise InputError(path, f"{stem} mixes LyCORIS algorithms ({', '.join(algos)}): one module has one")
        for param in set(keys) - set(LOHA + LOKR + FULL + LOCON) - {"alpha"}:
            extra[keys[param]] = _recorded(path, keys[param], tensors)
        if not algos:
            if "alpha" in keys:
                extra[keys["alpha"]] = _recorded(path, keys["alpha"], tensors)
            continue
        t = {p: tensors[k] for p, k in keys.items() if p not in RECORDED or p == "alpha"}
        if algos == ["locon"]:
            locon.update({keys[p]: v for p, v in t.items()})
        else:
            updates.append({"loha": _loha, "lokr": _lokr, "full": _full}[algos[0]](path, stem, t))
    check_widths(path, [(u.name, u.shape) for u in updates])  # before a spectrum or a factor is built
    modules = read_pairs(path, locon, PAIRS[:1], kohya_scaling(path))[0] if locon else []
    algorithms = dict(sorted(Counter([u.algo for u in updates] + ["locon"] * len(modules)).items()))
    notes = _notes(updates, modules, extra)
    if not modules and not any(u.low_rank for u in updates):
        return _spectra(path, updates, metadata, extra, algorithms, notes)
    modules = model_named(path, [*modules, *(_module(path, u) for u in updates)])
    config: dict[str, object] = {**pair_config(modules), "algorithms": algorithms}
    if any(k.endswith(DORA_SCALE) for k in extra):
        config["use_dora"] = True  # what dW leaves out (the magnitude) is not stored: no LoRA file can hold the update
    return AdapterData(
        path=path,
        format="lycoris",
        weight_files=[path],
        base_model=kohya_base_model(metadata),
        modules=modules,
        config=config,
        extra_tensors=extra,
        metadata=metadata,
        notes=notes,
    )


def _recorded(path: Path, key: str, tensors: Mapping[str, torch.Tensor]) -> list[int]:
    t = tensors[key]
    check_finite(path, key, t)
    return list(t.shape)


def _notes(updates: list[_Update], modules: list[LoraModule], extra: dict[str, list[int]]) -> list[str]:
    """What a user should know of the read: modules kept at a high rank, and what was recorded but not applied."""
    notes = []
    dense = [u for u in updates if not u.low_rank]
    if dense and (modules or len(dense) < len(updates)):
        notes.append(f"{len(dense)} LyCORIS modules have an exact rank over half their smaller side: kept exact at that rank")
    dora, scalars = (sum(k.endswith(suffix) for k in extra) for suffix in (DORA_SCALE, ".scalar"))
    biases = sum(k.endswith((".diff_b", ".w_norm", ".b_norm")) for k in extra)
    if dora:
        notes.append(dora_note(dora))
    if scalars:
        notes.append(f"{scalars} `scalar` tensors recorded, not applied: LyCORIS folds them into the saved factors, ignores them on load")
    if biases:
        notes.append(f"{biases} bias or norm deltas (diff_b, w_norm, b_norm) recorded, not part of dW")
    return notes


def _spectra(
    path: Path, updates: list[_Update], metadata: dict[str, str], extra: dict[str, list[int]], algorithms: dict[str, int], notes: list[str]
) -> AdapterData:
    """Every module a full-rank delta: its exact spectrum only, as a checkpoint without a base is stored."""
    if not updates:
        raise InputError(path, "empty adapter: no LyCORIS modules found")
    matrices = [FullMatrix(u.name, u.shape, _spectrum(u)) for u in updates]
    notes = [
        f"every LyCORIS module has an exact rank over half its smaller side (or past ZOO_MAX_RANK): read as {len(updates)} "
        "full-rank deltas, their exact spectra only (no factors: not searchable by dW, not exportable)",
        *notes,
    ]
    return AdapterData(
        path=path,
        format="lycoris",
        weight_files=[path],
        base_model=kohya_base_model(metadata),
        full_matrices=model_named(path, matrices),
        config={"algorithms": algorithms, "full_rank": True},
        extra_tensors=extra,
        metadata=metadata,
        notes=notes,
    )


def _spectrum(u: _Update) -> Spectrum:
    """The module's exact spectrum, its power-law tail fitted where it has at most ZOO_MAX_RANK values: the fit is
    quadratic in their number, and the kron of two small stored sides can have 500,000."""
    s = abs(u.scale) * u.singular_values()
    return spectrum_from_singular_values(s, fit_power_law=s.numel() <= max_rank())


def _module(path: Path, u: _Update) -> LoraModule:
    A, B = u.factors()
    check_pair(path, u.name, A, B)
    return LoraModule(u.name, A, B, u.alpha, u.scale, u.kind)


# --- the factors of one side: a product B·A given whole or as factors, its exact rank bounded by its shape ---


def _matrix(path: Path, name: str, t: torch.Tensor, ndim: tuple[int, ...] = (2,)) -> torch.Tensor:
    """A stored factor as a float32 matrix (a conv kernel flattened to rows × rest), checked."""
    if t.ndim not in ndim or not t.is_floating_point():
        raise InputError(path, f"{name} must be a floating {' or '.join(f'{n}-d' for n in ndim)} tensor, got {t.dtype} {list(t.shape)}")
    check_finite(path, name, t)
    return t.float().reshape(t.shape[0], -1)


def _whole(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) with B·A = W at rank min(a, c): I·W or W·I."""
    a, c = W.shape
    return (torch.eye(a), W) if a <= c else (W, torch.eye(c))


def _pair(path: Path, stem: str, labels: tuple[str, str], B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) as given, or the product taken whole where its rank is past its smaller side."""
    if B.shape[1] != A.shape[0]:
        raise InputError(path, f"shape mismatch in {stem}: {labels[0]} {list(B.shape)} and {labels[1]} {list(A.shape)} do not compose")
    return _whole(B @ A) if B.shape[1] > min(B.shape[0], A.shape[1]) else (B, A)


def _tucker(
    path: Path, stem: str, names: tuple[str, str, str], core: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) of a Tucker side W[p, q, k...] = Σ_ij core[i, j, k...]·w_a[i, p]·w_b[j, q] (LyCORIS's rebuild_tucker):
    B = w_aᵀ and A[i, (q, k...)] = Σ_j core[i, j, k...]·w_b[j, q]."""
    shapes = f"{names[0]} {list(core.shape)}, {names[1]} {list(w_a.shape)}, {names[2]} {list(w_b.shape)}"
    if core.ndim < 3 or w_a.ndim != 2 or w_b.ndim != 2 or core.shape[0] != w_a.shape[0] or core.shape[1] != w_b.shape[0]:
        raise InputError(path, f"{stem}: a Tucker side needs a (r, r, k...) core and (r, out), (r, in) factors, got {shapes}")
    for name, t in zip(names, (core, w_a, w_b), strict=True):
        _matrix(path, f"{stem}.{name}", t, (t.ndim,))
    A = torch.einsum("ij...,jq->iq...", core.float(), w_b.float()).reshape(core.shape[0], -1)
    return _pair(path, stem, (names[1] + "ᵀ", names[0]), w_a.float().T, A)


def _sv(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Singular values of B·A without building it: those of R_B·R_Aᵀ (B = Q_B·R_B, Aᵀ = Q_A·R_A)."""
    if B.shape[1] >= min(B.shape[0], A.shape[1]):
        return singular_values(B @ A)
    r_b, r_a = torch.linalg.qr(B.double()).R, torch.linalg.qr(A.T.double()).R
    return torch.linalg.svdvals(r_b @ r_a.T)


def _guard(path: Path, stem: str, shape: tuple[int, int], rank: int) -> None:
    """Refuse a module whose factors would be past MAX_BUILT_ELEMENTS."""
    need = rank * (shape[0] + shape[1])
    if need > MAX_BUILT_ELEMENTS:
        raise InputError(
            path,
            f"{stem}: its exact factors (rank {rank}, {shape[0]}×{shape[1]}) would take {need:,} elements, past {MAX_BUILT_ELEMENTS:,}",
        )


# --- the three algorithms ---


def _alpha_scale(path: Path, stem: str, t: Mapping[str, torch.Tensor], dim: int | None) -> tuple[float, float]:
    """(alpha, scale): LyCORIS's alpha/dim (kohya's: a missing or zero alpha is dim), scale 1 where no side is factored
    (dim None: alpha is recorded, not applied)."""
    alpha, scale = kohya_scaling(path)(stem, t.get("alpha"), dim or 1)
    return alpha, scale if dim else 1.0


def _kind(t: Mapping[str, torch.Tensor]) -> str:
    return "conv" if any(v.ndim > 2 for v in t.values()) else "linear"


def _need(path: Path, stem: str, t: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> list[torch.Tensor]:
    missing = [n for n in names if n not in t]
    if missing:
        raise InputError(path, f"{stem}: {', '.join(missing)} missing ({', '.join(sorted(t))} found)")
    return [t[n] for n in names]


def _loha(path: Path, stem: str, t: Mapping[str, torch.Tensor]) -> _Update:
    """dW = s·(w1_a·w1_b) ⊙ (w2_a·w2_b) (Tucker: each side rebuilt from hada_t1/hada_t2), as face-splitting B · Khatri–Rao A."""
    w1a, w1b, w2a, w2b = _need(path, stem, t, LOHA[:4])
    if ("hada_t1" in t) != ("hada_t2" in t):
        raise InputError(path, f"{stem}: a Tucker LoHa needs both hada_t1 and hada_t2")
    if "hada_t1" in t:
        sides = [
            _tucker(path, stem, (f"hada_t{i}", f"hada_w{i}_a", f"hada_w{i}_b"), t[f"hada_t{i}"], wa, wb)
            for i, wa, wb in ((1, w1a, w1b), (2, w2a, w2b))
        ]
    else:
        sides = [
            _pair(
                path,
                stem,
                (f"hada_w{i}_a", f"hada_w{i}_b"),
                _matrix(path, f"{stem}.hada_w{i}_a", wa),
                _matrix(path, f"{stem}.hada_w{i}_b", wb, (2, 3, 4, 5)),
            )
            for i, wa, wb in ((1, w1a, w1b), (2, w2a, w2b))
        ]
    (B1, A1), (B2, A2) = sides
    if B1.shape[0] != B2.shape[0] or A1.shape[1] != A2.shape[1]:
        raise InputError(
            path, f"shape mismatch in {stem}: the two LoHa sides are {B1.shape[0]}×{A1.shape[1]} and {B2.shape[0]}×{A2.shape[1]}"
        )
    shape = (int(B1.shape[0]), int(A1.shape[1]))
    k1, k2 = B1.shape[1], B2.shape[1]
    alpha, scale = _alpha_scale(path, stem, t, int(w1b.shape[0]))
    dense = k1 * k2 > min(shape)

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        _guard(path, stem, shape, min(shape) if dense else k1 * k2)
        if dense:
            B, A = _whole((B1 @ A1) * (B2 @ A2))
            return A, B
        B = (B1[:, :, None] * B2[:, None, :]).reshape(shape[0], k1 * k2)
        A = (A1[:, None, :] * A2[None, :, :]).reshape(k1 * k2, shape[1])
        return A, B

    def sv() -> torch.Tensor:
        A, B = factors()
        return _sv(B, A)

    return _Update(stem, "loha", _kind(t), alpha, scale, shape, min(k1 * k2, min(shape)), factors, sv)


def _lokr(path: Path, stem: str, t: Mapping[str, torch.Tensor]) -> _Update:
    """dW = s·kron(W1, W2), each side whole or factored (W2 possibly Tucker), as kron(B1, B2)·kron(A1, A2)."""
    if "lokr_t1" in t:
        raise InputError(path, f"{stem}.lokr_t1: a Tucker first LoKr side is no layout LyCORIS writes")
    if "lokr_w1" in t:
        B1, A1 = _whole(_matrix(path, f"{stem}.lokr_w1", t["lokr_w1"]))
    else:
        w1a, w1b = _need(path, stem, t, ("lokr_w1_a", "lokr_w1_b"))
        B1, A1 = _pair(
            path, stem, ("lokr_w1_a", "lokr_w1_b"), _matrix(path, f"{stem}.lokr_w1_a", w1a), _matrix(path, f"{stem}.lokr_w1_b", w1b)
        )
    if "lokr_w2" in t:
        B2, A2 = _whole(_matrix(path, f"{stem}.lokr_w2", t["lokr_w2"], (2, 3, 4, 5)))
    else:
        w2a, w2b = _need(path, stem, t, ("lokr_w2_a", "lokr_w2_b"))
        if "lokr_t2" in t:
            B2, A2 = _tucker(path, stem, ("lokr_t2", "lokr_w2_a", "lokr_w2_b"), t["lokr_t2"], w2a, w2b)
        else:
            w2a_m, w2b_m = _matrix(path, f"{stem}.lokr_w2_a", w2a), _matrix(path, f"{stem}.lokr_w2_b", w2b, (2, 3, 4, 5))
            B2, A2 = _pair(path, stem, ("lokr_w2_a", "lokr_w2_b"), w2a_m, w2b_m)
    # dim: the rows of a factored side's w_b (its rank, in the plain and the Tucker layout alike)
    dim = int(t["lokr_w1_b"].shape[0]) if "lokr_w1_b" in t else int(t["lokr_w2_b"].shape[0]) if "lokr_w2_b" in t else None
    alpha, scale = _alpha_scale(path, stem, t, dim)
    shape = (int(B1.shape[0] * B2.shape[0]), int(A1.shape[1] * A2.shape[1]))
    rank = int(B1.shape[1] * B2.shape[1])

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        _guard(path, stem, shape, rank)
        return torch.kron(A1.contiguous(), A2.contiguous()), torch.kron(B1.contiguous(), B2.contiguous())

    def sv() -> torch.Tensor:  # the singular values of kron(W1, W2) are the products of W1's and W2's
        return torch.outer(_sv(B1, A1), _sv(B2, A2)).reshape(-1)

    return _Update(stem, "lokr", _kind(t), alpha, scale, shape, rank, factors, sv)


def _full(path: Path, stem: str, t: Mapping[str, torch.Tensor]) -> _Update:
    """dW stored whole (LyCORIS's `full` algorithm, the fine-tuned weight minus the original)."""
    W = _matrix(path, f"{stem}.diff", t["diff"], (2, 3, 4, 5))
    shape = (int(W.shape[0]), int(W.shape[1]))
    alpha = float(min(shape))

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        _guard(path, stem, shape, min(shape))
        B, A = _whole(W)
        return A, B

    return _Update(stem, "full", _kind(t), alpha, 1.0, shape, min(shape), factors, lambda: singular_values(W))
