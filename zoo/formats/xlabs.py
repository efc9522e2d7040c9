"""XLabs' Flux LoRA `.safetensors` (x-flux's training scripts): attention processors' LoRA layers, read into Flux's
own (Black Forest Labs') module names.

Keys `double_blocks.<i>.processor.{qkv,proj}_lora{1,2}.{down,up}.weight` (1: the image stream, 2: the text stream) and
`single_blocks.<i>.processor.{qkv,proj}_lora.{down,up}.weight`, optionally under `diffusion_model.`; no alpha (the
update is up·down, as x-flux and diffusers' conversion apply it). A fused q·k·v LoRA is one module of the fused shape:
`qkv_lora1` is `double_blocks.<i>.img_attn.qkv` (3·width outputs), `proj_lora1` `img_attn.proj`, `qkv_lora2` and
`proj_lora2` the `txt_attn` ones; a single block's `qkv_lora` updates the q, k, v rows of `single_blocks.<i>.linear1`
(which also holds the MLP's input rows: its B is padded with zero rows for them, so the module is linear1, exactly)
and its `proj_lora` is `single_blocks.<i>.linear2`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from zoo.errors import InputError
from zoo.formats.diffusers import Renamed
from zoo.formats.kohya import pair_config, read_pairs
from zoo.formats.records import AdapterData, LoraModule

FORMAT = "xlabs"
PAIR = (".down.weight", ".up.weight")
_KEY = re.compile(r"(?:diffusion_model\.)?(double|single)_blocks\.(\d+)\.processor\.(qkv|proj)_lora([12]?)(\.down\.weight|\.up\.weight)")
#: (block kind, layer, stream) → the module's name in the block
_MODULES = {
    ("double", "qkv", "1"): "img_attn.qkv",
    ("double", "proj", "1"): "img_attn.proj",
    ("double", "qkv", "2"): "txt_attn.qkv",
    ("double", "proj", "2"): "txt_attn.proj",
    ("single", "qkv", ""): "linear1",
    ("single", "proj", ""): "linear2",
}
#: a single block's MLP is 4 times its width: linear1 has 3·width (q, k, v) + 4·width (MLP input) outputs
MLP_RATIO = 4


def has_xlabs_keys(keys: list[str]) -> bool:
    return any(_KEY.fullmatch(k) and k.endswith(PAIR[0]) for k in keys)


def _names(path: Path, keys: list[str]) -> dict[str, str]:
    """Each factor's name under its Flux module (`double_blocks.0.img_attn.qkv.down.weight`); other keys are refused."""
    names: dict[str, str] = {}
    for key in keys:
        m = _KEY.fullmatch(key)
        module = _MODULES.get((m.group(1), m.group(3), m.group(4))) if m else None
        if m is None or module is None:
            raise InputError(path, f"{key}: not a tensor of an XLabs Flux LoRA (double_blocks.N.processor.qkv_lora1.down.weight, ...)")
        names[f"{m.group(1)}_blocks.{m.group(2)}.{module}{m.group(5)}"] = key
    return names


def _linear1(path: Path, m: LoraModule) -> LoraModule:
    """A single block's q·k·v LoRA as the update of its linear1: zero rows for the MLP's input."""
    width = m.A.shape[1]
    if m.B.shape[0] != 3 * width:
        raise InputError(path, f"{m.name}: a single block's qkv_lora must have 3 × {width} outputs, it has {m.B.shape[0]}")
    return dataclasses.replace(m, B=torch.cat([m.B, m.B.new_zeros(MLP_RATIO * width, m.rank)]))


def read_xlabs_lora(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> AdapterData:
    """Modules of an XLabs Flux LoRA file (scale 1)."""
    modules, extra = read_pairs(path, Renamed(tensors, _names(path, list(tensors))), (PAIR,), lambda name, alpha, rank: (float(rank), 1.0))
    modules = [_linear1(path, m) if m.name.endswith(".linear1") else m for m in modules]
    return AdapterData(
        path=path,
        format=FORMAT,
        weight_files=[path],
        base_model=None,
        modules=modules,
        config=pair_config(modules),
        extra_tensors=extra,
        metadata=metadata,
    )
