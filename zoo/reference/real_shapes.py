"""Adapters laid out at the module shapes of public models, with realistic synthetic factors.

The shapes come from the models' published configs (no weights are needed): Llama-3-8B, Mistral-7B,
Qwen2.5-7B (PEFT directories), SDXL (a kohya `.safetensors` with UNet convs and both text encoders)
and Flux.1-dev (a diffusers `.safetensors`). `layers` keeps the first few blocks at their real widths,
which is what the tests use; benchmarks write whole adapters.

The factors are made to look like trained ones: adapters come in families that share half of each
module's rank (a common task) and differ in the rest, each adapter has its own overall scale drawn
log-normally, the singular values decay geometrically, and the tensors are stored in the dtype such
files are published in (bf16 or fp16). Everything is seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

#: the overall scale of an adapter: exp(N(0, SCALE_SPREAD²))
SCALE_SPREAD = 0.5
#: how far a family member's copy of the shared part strays from the family's (relative)
SHARED_JITTER = 0.1


@dataclass(frozen=True)
class ModuleShape:
    """One LoRA-adapted module: its name in the file (without the format's prefix and suffixes), its weight's
    out × in, and a conv kernel (kh, kw) when it is a convolution."""

    name: str
    out: int
    inp: int
    kernel: tuple[int, int] | None = None

    @property
    def fan_in(self) -> int:
        return self.inp * (self.kernel[0] * self.kernel[1] if self.kernel else 1)


@dataclass(frozen=True)
class ModelShape:
    """An adapted model: where its LoRAs come from and how they are laid out."""

    kind: str
    base_model: str
    layout: str  # peft | kohya | diffusers
    rank: int
    alpha: float
    dtype: torch.dtype
    blocks: int  # transformer layers (LLMs) or UNet/transformer blocks the `layers` argument counts

    def modules(self, layers: int | None = None) -> list[ModuleShape]:
        return list(_MODULES[self.kind](self.blocks if layers is None else min(layers, self.blocks)))

    def file_bytes(self, layers: int | None = None) -> int:
        """The weight file's tensor bytes (factors only)."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(self.rank * (m.fan_in + m.out) * size for m in self.modules(layers))


def _llm(hidden: int, intermediate: int, kv: int, targets: tuple[str, ...]) -> Callable[[int], Iterator[ModuleShape]]:
    shapes = {
        "q_proj": ("self_attn", hidden, hidden),
        "k_proj": ("self_attn", kv, hidden),
        "v_proj": ("self_attn", kv, hidden),
        "o_proj": ("self_attn", hidden, hidden),
        "gate_proj": ("mlp", intermediate, hidden),
        "up_proj": ("mlp", intermediate, hidden),
        "down_proj": ("mlp", hidden, intermediate),
    }

    def modules(layers: int) -> Iterator[ModuleShape]:
        for i in range(layers):
            for t in targets:
                block, out, inp = shapes[t]
                yield ModuleShape(f"model.layers.{i}.{block}.{t}", out, inp)

    return modules


_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _transformer_block(prefix: str, width: int, context: int) -> Iterator[ModuleShape]:
    """A diffusers BasicTransformerBlock: self-attention, cross-attention to the text, GEGLU feed-forward."""
    for attn, kv_in in (("attn1", width), ("attn2", context)):
        yield ModuleShape(f"{prefix}_{attn}_to_q", width, width)
        yield ModuleShape(f"{prefix}_{attn}_to_k", width, kv_in)
        yield ModuleShape(f"{prefix}_{attn}_to_v", width, kv_in)
        yield ModuleShape(f"{prefix}_{attn}_to_out_0", width, width)
    yield ModuleShape(f"{prefix}_ff_net_0_proj", 8 * width, width)
    yield ModuleShape(f"{prefix}_ff_net_2", width, 4 * width)


def _resnet(prefix: str, inp: int, out: int) -> Iterator[ModuleShape]:
    yield ModuleShape(f"{prefix}_conv1", out, inp, (3, 3))
    yield ModuleShape(f"{prefix}_conv2", out, out, (3, 3))
    if inp != out:
        yield ModuleShape(f"{prefix}_conv_shortcut", out, inp, (1, 1))


#: SDXL's UNet: (channels, transformer blocks per attention) per down block; the up blocks mirror them
_SDXL_DOWN = ((320, 0), (640, 2), (1280, 10))


def _sdxl(blocks: int) -> Iterator[ModuleShape]:
    """SDXL's UNet (the first `blocks` of its 7 down/mid/up blocks) and both text encoders (as many layers)."""
    unet: list[Iterator[ModuleShape]] = []
    skips = [320]
    ch = 320
    for b, (width, depth) in enumerate(_SDXL_DOWN):
        parts: list[ModuleShape] = []
        for j in range(2):
            parts += _resnet(f"lora_unet_down_blocks_{b}_resnets_{j}", ch, width)
            ch = width
            if depth:
                parts += _attention(f"lora_unet_down_blocks_{b}_attentions_{j}", width, depth)
            skips.append(ch)
        if b < 2:
            parts.append(ModuleShape(f"lora_unet_down_blocks_{b}_downsamplers_0_conv", ch, ch, (3, 3)))
            skips.append(ch)
        unet.append(iter(parts))
    mid = [*_resnet("lora_unet_mid_block_resnets_0", 1280, 1280), *_attention("lora_unet_mid_block_attentions_0", 1280, 10)]
    unet.append(iter([*mid, *_resnet("lora_unet_mid_block_resnets_1", 1280, 1280)]))
    for b, (width, depth) in enumerate(reversed(_SDXL_DOWN)):
        parts = []
        for j in range(3):
            parts += _resnet(f"lora_unet_up_blocks_{b}_resnets_{j}", ch + skips.pop(), width)
            ch = width
            if depth:
                parts += _attention(f"lora_unet_up_blocks_{b}_attentions_{j}", width, depth)
        if b < 2:
            parts.append(ModuleShape(f"lora_unet_up_blocks_{b}_upsamplers_0_conv", ch, ch, (3, 3)))
        unet.append(iter(parts))
    for part in unet[:blocks]:
        yield from part
    te_layers = 12 if blocks >= len(unet) else blocks
    yield from _clip("lora_te1_text_model_encoder_layers", 768, 3072, te_layers)
    yield from _clip("lora_te2_text_model_encoder_layers", 1280, 5120, 32 if blocks >= len(unet) else blocks)


def _attention(prefix: str, width: int, depth: int) -> Iterator[ModuleShape]:
    yield ModuleShape(f"{prefix}_proj_in", width, width)
    for t in range(depth):
        yield from _transformer_block(f"{prefix}_transformer_blocks_{t}", width, 2048)
    yield ModuleShape(f"{prefix}_proj_out", width, width)


def _clip(prefix: str, width: int, mlp: int, layers: int) -> Iterator[ModuleShape]:
    for i in range(layers):
        for t in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield ModuleShape(f"{prefix}_{i}_self_attn_{t}", width, width)
        yield ModuleShape(f"{prefix}_{i}_mlp_fc1", mlp, width)
        yield ModuleShape(f"{prefix}_{i}_mlp_fc2", width, mlp)


def _flux(blocks: int) -> Iterator[ModuleShape]:
    """Flux.1-dev's transformer: 19 double-stream blocks and 38 single-stream blocks, width 3,072
    (`blocks` < 19 keeps that many of each)."""
    width, mlp = 3072, 12288
    double, single = (19, 38) if blocks >= 19 else (blocks, blocks)
    for i in range(double):
        p = f"transformer.transformer_blocks.{i}"
        for t in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            yield ModuleShape(f"{p}.attn.{t}", width, width)
        for ff in ("ff", "ff_context"):
            yield ModuleShape(f"{p}.{ff}.net.0.proj", mlp, width)
            yield ModuleShape(f"{p}.{ff}.net.2", width, mlp)
    for i in range(single):
        p = f"transformer.single_transformer_blocks.{i}"
        for t in ("to_q", "to_k", "to_v"):
            yield ModuleShape(f"{p}.attn.{t}", width, width)
        yield ModuleShape(f"{p}.proj_mlp", mlp, width)
        yield ModuleShape(f"{p}.proj_out", width, width + mlp)


_MODULES = {
    "llama3-8b": _llm(4096, 14336, 1024, _ALL_LINEAR),
    "mistral-7b": _llm(4096, 14336, 1024, ("q_proj", "v_proj")),
    "qwen2.5-7b": _llm(3584, 18944, 512, _ALL_LINEAR),
    "sdxl": _sdxl,
    "flux1-dev": _flux,
}

MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama3-8b", "meta-llama/Meta-Llama-3-8B", "peft", 16, 32.0, torch.bfloat16, 32),
    "mistral-7b": ModelShape("mistral-7b", "mistralai/Mistral-7B-v0.1", "peft", 8, 16.0, torch.bfloat16, 32),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", "Qwen/Qwen2.5-7B", "peft", 16, 32.0, torch.bfloat16, 28),
    "sdxl": ModelShape("sdxl", "stabilityai/stable-diffusion-xl-base-1.0", "kohya", 8, 4.0, torch.float16, 7),
    "flux1-dev": ModelShape("flux1-dev", "black-forest-labs/FLUX.1-dev", "diffusers", 16, 16.0, torch.bfloat16, 19),
}


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256("|".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _factors(model: ModelShape, m: ModuleShape, family: int, member: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A r × fan_in, B out × r) float32 of one module: half the rank shared with the family (jittered per
    member), half the member's own, singular values decaying geometrically, scaled by `scale`."""
    r = model.rank
    shared = r // 2
    fam, own = _generator(model.kind, "family", family, m.name), _generator(model.kind, "member", family, member, m.name)
    A = torch.randn(r, m.fan_in, generator=own) / m.fan_in**0.5
    B = torch.randn(m.out, r, generator=own) / m.out**0.5
    if shared:
        A[:shared] = A[:shared] * SHARED_JITTER + torch.randn(shared, m.fan_in, generator=fam) / m.fan_in**0.5
        B[:, :shared] = B[:, :shared] * SHARED_JITTER + torch.randn(m.out, shared, generator=fam) / m.out**0.5
    decay = torch.exp(-torch.arange(r, dtype=torch.float32) / max(r / 3, 1.0))
    return A, B * (decay * scale * 0.05)


def adapter_scale(model: ModelShape, family: int, member: int) -> float:
    """The adapter's overall scale, log-normal around 1."""
    return float(torch.exp(SCALE_SPREAD * torch.randn(1, generator=_generator(model.kind, "scale", family, member))))


def write_adapter(kind: str, directory: Path, family: int, member: int, layers: int | None = None) -> Path:
    """Write one adapter of `kind` (a key of MODELS) under `directory` and return its path: a PEFT directory or a
    `.safetensors` file named `<kind>-f<family>-m<member>`."""
    model = MODELS[kind]
    name = f"{kind}-f{family}-m{member}"
    scale = adapter_scale(model, family, member)
    tensors: dict[str, torch.Tensor] = {}
    for m in model.modules(layers):
        A, B = _factors(model, m, family, member, scale)
        if m.kernel:
            A, B = A.reshape(model.rank, m.inp, *m.kernel), B.reshape(m.out, model.rank, 1, 1)
        tensors.update(_named(model, m.name, A.to(model.dtype), B.to(model.dtype)))
    directory.mkdir(parents=True, exist_ok=True)
    if model.layout == "peft":
        out = directory / name
        out.mkdir(exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(_peft_config(model, layers)))
        return out
    out = directory / f"{name}.safetensors"
    save_file(tensors, str(out), metadata=_file_metadata(model, name))
    return out


def _named(model: ModelShape, name: str, A: torch.Tensor, B: torch.Tensor) -> dict[str, torch.Tensor]:
    if model.layout == "peft":
        stem = f"base_model.model.{name}"
        return {f"{stem}.lora_A.weight": A.contiguous(), f"{stem}.lora_B.weight": B.contiguous()}
    if model.layout == "kohya":
        alpha = torch.tensor(model.alpha, dtype=model.dtype)
        return {f"{name}.lora_down.weight": A.contiguous(), f"{name}.lora_up.weight": B.contiguous(), f"{name}.alpha": alpha}
    return {f"{name}.lora_A.weight": A.contiguous(), f"{name}.lora_B.weight": B.contiguous()}


def _peft_config(model: ModelShape, layers: int | None) -> dict[str, object]:
    targets = sorted({m.name.rsplit(".", 1)[-1] for m in model.modules(layers)})
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": model.base_model,
        "task_type": "CAUSAL_LM",
        "r": model.rank,
        "lora_alpha": model.alpha,
        "lora_dropout": 0.05,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
    }


def _file_metadata(model: ModelShape, name: str) -> dict[str, str]:
    if model.layout != "kohya":
        return {"format": "pt"}
    return {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(model.rank),
        "ss_network_alpha": str(model.alpha),
        "ss_network_args": json.dumps({"conv_dim": str(model.rank), "conv_alpha": str(model.alpha)}),
        "ss_base_model_version": "sdxl_base_v1-0",
        "ss_sd_model_name": "sd_xl_base_1.0.safetensors",
        "ss_output_name": name,
        "ss_mixed_precision": "fp16",
    }


def write_zoo(kind: str, directory: Path, families: int, members: int, layers: int | None = None) -> list[tuple[Path, int]]:
    """`families` × `members` adapters of `kind` under `directory`: (path, family) each."""
    return [(write_adapter(kind, directory, f, m, layers), f) for f in range(families) for m in range(members)]
