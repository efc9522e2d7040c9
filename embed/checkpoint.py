"""A W2T checkpoint directory: its files, and its metadata read without loading the models (no torch)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

META = "embedder.json"
WEIGHTS = "model.safetensors"
MEMORY = "memory.safetensors"


@functools.lru_cache(maxsize=16)
def checkpoint_meta(directory: Path) -> dict:
    """The checkpoint's metadata (config, schema, hybrid weight, predictors...); directories are never rewritten."""
    return json.loads((Path(directory) / META).read_text())
