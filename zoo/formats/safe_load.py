"""Loading tensors from untrusted files: safetensors with header checks, weights-only pickles."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from zoo.errors import InputError

#: bytes per element of each safetensors dtype
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


def max_header_bytes() -> int:
    """Largest safetensors JSON header accepted (ZOO_MAX_HEADER_BYTES, default 16 MiB)."""
    return int(os.environ.get("ZOO_MAX_HEADER_BYTES", 16 << 20))


def max_file_bytes() -> int:
    """Largest weight file accepted (ZOO_MAX_FILE_BYTES, default 4 GiB), as for uploads."""
    return int(os.environ.get("ZOO_MAX_FILE_BYTES", 4 << 30))


def check_file_size(path: Path) -> int:
    size = path.stat().st_size
    if size > max_file_bytes():
        raise InputError(path, f"file of {size} bytes exceeds the limit of {max_file_bytes()} bytes (ZOO_MAX_FILE_BYTES)")
    return size


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(path: Path) -> dict:
    """Validate the framing of a safetensors file and every tensor entry of its header (dtype, shape,
    offsets that match the shape, inside the file and not overlapping); return the parsed header."""
    size = check_file_size(path)
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise InputError(path, f"truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", prefix)
        if n > max_header_bytes():
            raise InputError(path, f"safetensors header of {n} bytes exceeds the limit of {max_header_bytes()} bytes")
        if 8 + n > size:
            raise InputError(path, f"truncated safetensors file: header claims {n} bytes but the file has {size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(path, f"corrupt safetensors header (not JSON: {type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise InputError(path, "corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    spans: list[tuple[int, int]] = []
    for key, info in header.items():
        if key == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise InputError(path, "corrupt safetensors header: __metadata__ must map names to strings")
            continue
        if not isinstance(info, dict):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has unknown dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_is_int(d) for d in shape)):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has no valid data_offsets")
        numel = math.prod(shape)
        if offsets[1] > data_size:
            raise InputError(path, f"truncated safetensors file: tensor {key!r} needs {offsets[1]} data bytes, the file has {data_size}")
        if numel * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            span = offsets[1] - offsets[0]
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} of shape {shape} does not fill its {span} bytes")
        spans.append((offsets[0], offsets[1]))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise InputError(path, "corrupt safetensors header: tensors overlap")
    return header


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and `__metadata__` of a safetensors file, refusing malformed files by name."""
    header = read_safetensors_header(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise InputError(path, f"corrupt safetensors file ({exc})") from None
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}


def load_weights_only_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A torch pickle loaded with weights_only=True: code in the pickle is never run."""
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever a hostile pickle makes torch raise, the file is refused
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(path, f"refused: not a weights-only torch file ({first})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(path, "refused: expected a dict of tensors")
    return obj


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (and metadata) of a .safetensors file or a weights-only .bin/.pt/.pth pickle."""
    if not path.exists():
        raise InputError(path, "no such file")
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    if path.suffix in {".bin", ".pt", ".pth"}:
        check_file_size(path)
        return load_weights_only_pickle(path), {}
    raise InputError(path, "unsupported file type: expected .safetensors (or a weights-only .bin/.pt/.pth)")
