"""Single-file LoRA `.safetensors`: the (down, up) pair reader the single-file formats share, and the kohya-ss
layout (`lora_down`/`lora_up`/`alpha`, diffusers 0.21-0.26's dotted `lora.down`/`lora.up`, and hand-converted
`<kohya name>_lora_down.weight` names).

Modules are named by their model paths where the model tables know their kohya names (`model_named`), so that a kohya
file and the same update in diffusers' layout have the same module names, hence the same canonical hash."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from zoo.domain.kohya_names import model_path
from zoo.errors import InputError
from zoo.formats.records import AdapterData, FullMatrix, LoraModule, check_finite, check_pair

#: (down suffix, up suffix) of single-file layouts: kohya-ss's, diffusers 0.21-0.26's dotted one, and diffusers'
#: PEFT-style one (zoo/formats/diffusers.py reads files of it; a kohya file that mixes some in is read whole here);
#: the `alpha` scalar sits at `<stem>.alpha`.
PAIRS = (
    (".lora_down.weight", ".lora_up.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    (".lora_A.weight", ".lora_B.weight"),
)
#: hand-converted names, `<stem>_lora_down.weight`: kohya's when the stem is a kohya name (no dots), else diffusers'
HAND_PAIR = ("_lora_down.weight", "_lora_up.weight")
KOHYA_PAIRS = (*PAIRS, HAND_PAIR)

_Named = TypeVar("_Named", LoraModule, FullMatrix)
#: a module's (alpha, scale) from its name, its `alpha` tensor (None when absent) and its rank
Scaling = Callable[[str, "torch.Tensor | None", int], tuple[float, float]]


#: LyCORIS LoCon's Tucker form: a (rank, rank, kh, kw) kernel between a 1×1 `lora_down` and a 1×1 `lora_up`
MID = ".lora_mid.weight"


def _tucker_down(path: Path, stem: str, down: torch.Tensor, mid: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The A factor (rank, in·kh·kw) of a Tucker LoCon module: ΔW[o, c, h, w] = Σ_ab up[o, a] mid[a, b, h, w] down[b, c],
    so B = up and A[a, (c, h, w)] = Σ_b mid[a, b, h, w] down[b, c]: the update's exact rank-`rank` factorization."""
    shapes = f"lora_down {list(down.shape)}, lora_mid {list(mid.shape)}, lora_up {list(up.shape)}"
    if down.ndim != 4 or mid.ndim != 4 or up.ndim != 4 or down.shape[2:] != (1, 1) or up.shape[2:] != (1, 1):
        raise InputError(path, f"{stem}: a Tucker LoCon module needs 1×1 lora_down/lora_up kernels around a 4-d lora_mid, got {shapes}")
    if mid.shape[0] != up.shape[1] or mid.shape[1] != down.shape[0]:
        raise InputError(path, f"shape mismatch in {stem}: {shapes} do not compose")
    for label, t in (("lora_mid", mid), ("lora_down", down)):
        check_finite(path, f"{stem}.{label}", t)
    return torch.einsum("abhw,bc->achw", mid.float(), down[:, :, 0, 0].float()).reshape(mid.shape[0], -1)


def has_lora_keys(keys: list[str]) -> bool:
    """Whether a file holds kohya-layout factors (a hand-converted name counts when its stem has no dots)."""
    return any(k.endswith((PAIRS[0][0], PAIRS[1][0])) or (k.endswith(HAND_PAIR[0]) and "." not in k[: -len(HAND_PAIR[0])]) for k in keys)


def module_alpha(path: Path, stem: str, t: torch.Tensor | None, rank: int) -> float:
    """A module's alpha: its one-number tensor; missing or zero means alpha = rank (kohya's convention)."""
    if t is None:
        return float(rank)
    if t.numel() != 1:
        raise InputError(path, f"{stem}.alpha must hold one number, it has shape {list(t.shape)}")
    alpha = float(t.float().reshape(-1)[0])
    if not math.isfinite(alpha) or alpha < 0:
        raise InputError(path, f"{stem}.alpha is {alpha}: it must be a finite number ≥ 0")
    return alpha if alpha > 0 else float(rank)


def kohya_base_model(metadata: dict[str, str]) -> str | None:
    """The base model a kohya file's training metadata names."""
    return metadata.get("ss_sd_model_name") or metadata.get("ss_base_model_version")


def kohya_scaling(path: Path) -> Scaling:
    """alpha from the module's `alpha` tensor (missing or zero: alpha = rank, kohya's convention), scale alpha/rank."""

    def scaling(stem: str, alpha_tensor: torch.Tensor | None, rank: int) -> tuple[float, float]:
        alpha = module_alpha(path, stem, alpha_tensor, rank)
        return alpha, alpha / rank

    return scaling


def read_pairs(
    path: Path, tensors: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str]], scaling: Scaling
) -> tuple[list[LoraModule], dict[str, list[int]]]:
    """The modules of every (down, up) pair of `tensors` whose suffixes are in `pairs`, named by their stem, with the
    alpha at `<stem>.alpha` (and a LyCORIS Tucker `lora_mid` between them), and the shapes of the other tensors,
    checked finite. A factor without its partner, or a file without pairs, is refused."""
    used: set[str] = set()
    modules: list[LoraModule] = []
    for key in sorted(tensors):
        for down_suffix, up_suffix in pairs:
            if not key.endswith(down_suffix):
                continue
            stem = key[: -len(down_suffix)]
            up_key = stem + up_suffix
            if up_key not in tensors:
                raise InputError(path, f"{stem} has a down/A factor but no up/B factor")
            down, up = tensors[key], tensors[up_key]
            if down.ndim not in (2, 4) or up.ndim not in (2, 4):
                raise InputError(path, f"{stem}: factors must be matrices (or conv kernels), got {list(down.shape)} and {list(up.shape)}")
            mid_key = stem + MID
            A = _tucker_down(path, stem, down, tensors[mid_key], up) if mid_key in tensors else down.reshape(down.shape[0], -1)
            B = up.reshape(up.shape[0], -1)
            check_pair(path, stem, A, B)
            alpha_key = stem + ".alpha"
            alpha, scale = scaling(stem, tensors.get(alpha_key), A.shape[0])
            used.update(k for k in (key, up_key, alpha_key, mid_key) if k in tensors)
            modules.append(LoraModule(stem, A, B, alpha, scale, "conv" if down.ndim == 4 else "linear"))
            break
    orphan_ups = [k for k in tensors if k.endswith(tuple(u for _, u in pairs)) and k not in used]
    if orphan_ups:
        raise InputError(path, f"{orphan_ups[0]} has no matching down/A factor")
    if not modules:
        raise InputError(path, "empty adapter: no LoRA factor pairs found")
    extra = {}
    for key in sorted(set(tensors) - used):
        check_finite(path, key, tensors[key])
        extra[key] = list(tensors[key].shape)
    return modules, extra


def model_named(path: Path, modules: list[_Named]) -> list[_Named]:
    """Modules with kohya names under the dotted paths the model tables give those names (zoo/domain/kohya_names.py
    `model_path`: `lora_unet_down_blocks_0_attentions_0_proj_in` → `unet.down_blocks.0.attentions.0.proj_in`), the
    others as they are, sorted by name; two modules of one name (a kohya module and a dotted one of the same path) are
    refused."""
    named: dict[str, _Named] = {}
    for m in modules:
        new = model_path(m.name) or m.name
        if new in named:
            raise InputError(path, f"{named[new].name} and {m.name} are the same module ({new})")
        named[new] = m
    return [dataclasses.replace(m, name=new) for new, m in sorted(named.items())]


#: the suffix of a module's DoRA magnitude in kohya's layout (kohya-ss's DoRA, LyCORIS's `weight_decompose`)
DORA_SCALE = ".dora_scale"


def dora_note(modules: int) -> str:
    """What a file's DoRA magnitudes mean for its dW (recorded, not applied: see docs/formats.md)."""
    return (
        f"{modules} modules carry a DoRA magnitude (dora_scale, recorded, not applied): dW is their update before the "
        "weight is renormalized, m·(W0 + dW)/‖W0 + dW‖, which needs the base weights"
    )


def pair_config(modules: list[LoraModule]) -> dict[str, object]:
    """The ranks and alphas a single-file adapter's modules have."""
    ranks = sorted({m.rank for m in modules})
    alphas = sorted({m.alpha for m in modules})
    return {"ranks": ranks, "alphas": alphas, "r": max(ranks), "lora_alpha": alphas[-1]}


def read_single_file_lora(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> AdapterData:
    """Modules of a kohya-layout LoRA file; a missing or zero alpha means alpha = rank."""
    modules, extra = read_pairs(path, tensors, KOHYA_PAIRS, kohya_scaling(path))
    modules = model_named(path, modules)
    dora = sum(k.endswith(DORA_SCALE) for k in extra)
    # DoRA: what dW leaves out (the magnitude) is not stored, so no LoRA file can hold the update (export refuses it)
    return AdapterData(
        path=path,
        format="kohya",
        weight_files=[path],
        base_model=kohya_base_model(metadata),
        modules=modules,
        config={**pair_config(modules), **({"use_dora": True} if dora else {})},
        extra_tensors=extra,
        metadata=metadata,
        notes=[dora_note(dora)] if dora else [],
    )
