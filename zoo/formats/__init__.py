"""Reading adapter files into plain `AdapterData`: one reader per format, chosen by content.

Reading is two steps, so that every byte is read once and a stored copy is recognized before any
tensor is built: `open_adapter` reads the files (the weight file whole, hashed as it is read; a safetensors
file of ZOO_STREAM_MIN_BYTES or more is hashed without being held, and its tensors are read one at a time
from the same file later, see zoo/formats/safe_load.py) and checks what needs no tensors (the PEFT config,
the safetensors header); `parse_adapter` builds the modules. `read_adapter` does both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK
from zoo.errors import InputError
from zoo.formats.archive import ZIP_SUFFIX, read_peft_zip
from zoo.formats.checkpoint import read_checkpoint
from zoo.formats.cloneofsimo import has_cloneofsimo_keys, read_cloneofsimo_lora
from zoo.formats.diffusers import Renamed, has_diffusers_keys, read_diffusers_lora
from zoo.formats.kohya import has_lora_keys, kohya_base_model, read_single_file_lora
from zoo.formats.limits import MAX_ADAPTER_NAME, check_limits
from zoo.formats.lowrank import lone_factors, low_rank_pairs
from zoo.formats.lycoris import is_lycoris, read_lycoris
from zoo.formats.peft import (
    CONFIG_NAME,
    WEIGHT_NAMES,
    PeftConfig,
    is_peft_dir,
    parse_peft,
    parse_peft_config,
    peft_weights,
    read_peft_config,
)
from zoo.formats.records import AdapterData, FullMatrix, LoraModule, layer_index, module_type
from zoo.formats.safe_load import (
    SAFETENSORS_SUFFIX,
    SafetensorsHeader,
    StreamedTensors,
    WeightFile,
    parse_weights_only_pickle,
    read_weight_file,
    safetensors_header,
    safetensors_tensors,
    wrapper_prefix,
)
from zoo.formats.xlabs import has_xlabs_keys, read_xlabs_lora

__all__ = [
    "LORA_FORMATS",
    "SINGLE_FILE_FORMATS",
    "AdapterData",
    "FullMatrix",
    "LoraModule",
    "RawAdapter",
    "adapter_name",
    "layer_index",
    "module_type",
    "open_adapter",
    "parse_adapter",
    "read_adapter",
]


@dataclass(frozen=True)
class SingleFileFormat:
    """A single-file LoRA layout: which tensor names it claims and how it reads them."""

    name: str
    claims: Callable[[list[str]], bool]
    read: Callable[[Path, Mapping[str, torch.Tensor], dict[str, str]], AdapterData]
    #: the base model its metadata names
    base_model: Callable[[dict[str, str]], str | None] = lambda metadata: None


#: single-file formats, asked in order; the first that claims a file's tensor names reads it
SINGLE_FILE_FORMATS: tuple[SingleFileFormat, ...] = (
    SingleFileFormat("lycoris", is_lycoris, read_lycoris, kohya_base_model),
    SingleFileFormat("kohya", has_lora_keys, read_single_file_lora, kohya_base_model),
    SingleFileFormat("xlabs", has_xlabs_keys, read_xlabs_lora),
    SingleFileFormat("diffusers", has_diffusers_keys, read_diffusers_lora, kohya_base_model),
    SingleFileFormat("cloneofsimo", has_cloneofsimo_keys, read_cloneofsimo_lora),
)
_BY_NAME = {f.name: f for f in SINGLE_FILE_FORMATS}
#: formats whose adapters are low-rank updates (the rest: full checkpoints)
LORA_FORMATS = ("peft", *_BY_NAME)


@dataclass
class RawAdapter:
    """A source's files, read once and checked as far as that needs no tensors."""

    path: Path
    weights: WeightFile
    #: peft, a SINGLE_FILE_FORMATS name or checkpoint; None for a single pickle file (known once its tensors are loaded)
    format: str | None
    #: the base model the files name
    base_model: str | None = None
    #: what the update depends on besides the weight bytes, as the adapter's recorded config holds it
    settings: dict[str, object] = field(default_factory=dict)
    peft: PeftConfig | None = None
    header: SafetensorsHeader | None = None
    #: what every tensor name of a .safetensors file starts with and is read without (`safe_load.wrapper_prefix`)
    prefix: str = ""


def adapter_name(path: Path) -> str:
    """The name an adapter gets from its path: a file's stem or a directory's name."""
    return (path.stem if path.is_file() else path.name)[:MAX_ADAPTER_NAME]


def read_adapter(path: Path, base: Path | None = None, energy: float = DEFAULT_ENERGY, max_rank: int = DEFAULT_MAX_RANK) -> AdapterData:
    """Read a PEFT directory, a single-file LoRA or a full checkpoint (with `base`: as low-rank deltas),
    refusing what is over the limits of zoo/formats/limits.py."""
    return parse_adapter(open_adapter(path), base, energy, max_rank)


def open_adapter(path: Path) -> RawAdapter:
    """Read the files of a PEFT directory (or a file in one, or a zip of one) or of a single weight file."""
    path = Path(path)
    if not path.exists():
        raise InputError(path, "no such file or directory")
    if path.is_dir():
        if is_peft_dir(path):
            return _open_peft(path)
        raise InputError(path, f"not an adapter directory: expected {CONFIG_NAME} and {' or '.join(WEIGHT_NAMES)}")
    if path.name == CONFIG_NAME or (path.name in WEIGHT_NAMES and (path.parent / CONFIG_NAME).is_file()):
        return _open_peft(path.parent)
    if path.suffix.lower() == ZIP_SUFFIX:
        text, weights = read_peft_zip(path)
        config = parse_peft_config(path / CONFIG_NAME, text)
        return RawAdapter(path, weights, "peft", config.base_model, config.settings(), peft=config)
    weights = read_weight_file(path)
    if path.suffix != SAFETENSORS_SUFFIX:
        return RawAdapter(path, weights, None)
    header = safetensors_header(path, weights.data)
    prefix = wrapper_prefix(list(header.entries))
    fmt = file_format(path, {key.removeprefix(prefix): entry["shape"] for key, entry in header.entries.items()})
    base_model = _BY_NAME[fmt].base_model(header.metadata) if fmt in _BY_NAME else None
    return RawAdapter(path, weights, fmt, base_model, header=header, prefix=prefix)


def _open_peft(directory: Path) -> RawAdapter:
    config = read_peft_config(directory)
    weights = read_weight_file(peft_weights(directory))
    return RawAdapter(directory, weights, "peft", config.base_model, config.settings(), peft=config)


def file_format(path: Path, shapes: Mapping[str, Sequence[int]]) -> str:
    """The single-file format that claims a file's tensor names, else checkpoint; empty files, and low-rank factor
    pairs or lone factors that no format claims (zoo/formats/lowrank.py), are refused."""
    keys = list(shapes)
    if not keys:
        raise InputError(path, "empty file: no tensors")
    fmt = next((f.name for f in SINGLE_FILE_FORMATS if f.claims(keys)), "checkpoint")
    if fmt != "checkpoint":
        return fmt
    refused = "refused rather than stored as a full checkpoint (docs/formats.md lists the layouts read)"
    if pairs := low_rank_pairs(shapes):
        shown = _first_three([f"{a} {list(shapes[a])} / {b} {list(shapes[b])}" for a, b in pairs])
        raise InputError(
            path, f"{len(pairs)} low-rank factor pair{'s' if len(pairs) > 1 else ''} ({shown}) in a layout no reader knows: {refused}"
        )
    if lone := lone_factors(shapes):
        shown = _first_three([f"{k} {list(shapes[k])}" for k in lone])
        named = f"{len(lone)} tensor{'s' if len(lone) > 1 else ''} named as one factor of a low-rank pair, with no partner"
        raise InputError(path, f"{named} ({shown}): {refused}")
    return fmt


def _first_three(items: list[str]) -> str:
    """The first three of `items`, and `...` where there are more: what a refusal names."""
    return ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")


def parse_adapter(
    raw: RawAdapter, base: Path | None = None, energy: float = DEFAULT_ENERGY, max_rank: int = DEFAULT_MAX_RANK
) -> AdapterData:
    """The modules (or matrices) of read files, checked against the limits of zoo/formats/limits.py."""
    if raw.peft is not None:
        data = parse_peft(raw.path, raw.peft, raw.weights)
    else:
        file_tensors: Mapping[str, torch.Tensor]
        if raw.header is not None:
            file_tensors, metadata = safetensors_tensors(raw.weights, raw.header), raw.header.metadata
        else:
            file_tensors, metadata = parse_weights_only_pickle(raw.weights), {}
        tensors = Renamed(file_tensors, {key.removeprefix(raw.prefix): key for key in file_tensors}) if raw.prefix else file_tensors
        fmt = raw.format or file_format(raw.path, {key: t.shape for key, t in tensors.items()})
        if fmt in _BY_NAME:
            data = _BY_NAME[fmt].read(raw.path, tensors, metadata)
            if isinstance(file_tensors, StreamedTensors):
                file_tensors.verify()  # every tensor was read from the file whose SHA-256 was recorded
        else:  # a checkpoint keeps its names (read streamed where the file is, as named in it)
            data = read_checkpoint(raw.path, file_tensors, metadata, base, energy, max_rank)
    data.file_sha256, data.size_bytes = raw.weights.sha256, raw.weights.size
    check_limits(data, data.base_model)
    return data
