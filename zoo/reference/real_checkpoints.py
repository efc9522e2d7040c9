"""A full-checkpoint pair (base, fine-tuned) at a real small-LLM shape, for `zoo ingest FINETUNED --base BASE`.

The shape is TinyLlama-1.1B's published config (hidden 2048, intermediate 5632, 22 layers, 32 heads of 64
with 4 key/value heads, vocab 32000, untied lm_head) under Hugging Face's Llama tensor names, stored in bf16
as such checkpoints are published. `layers` keeps the first few blocks at their real widths (and `vocab`
may shrink the embedding tables) for tests; the default writes the whole 1.1B-parameter pair, 2.2 GB a file.

The base weights are N(0, 0.02²) (the config's initializer range), RMSNorm weights near 1. The fine-tuned
matrix is base + a delta that looks like a full fine-tune's: a low-rank part with power-law singular values
σ_i ∝ i^-d (d drawn per matrix in [0.6, 1.2], so 90% of the energy takes from a few to most of 64 directions)
and a log-normal scale, plus small dense noise, all seeded per tensor; the fine-tuned matrix is then rounded
to bf16 like the base. Both files are written tensor by tensor and row block by row block into one
`.safetensors` each (zoo reads single files, not sharded directories), so writing the 1.1B pair needs a few
hundred MB, not the checkpoints' size.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

#: standard deviation of the base weights (TinyLlama's initializer_range)
WEIGHT_STD = 0.02
#: RMS per element of a matrix delta's low-rank part (about 5% of the weights' RMS), times exp(N(0, DELTA_SPREAD²))
DELTA_RMS = 1e-3
DELTA_SPREAD = 0.5
#: RMS per element of a delta's dense noise, relative to its low-rank part's
NOISE_RELATIVE = 0.15
#: directions in a delta's low-rank part, and the range of the power-law exponent of their singular values (drawn
#: per matrix: at 0.6 the energy is spread so that 90% of it takes most of the 64 directions, at 1.2 a handful)
DELTA_COMPONENTS = 64
DELTA_DECAY = (0.6, 1.2)
#: rows generated and written at once (bounds the writer's memory)
ROW_BLOCK = 2048


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture checkpoint's tensor layout."""

    hidden: int = 2048
    intermediate: int = 5632
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 32000
    tied: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name → shape, as Hugging Face's LlamaForCausalLM state dict names them."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,)}
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        return out

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensors().values())


#: TinyLlama-1.1B (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json)
TINYLLAMA = LlamaShape()
BASE_NAME = "tinyllama-base.safetensors"
FINETUNED_NAME = "tinyllama-finetuned.safetensors"


def write_checkpoint_pair(directory: Path, layers: int | None = None, seed: int = 0, vocab: int | None = None) -> tuple[Path, Path]:
    """Write (base, fine-tuned) TinyLlama-shaped bf16 checkpoints into `directory`; returns their paths.

    `layers`: only the first that many decoder blocks (all 22 by default); `vocab`: a smaller vocabulary.
    The same arguments write the same bytes."""
    shape = LlamaShape(layers=TINYLLAMA.layers if layers is None else layers, vocab=vocab or TINYLLAMA.vocab)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base, tuned = directory / BASE_NAME, directory / FINETUNED_NAME
    layout = dict(sorted(shape.tensors().items()))  # the order safetensors' own writer uses (all one dtype)
    with base.open("wb") as fb, tuned.open("wb") as ft:
        header = safetensors_header_bytes(layout)
        fb.write(header)
        ft.write(header)
        for name, dims in layout.items():
            for w0, w in tensor_blocks(name, dims, seed):
                _write_bf16(fb, w0)
                _write_bf16(ft, w)
    return base, tuned


def safetensors_header_bytes(layout: dict[str, tuple[int, ...]], dtype: str = "BF16", itemsize: int = 2) -> bytes:
    """The 8-byte length and JSON header of a safetensors file whose tensors are packed in `layout`'s order,
    padded with spaces to a multiple of 8 as safetensors does."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in layout.items():
        size = math.prod(dims) * itemsize
        entries[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def tensor_blocks(name: str, dims: tuple[int, ...], seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(base, fine-tuned) bf16 row blocks of one tensor, in row order, seeded by `seed` and the tensor's name."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1_000_003 + seed)
    if len(dims) == 1:
        w0 = 1.0 + 0.05 * torch.randn(dims, generator=g)
        yield w0.to(torch.bfloat16), (w0 + 2e-3 * torch.randn(dims, generator=g)).to(torch.bfloat16)
        return
    rows, cols = dims
    k = min(DELTA_COMPONENTS, rows, cols)
    low, high = DELTA_DECAY
    decay = low + (high - low) * float(torch.rand((), generator=g))
    rms = DELTA_RMS * math.exp(DELTA_SPREAD * float(torch.randn((), generator=g)))
    sigma = torch.arange(1, k + 1, dtype=torch.float32) ** -decay
    sigma *= rms * math.sqrt(rows * cols) / torch.linalg.vector_norm(sigma)  # ||low-rank||_F = rms·√(rows·cols)
    left = torch.linalg.qr(torch.randn(rows, k, generator=g)).Q
    right = torch.linalg.qr(torch.randn(cols, k, generator=g)).Q * sigma
    for start in range(0, rows, ROW_BLOCK):
        n = min(ROW_BLOCK, rows - start)
        w0 = (WEIGHT_STD * torch.randn(n, cols, generator=g)).to(torch.bfloat16)
        delta = left[start : start + n] @ right.T
        delta += (NOISE_RELATIVE * rms) * torch.randn(n, cols, generator=g)
        yield w0, (w0.float() + delta).to(torch.bfloat16)


def _write_bf16(fh: BinaryIO, t: torch.Tensor) -> None:
    fh.write(t.contiguous().view(torch.int16).numpy().tobytes())


def main() -> None:
    """`python -m zoo.reference.real_checkpoints DIR [LAYERS]`: write the pair and print its paths."""
    import sys

    directory = Path(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else None
    for path in write_checkpoint_pair(directory, layers):
        print(path)


if __name__ == "__main__":
    main()
