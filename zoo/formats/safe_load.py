"""Loading tensors from untrusted files: safetensors with header checks, weights-only pickles."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from zoo.errors import InputError

#: Largest safetensors JSON header accepted (bytes); override with ZOO_MAX_HEADER_BYTES.
MAX_HEADER_BYTES = int(os.environ.get("ZOO_MAX_HEADER_BYTES", 16 * 1024 * 1024))


def read_safetensors_header(path: Path) -> dict:
    """Validate the framing of a safetensors file and return its parsed JSON header."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise InputError(path, f"truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise InputError(path, f"safetensors header of {n} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise InputError(path, f"truncated safetensors file: header claims {n} bytes but the file has {size}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"corrupt safetensors header (not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise InputError(path, "corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has no data_offsets")
        end = max(end, int(offsets[1]))
    if end > data_size:
        raise InputError(path, f"truncated safetensors file: tensors need {end} data bytes, the file has {data_size}")
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
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as exc:
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
        return load_weights_only_pickle(path), {}
    raise InputError(path, "unsupported file type: expected .safetensors (or a weights-only .bin/.pt/.pth)")
