"""cloneofsimo's lora_diffusion `.safetensors` files (`save_safeloras`, `save_safeloras_with_embeds`).

Keys `<model>:<i>:down` (r × in, or an r × in × kh × kw conv kernel) and `<model>:<i>:up` (out × r), for models
such as `unet` and `text_encoder`; the header's metadata maps `<model>` to the JSON list of the module classes LoRA
was injected under (e.g. ["CrossAttention", "Attention", "GEGLU"]), `<model>:<i>:rank` to each rank, and each
textual-inversion token to "<embed>" (its embedding is a tensor named after the token). The update is up·down:
lora_diffusion applies scale 1 unless a user tunes it at inference.

The file does not name the modules: `i` counts the layers lora_diffusion injected in the order it walks the model.
Modules keep the file's names (`unet:0`, ...): files of one base model compare module to module, but their names do
not line up with the diffusers or kohya names of the same layers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from zoo.errors import InputError
from zoo.formats.kohya import pair_config, read_pairs
from zoo.formats.records import AdapterData

FORMAT = "cloneofsimo"
PAIR = (":down", ":up")
_DOWN = re.compile(r"[^:]+:\d+:down")
EMBED_FLAG = "<embed>"


def has_cloneofsimo_keys(keys: list[str]) -> bool:
    return any(_DOWN.fullmatch(k) for k in keys)


def read_cloneofsimo_lora(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> AdapterData:
    """Modules of a lora_diffusion file (scale 1); a rank the metadata gives must be the factors' rank."""

    def scaling(name: str, alpha_tensor: torch.Tensor | None, rank: int) -> tuple[float, float]:
        said = metadata.get(f"{name}:rank")
        if said is not None and said.strip() != str(rank):
            raise InputError(path, f"rank mismatch in {name}: tensors have rank {rank}, the metadata says {said[:20]!r}")
        return float(rank), 1.0

    modules, extra = read_pairs(path, tensors, (PAIR,), scaling)
    models = sorted({m.name.split(":")[0] for m in modules})
    targets = {model: _classes(path, metadata, model) for model in models}
    embeddings = sorted(k for k in extra if metadata.get(k) == EMBED_FLAG)
    return AdapterData(
        path=path,
        format=FORMAT,
        weight_files=[path],
        modules=modules,
        config={**pair_config(modules), "target_modules": targets, "embeddings": embeddings},
        extra_tensors=extra,
        metadata=metadata,
    )


def _classes(path: Path, metadata: dict[str, str], model: str) -> list[str] | None:
    """The module classes LoRA was injected under in `model`, as the metadata lists them (None when absent)."""
    text = metadata.get(model)
    if text is None:
        return None
    try:
        classes = json.loads(text)
    except (ValueError, RecursionError):
        classes = None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise InputError(path, f"metadata {model!r} should list module class names, it holds {text[:60]!r}")
    return classes
