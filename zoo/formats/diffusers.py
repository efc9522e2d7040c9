"""diffusers' single-file LoRA layouts, read into the module names of the pipeline's models.

- current (diffusers ≥ 0.27, PEFT-style): `unet.<module>.lora_A.weight` / `.lora_B.weight` (also `text_encoder.`,
  `text_encoder_2.`, `transformer.`, or no prefix), an optional `<module>.alpha`, and the PEFT config of each
  model in the `lora_adapter_metadata` header entry (r, lora_alpha, rank/alpha patterns, rsLoRA);
- attn-procs (diffusers 0.14-0.20, the default output of its 2023 LoRA training scripts): UNet attention
  processors `<block>.processor.to_q_lora.down.weight` (`to_k`, `to_v`, `to_out`; without a `unet.` prefix when
  written by `unet.save_attn_procs`), CLIP `self_attn.to_q_lora.down.weight` and `<module>.lora_linear_layer.down.weight`;
  no alpha (scale 1);
- hand-converted: `<dotted diffusers name>_lora_down.weight` / `_lora_up.weight`.

The base model is the one an `ss_sd_model_name` (or `ss_base_model_version`) header entry names, as for kohya.

Every layout is read into the current layout's names, as diffusers' own loader converts them: `.processor.`
dropped, `to_q_lora` → `to_q` in the UNet and `q_proj` in CLIP (`to_out_lora` → `to_out.0` / `out_proj`),
`text_model.` dropped. So a file in any layout and the same update in another have the same module names. Flux
modules under Black Forest Labs' `diffusion_model.` prefix are named without it (`double_blocks.0.img_attn.qkv`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from zoo.errors import InputError
from zoo.formats.kohya import HAND_PAIR, PAIRS, kohya_base_model, module_alpha, pair_config, read_pairs
from zoo.formats.peft import PeftConfig, parse_peft_config
from zoo.formats.records import AdapterData

FORMAT = "diffusers"
CURRENT_PAIR = PAIRS[2]
#: the models of a pipeline that diffusers' loaders give a LoRA, by the prefix of their keys
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
#: what Black Forest Labs' Flux checkpoints put before their modules' names
BFL_PREFIX = "diffusion_model"
#: the attn-procs name of each attention projection → its module in the UNet, in CLIP
PROJECTIONS = {"to_q": ("to_q", "q_proj"), "to_k": ("to_k", "k_proj"), "to_v": ("to_v", "v_proj"), "to_out": ("to_out.0", "out_proj")}
#: (suffix of a factor's key, suffix in the current layout, layout)
SUFFIXES = (
    (CURRENT_PAIR[0], CURRENT_PAIR[0], "current"),
    (CURRENT_PAIR[1], CURRENT_PAIR[1], "current"),
    ("_lora.down.weight", CURRENT_PAIR[0], "attn-procs"),
    ("_lora.up.weight", CURRENT_PAIR[1], "attn-procs"),
    (".lora_linear_layer.down.weight", CURRENT_PAIR[0], "attn-procs"),
    (".lora_linear_layer.up.weight", CURRENT_PAIR[1], "attn-procs"),
    (HAND_PAIR[0], CURRENT_PAIR[0], "hand-converted"),
    (HAND_PAIR[1], CURRENT_PAIR[1], "hand-converted"),
)
DOWN_SUFFIXES = tuple(suffix for suffix, current, _ in SUFFIXES if current == CURRENT_PAIR[0])
METADATA_KEY = "lora_adapter_metadata"


def _factor(key: str) -> tuple[str, str, str] | None:
    """(stem, current-layout suffix, layout) of a factor's key in one of the layouts, else None."""
    for suffix, current, layout in SUFFIXES:
        if key.endswith(suffix):
            stem = key[: -len(suffix)]
            if layout == "hand-converted" and "." not in stem:
                return None  # a kohya name: zoo/formats/kohya.py reads it
            return stem, current, layout
    return None


def has_diffusers_keys(keys: list[str]) -> bool:
    """Whether a file holds a down/A factor of a diffusers layout."""
    return any(k.endswith(DOWN_SUFFIXES) and _factor(k) is not None for k in keys)


def module_name(stem: str, layout: str) -> str:
    """The current layout's name of a module, from its stem in `layout` (see the module docstring)."""
    component, _, rest = stem.partition(".")
    if component == BFL_PREFIX:
        return rest  # Flux's own names (`double_blocks.0.img_attn.qkv`), as XLabs' and kohya-ss's Flux files are read
    if component not in COMPONENTS:
        if layout != "attn-procs":
            return stem
        component, rest = "unet", stem  # unet.save_attn_procs wrote the UNet's keys without a prefix
    text = component in TEXT_ENCODERS
    if text:
        rest = rest.removeprefix("text_model.")
    if layout != "current":
        head, _, last = rest.replace(".processor.", ".").rpartition(".")
        if last in PROJECTIONS:
            rest = f"{head}.{PROJECTIONS[last][text]}" if head else PROJECTIONS[last][text]
    return f"{component}.{rest}"


class Renamed(Mapping[str, torch.Tensor]):
    """A file's tensors under their current-layout names (read from the file only when looked up)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str]) -> None:
        self.tensors, self.names = tensors, names

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[self.names[key]]

    def __contains__(self, key: object) -> bool:
        return key in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def current_names(path: Path, keys: list[str]) -> tuple[dict[str, str], list[str]]:
    """Each key's current-layout name (a factor's, an alpha's; other keys keep theirs) and the layouts seen;
    two keys of one name are refused."""
    names: dict[str, str] = {}
    layouts: set[str] = set()
    for key in keys:
        factor = _factor(key)
        if factor is not None:
            stem, suffix, layout = factor
            layouts.add(layout)
            new = module_name(stem, layout) + suffix
        elif key.endswith(".alpha"):
            new = module_name(key.removesuffix(".alpha"), "current") + ".alpha"
        else:
            new = key
        if new in names:
            raise InputError(path, f"{names[new]} and {key} are the same tensor ({new}) of a diffusers LoRA")
        names[new] = key
    return names, sorted(layouts)


def component_configs(path: Path, metadata: dict[str, str]) -> dict[str, PeftConfig]:
    """The PEFT config of each model that `lora_adapter_metadata` holds (`unet.r`, `unet.lora_alpha`, ...)."""
    text = metadata.get(METADATA_KEY)
    if not text:
        return {}
    try:
        flat = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(path, f"unreadable {METADATA_KEY} metadata ({exc})") from None
    if not isinstance(flat, dict):
        raise InputError(path, f"{METADATA_KEY} metadata is not a JSON object")
    per: dict[str, dict[str, object]] = {}
    for key, value in flat.items():
        component, _, field = str(key).partition(".")
        per.setdefault(component, {})[field] = value
    return {c: parse_peft_config(path, json.dumps({"peft_type": "LORA", **cfg}).encode()) for c, cfg in per.items()}


def read_diffusers_lora(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> AdapterData:
    """Modules of a diffusers LoRA file in any of its layouts. Scale: a module's `alpha` tensor (over its rank), else its
    model's PEFT config in the metadata, else 1 (alpha = rank: what diffusers applies without either)."""
    names, layouts = current_names(path, list(tensors))
    configs = component_configs(path, metadata)

    def scaling(name: str, alpha_tensor: torch.Tensor | None, rank: int) -> tuple[float, float]:
        if alpha_tensor is not None:
            alpha = module_alpha(path, name, alpha_tensor, rank)
            return alpha, alpha / rank
        component, _, module = name.partition(".")
        config = configs.get(component)
        return config.module_scale(path, module, rank) if config else (float(rank), 1.0)

    modules, extra = read_pairs(path, Renamed(tensors, names), (CURRENT_PAIR,), scaling)
    dora = any(k.endswith(".lora_magnitude_vector") for k in extra) or any(c.raw.get("use_dora") for c in configs.values())
    return AdapterData(
        path=path,
        format=FORMAT,
        weight_files=[path],
        base_model=kohya_base_model(metadata),  # the ss_* header key trainers (and zoo's exports) write
        modules=modules,
        config={**pair_config(modules), "layout": "+".join(layouts), "use_dora": dora},
        extra_tensors=extra,
        metadata=metadata,
    )
