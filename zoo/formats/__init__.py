"""Reading adapter files into plain `AdapterData`: one reader per format, chosen by content."""

from __future__ import annotations

from pathlib import Path

from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK
from zoo.errors import InputError
from zoo.formats.checkpoint import read_checkpoint
from zoo.formats.kohya import has_lora_keys, lycoris_kind, read_single_file_lora
from zoo.formats.limits import check_limits
from zoo.formats.model import AdapterData, FullMatrix, LoraModule, layer_index, module_type
from zoo.formats.peft import CONFIG_NAME, WEIGHT_NAMES, is_peft_dir, read_peft
from zoo.formats.safe_load import load_tensors

__all__ = ["AdapterData", "FullMatrix", "LoraModule", "layer_index", "module_type", "read_adapter"]


def read_adapter(path: Path, base: Path | None = None, energy: float = DEFAULT_ENERGY, max_rank: int = DEFAULT_MAX_RANK) -> AdapterData:
    """Read a PEFT directory, a single-file LoRA or a full checkpoint (with `base`: as low-rank deltas),
    refusing what is over the limits of zoo/formats/limits.py."""
    data = _read(Path(path), base, energy, max_rank)
    check_limits(data, data.base_model)
    return data


def _read(path: Path, base: Path | None, energy: float, max_rank: int) -> AdapterData:
    if not path.exists():
        raise InputError(path, "no such file or directory")
    if path.is_dir():
        if is_peft_dir(path):
            return read_peft(path)
        raise InputError(path, f"not an adapter directory: expected {CONFIG_NAME} and {' or '.join(WEIGHT_NAMES)}")
    if path.name == CONFIG_NAME or (path.name in WEIGHT_NAMES and (path.parent / CONFIG_NAME).is_file()):
        return read_peft(path.parent)
    tensors, metadata = load_tensors(path)
    if not tensors:
        raise InputError(path, "empty file: no tensors")
    keys = list(tensors)
    kind = lycoris_kind(keys)
    if kind:
        raise InputError(path, f"unsupported LyCORIS {kind} adapter: only LoRA (B·A) updates can be canonicalized")
    if has_lora_keys(keys):
        return read_single_file_lora(path, tensors, metadata)
    return read_checkpoint(path, tensors, metadata, base, energy, max_rank)
