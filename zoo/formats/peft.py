"""PEFT LoRA adapters: a directory with adapter_config.json and adapter_model.safetensors (or .bin)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from zoo.errors import InputError
from zoo.formats.model import AdapterData, LoraModule, check_finite, check_pair
from zoo.formats.safe_load import load_tensors

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B"))


def is_peft_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_NAME).is_file()


def _pattern_value(patterns: dict, name: str, default: float) -> float:
    """Value of the PEFT rank/alpha pattern whose key matches the module name (as PEFT matches them)."""
    for key, value in patterns.items():
        if name == key or re.match(rf"(.*\.)?({key})$", name):
            return float(value)
    return default


def read_peft(directory: Path) -> AdapterData:
    config_path = directory / CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(config_path, f"unreadable adapter config ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(config_path, "adapter config is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise InputError(config_path, f"unsupported PEFT type {peft_type}: only LORA adapters can be canonicalized")
    weights = next((directory / n for n in WEIGHT_NAMES if (directory / n).is_file()), None)
    if weights is None:
        raise InputError(directory, f"PEFT adapter without weights: expected one of {', '.join(WEIGHT_NAMES)}")
    tensors, metadata = load_tensors(weights)

    r_default = float(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", r_default))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    fan_in_fan_out = bool(config.get("fan_in_fan_out", False))

    def strip(key: str) -> str:
        return key[len(_PREFIX) :] if key.startswith(_PREFIX) else key

    used: set[str] = set()
    modules: list[LoraModule] = []
    for key in sorted(tensors):
        for a_suffix, b_suffix in _PAIRS:
            if not key.endswith(a_suffix):
                continue
            stem = key[: -len(a_suffix)]
            b_key = stem + b_suffix
            name = strip(stem)
            if b_key not in tensors:
                raise InputError(weights, f"{name} has lora_A but no lora_B")
            used.update((key, b_key))
            A, B = tensors[key], tensors[b_key]
            embedding = a_suffix == ".lora_embedding_A"
            kind = "embedding" if embedding else ("conv" if A.ndim == 4 else "linear")
            A2 = A.reshape(A.shape[0], -1)
            B2 = B.reshape(B.shape[0], -1)
            check_pair(weights, name, A2, B2)
            r = A2.shape[0]
            expected = int(_pattern_value(rank_pattern, name, r_default))
            if r != expected:
                raise InputError(weights, f"rank mismatch in {name}: tensors have rank {r}, adapter_config says {expected}")
            alpha = _pattern_value(alpha_pattern, name, alpha_default)
            scale = alpha / math.sqrt(r) if rslora else alpha / r
            transposed = embedding or (fan_in_fan_out and kind == "linear")
            if transposed:  # dW = (B·A)ᵀ = Aᵀ·Bᵀ in the stored weight's layout
                A2, B2 = B2.T, A2.T
            modules.append(LoraModule(name, A2, B2, alpha, scale, kind, transposed))
    for key in tensors:
        if key.endswith(tuple(b for _, b in _PAIRS)) and key not in used:
            raise InputError(weights, f"{strip(key)} has lora_B but no lora_A")
    if not modules:
        raise InputError(weights, "empty adapter: no lora_A/lora_B tensors found")
    extra = {}
    for key in sorted(set(tensors) - used):
        check_finite(weights, strip(key), tensors[key])
        extra[strip(key)] = list(tensors[key].shape)
    r_values = sorted({m.rank for m in modules})
    recorded = {
        "r": int(r_default),
        "lora_alpha": alpha_default,
        "ranks": r_values,
        "use_rslora": rslora,
        "use_dora": bool(config.get("use_dora", False)),
        "fan_in_fan_out": fan_in_fan_out,
        "target_modules": config.get("target_modules"),
        "task_type": config.get("task_type"),
        "modules_to_save": config.get("modules_to_save"),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "peft_version": config.get("peft_version"),
    }
    return AdapterData(
        path=directory,
        format="peft",
        weight_files=[weights],
        base_model=config.get("base_model_name_or_path"),
        modules=modules,
        config=recorded,
        extra_tensors=extra,
        metadata=metadata,
    )
