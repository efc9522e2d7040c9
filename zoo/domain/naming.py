"""What a module's name says: its layer and its type (no torch, no I/O)."""

from __future__ import annotations

import re

_LAYER_RE = re.compile(r"(?:^|[._])(\d+)(?:[._]|$)")


def layer_index(name: str) -> int | None:
    """First integer path component of a module name (`model.layers.3.q_proj` → 3)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def module_type(name: str) -> str:
    """Last non-numeric path component: `model.layers.3.self_attn.q_proj` → q_proj,
    kohya's `lora_unet_down_blocks_0_attentions_0_proj_in` → proj_in."""
    parts = [p for p in name.split(".") if p and not p.isdigit()]
    last = parts[-1] if parts else name
    return re.split(r"_\d+_", last)[-1]
