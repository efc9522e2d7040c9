"""Adapters laid out at the module shapes of public models, with realistic synthetic factors.

The shapes come from the models' published configs (zoo/domain/model_shapes.py): Llama-3-8B, Mistral-7B,
Qwen2.5-7B (PEFT directories), SD 1.5, SD 2.1 and SDXL (kohya `.safetensors` with UNet convs and the text
encoders) and Flux.1-dev (a diffusers `.safetensors`). `layers` keeps the first few blocks at their real widths,
which is what the tests use; benchmarks write whole adapters.

The factors are made to look like trained ones: adapters come in families that share half of each
module's rank (a common task) and differ in the rest, each adapter has its own overall scale drawn
log-normally, the singular values decay geometrically, and the tensors are stored in the dtype such
files are published in (bf16 or fp16). Everything is seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from zoo.domain.model_shapes import ModuleShape, flux, llm, sd1, sd2, sdxl

#: the overall scale of an adapter: exp(N(0, SCALE_SPREAD²))
SCALE_SPREAD = 0.5
#: how far a family member's copy of the shared part strays from the family's (relative)
SHARED_JITTER = 0.1


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
    #: a kohya file's metadata naming its base: (ss_base_model_version, ss_sd_model_name)
    kohya_base: tuple[str, str] = ("", "")

    def modules(self, layers: int | None = None) -> list[ModuleShape]:
        return list(_MODULES[self.kind](self.blocks if layers is None else min(layers, self.blocks)))

    def file_bytes(self, layers: int | None = None) -> int:
        """The weight file's tensor bytes (factors only)."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(self.rank * (m.fan_in + m.out) * size for m in self.modules(layers))


_MODULES = {
    "llama3-8b": llm(4096, 14336, 1024),
    "mistral-7b": llm(4096, 14336, 1024, ("q_proj", "v_proj")),
    "qwen2.5-7b": llm(3584, 18944, 512),
    "sd1.5": sd1,
    "sd2.1": sd2,
    "sdxl": sdxl,
    "flux1-dev": flux,
}

MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama3-8b", "meta-llama/Meta-Llama-3-8B", "peft", 16, 32.0, torch.bfloat16, 32),
    "mistral-7b": ModelShape("mistral-7b", "mistralai/Mistral-7B-v0.1", "peft", 8, 16.0, torch.bfloat16, 32),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", "Qwen/Qwen2.5-7B", "peft", 16, 32.0, torch.bfloat16, 28),
    "sd1.5": ModelShape(
        "sd1.5", "runwayml/stable-diffusion-v1-5", "kohya", 8, 4.0, torch.float16, 9, ("sd_v1", "v1-5-pruned-emaonly.safetensors")
    ),
    "sd2.1": ModelShape(
        "sd2.1", "stabilityai/stable-diffusion-2-1", "kohya", 8, 4.0, torch.float16, 9, ("sd_v2", "v2-1_768-ema-pruned.safetensors")
    ),
    "sdxl": ModelShape(
        "sdxl",
        "stabilityai/stable-diffusion-xl-base-1.0",
        "kohya",
        8,
        4.0,
        torch.float16,
        7,
        ("sdxl_base_v1-0", "sd_xl_base_1.0.safetensors"),
    ),
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


def write_adapter(kind: str, directory: Path, family: int, member: int, layers: int | None = None, name_base: bool = True) -> Path:
    """Write one adapter of `kind` (a key of MODELS) under `directory` and return its path: a PEFT directory or a
    `.safetensors` file named `<kind>-f<family>-m<member>`. `name_base=False` writes files that do not name their base
    model (no `base_model_name_or_path`, no kohya base metadata), as many published ones do not."""
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
        (out / "adapter_config.json").write_text(json.dumps(_peft_config(model, layers, name_base)))
        return out
    out = directory / f"{name}.safetensors"
    save_file(tensors, str(out), metadata=_file_metadata(model, name, name_base))
    return out


def _named(model: ModelShape, name: str, A: torch.Tensor, B: torch.Tensor) -> dict[str, torch.Tensor]:
    if model.layout == "peft":
        stem = f"base_model.model.{name}"
        return {f"{stem}.lora_A.weight": A.contiguous(), f"{stem}.lora_B.weight": B.contiguous()}
    if model.layout == "kohya":
        alpha = torch.tensor(model.alpha, dtype=model.dtype)
        return {f"{name}.lora_down.weight": A.contiguous(), f"{name}.lora_up.weight": B.contiguous(), f"{name}.alpha": alpha}
    return {f"{name}.lora_A.weight": A.contiguous(), f"{name}.lora_B.weight": B.contiguous()}


def _peft_config(model: ModelShape, layers: int | None, name_base: bool) -> dict[str, object]:
    targets = sorted({m.name.rsplit(".", 1)[-1] for m in model.modules(layers)})
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": model.base_model if name_base else None,
        "task_type": "CAUSAL_LM",
        "r": model.rank,
        "lora_alpha": model.alpha,
        "lora_dropout": 0.05,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
    }


def _file_metadata(model: ModelShape, name: str, name_base: bool) -> dict[str, str]:
    if model.layout != "kohya":
        return {"format": "pt"}
    version, checkpoint = model.kohya_base
    based = {"ss_base_model_version": version, "ss_sd_model_name": checkpoint} if name_base else {}
    return {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(model.rank),
        "ss_network_alpha": str(model.alpha),
        "ss_network_args": json.dumps({"conv_dim": str(model.rank), "conv_alpha": str(model.alpha)}),
        **based,
        "ss_output_name": name,
        "ss_mixed_precision": "fp16",
    }


def write_zoo(kind: str, directory: Path, families: int, members: int, layers: int | None = None) -> list[tuple[Path, int]]:
    """`families` × `members` adapters of `kind` under `directory`: (path, family) each."""
    return [(write_adapter(kind, directory, f, m, layers), f) for f in range(families) for m in range(members)]
