"""What an export needs of an adapter's weight file that its canonical factors do not hold: a PEFT adapter's head (its
tensors that are not LoRA factors: modules_to_save, trained biases, ...) and each conv module's kernel.

Ingest takes both from the file it has read and stores them: the head as a blob of its own (adapter.head_blob, at most
ZOO_MAX_HEAD_BYTES), each kernel in its module row (module.kernel). An export of an adapter stored before they were
takes them from its source file, where that is still the file ingested (zoo/services/source_file.py), with the same
function (`file_parts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from zoo import config
from zoo.domain.kohya_names import kohya_names
from zoo.formats import RawAdapter
from zoo.formats.peft import KEY_PREFIX as PEFT_PREFIX
from zoo.formats.safe_load import DTYPE_BYTES, SAFETENSORS_SUFFIX, parse_weights_only_pickle, safetensors_header, safetensors_tensors

#: key suffixes of a module's down/A factor in the layouts read (PEFT, diffusers, kohya, hand-converted)
_DOWN_SUFFIXES = (".lora_A.weight", ".lora_down.weight", ".lora.down.weight", "_lora_down.weight")
#: a LyCORIS Tucker module's core, which holds its kernel
_MID = ".lora_mid.weight"


def max_head_bytes() -> int:
    """The largest head stored with an adapter (ZOO_MAX_HEAD_BYTES, default 64 MiB): a classifier's is a few KB to a few
    MB; a modules_to_save of a large model's embeddings or LM head (hundreds of MB) is left to its source file."""
    return config.MAX_HEAD_BYTES.get()


@dataclass(frozen=True)
class FileParts:
    """A weight file's head and conv kernels, as an export needs them."""

    #: the head's tensors by their names in adapter.extra_tensors (PEFT's key less its base_model.model. prefix);
    #: None when the adapter has none or it is not kept (`why_not`)
    head: dict[str, torch.Tensor] | None
    #: each conv module's kernel, (in_channels, k...), whose product is its stored in_features
    kernels: dict[str, tuple[int, ...]]
    #: why a head is not kept (past ZOO_MAX_HEAD_BYTES, or a tensor missing from the file)
    why_not: str | None = None


def needs_file(fmt: str, kinds: Mapping[str, str], extra_tensors: Sequence[str]) -> bool:
    """Whether an adapter has anything `file_parts` takes: a PEFT head, or a conv module."""
    return (fmt == "peft" and bool(extra_tensors)) or "conv" in kinds.values()


def file_parts(
    raw: RawAdapter, fmt: str, convs: Mapping[str, int], extra_tensors: Sequence[str], max_bytes: int | None = None
) -> FileParts:
    """The head of a PEFT adapter (`extra_tensors`: its names; none past `max_bytes`) and the kernel of each conv module
    (`convs`: name → stored in_features) in its read files. A safetensors file's kernels come from its header (the one
    read already, for a single file), and only a head's tensors are built (copied out of the file's bytes; a streamed
    file's read); a pickle is loaded again."""
    shapes, dtype_bytes, tensors = _contents(raw)
    kohya = kohya_names(list(convs)) if convs else {}  # a kohya file's modules may be stored under their model paths
    kernels: dict[str, tuple[int, ...]] = {}
    for name, inputs in convs.items():
        kernel = next((k for stem in (PEFT_PREFIX + name, name, kohya.get(name)) if stem and (k := _kernel(shapes, stem))), None)
        if kernel is not None and math.prod(kernel) == inputs:
            kernels[name] = kernel
    if fmt != "peft" or not extra_tensors:
        return FileParts(None, kernels)
    keys = {name: next((k for k in (PEFT_PREFIX + name, name) if k in shapes), None) for name in extra_tensors}
    missing = sorted(name for name, key in keys.items() if key is None)
    if missing:
        return FileParts(None, kernels, f"{missing[0]} is not in {raw.weights.path}")
    size = sum(math.prod(shapes[str(key)]) * dtype_bytes(str(key)) for key in keys.values())
    if max_bytes is not None and size > max_bytes:
        return FileParts(None, kernels, f"its {size:,} bytes are past the limit of {max_bytes:,} (ZOO_MAX_HEAD_BYTES)")
    found = tensors()
    return FileParts({name: found[raw.prefix + str(key)].clone() for name, key in keys.items()}, kernels)


def _contents(raw: RawAdapter) -> tuple[Mapping[str, Sequence[int]], Callable[[str], int], Callable[[], Mapping[str, torch.Tensor]]]:
    """(each tensor's shape and a tensor's bytes per element, by its name as read: without the file's wrapper prefix
    (`raw.prefix`), and its tensors when asked, by their names in the file) of a read weight file."""
    weights, prefix = raw.weights, raw.prefix
    if weights.path.suffix == SAFETENSORS_SUFFIX:
        header = raw.header or safetensors_header(weights.path, weights.data)
        shapes = {key.removeprefix(prefix): entry["shape"] for key, entry in header.entries.items()}
        return shapes, lambda key: DTYPE_BYTES[header.entries[prefix + key]["dtype"]], lambda: safetensors_tensors(weights, header)
    loaded = parse_weights_only_pickle(weights)
    return {key: t.shape for key, t in loaded.items()}, lambda key: loaded[key].element_size(), lambda: loaded


def _kernel(shapes: Mapping[str, Sequence[int]], stem: str) -> tuple[int, ...] | None:
    """The kernel, (in_channels, k...), of the conv module whose keys in the file start with `stem`, as its down factor
    has it (a LyCORIS Tucker module's: its 1×1 down's channels and its mid's kernel); None when there is no such factor."""
    keys = (stem + suffix for suffix in _DOWN_SUFFIXES)
    down = next((shapes[k] for k in keys if k in shapes and len(shapes[k]) > 2), None)
    if down is None:
        return None
    mid = shapes.get(stem + _MID)
    return (int(down[1]), *(int(k) for k in (mid if mid is not None else down)[2:]))
