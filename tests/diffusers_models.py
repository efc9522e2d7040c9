"""Tiny seeded diffusers models and LoRA files written (and loaded) by diffusers itself.

Builders make a UNet2DConditionModel, a CLIP text encoder, a FluxTransformer2DModel and a whole
StableDiffusionPipeline from small configs (no download). Writers give each a LoRA through PEFT
(`add_adapter` with random factors, so that B·A ≠ 0) and save it the way diffusers does today
(`save_lora_weights`); `write_attn_procs_lora` writes the 2023 attn-procs convention that current
diffusers no longer writes but still loads. `fused_deltas` loads a file into fresh models with
diffusers' own loader, fuses it and returns fused − base weight for every layer that changed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, FluxPipeline, FluxTransformer2DModel, StableDiffusionPipeline, UNet2DConditionModel
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel

#: the attention projections diffusers' LoRA training scripts target, in the UNet and in CLIP
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
#: the 2023 attn-procs suffix of each UNet target, and of each CLIP target (diffusers 0.14-0.20)
ATTN_PROC_UNET = {"to_q": "to_q_lora", "to_k": "to_k_lora", "to_v": "to_v_lora", "to_out.0": "to_out_lora"}
ATTN_PROC_TEXT = {"q_proj": "to_q_lora", "k_proj": "to_k_lora", "v_proj": "to_v_lora", "out_proj": "to_out_lora"}


def tiny_unet(seed: int = 0) -> UNet2DConditionModel:
    """A two-block UNet (32 and 64 channels, cross-attention on a 32-wide text encoder)."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()


def tiny_text_encoder(seed: int = 0) -> CLIPTextModel:
    """A two-layer CLIP text encoder, 32 wide."""
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, max_position_embeddings=16
    )
    return CLIPTextModel(config).eval()


def tiny_flux_transformer(seed: int = 0) -> FluxTransformer2DModel:
    """A one-double-block, one-single-block Flux transformer, 32 wide."""
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ).eval()


def tiny_sd_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """A StableDiffusionPipeline of the tiny UNet and text encoder (a tiny VAE, DDIM; no tokenizer or safety checker)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=(8,),
        latent_channels=4,
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=tiny_text_encoder(seed),
        tokenizer=None,
        unet=tiny_unet(seed),
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def add_random_lora(
    model: torch.nn.Module, targets: tuple[str, ...], seed: int, rank: int = 4, alpha: float = 8.0
) -> dict[str, torch.Tensor]:
    """Give `model` a PEFT LoRA on `targets` with random A and B (seeded) and return its state dict as
    diffusers saves it (`get_peft_model_state_dict`: `<module>.lora_A.weight`, `<module>.lora_B.weight`)."""
    # what `add_adapter` of diffusers and transformers does (transformers' asks for a newer PEFT than the pinned one)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False), model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return get_peft_model_state_dict(model)


def write_current_lora(
    directory: Path,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
    text_encoder: bool = True,
    weight_name: str = "pytorch_lora_weights.safetensors",
) -> Path:
    """A LoRA on the tiny UNet (and CLIP text encoder) saved by `StableDiffusionPipeline.save_lora_weights`:
    `unet.<module>.lora_A.weight` ..., `text_encoder.<module>.lora_A.weight` ..., with the PEFT configs in the metadata."""
    unet_layers = add_random_lora(tiny_unet(), UNET_TARGETS, seed, rank, alpha)
    te_layers = add_random_lora(tiny_text_encoder(), TEXT_TARGETS, seed + 1000, rank, alpha) if text_encoder else None
    config = {"r": rank, "lora_alpha": alpha, "target_modules": list(UNET_TARGETS)}
    StableDiffusionPipeline.save_lora_weights(
        directory,
        unet_lora_layers=unet_layers,
        text_encoder_lora_layers=te_layers,
        weight_name=weight_name,
        unet_lora_adapter_metadata=config,
        text_encoder_lora_adapter_metadata={**config, "target_modules": list(TEXT_TARGETS)} if text_encoder else None,
    )
    return Path(directory) / weight_name


def attn_procs_state_dict(current: dict[str, torch.Tensor], prefixed: bool = True) -> dict[str, torch.Tensor]:
    """The 2023 attn-procs keys of a current-layout state dict (rank = alpha: that format had no alpha):
    `unet.<block>.attn1.processor.to_q_lora.down.weight` for `unet.<block>.attn1.to_q.lora_A.weight`, and
    `text_encoder.<layer>.self_attn.to_q_lora.down.weight` for `text_encoder.<layer>.self_attn.q_proj.lora_A.weight`.
    Without `prefixed`, the UNet keys lose `unet.` (what `unet.save_attn_procs` wrote)."""
    out = {}
    for key, tensor in current.items():
        component, rest = key.split(".", 1)
        module, factor = rest.rsplit(".", 2)[0], {"lora_A": "down", "lora_B": "up"}[rest.rsplit(".", 2)[1]]
        parent, target = (module.rsplit(".", 2)[0], "to_out.0") if module.endswith("to_out.0") else module.rsplit(".", 1)
        if component == "unet":
            name = f"{parent}.processor.{ATTN_PROC_UNET[target]}.{factor}.weight"
            out[f"unet.{name}" if prefixed else name] = tensor
        else:
            out[f"{component}.{parent}.{ATTN_PROC_TEXT[target]}.{factor}.weight"] = tensor
    return out


def write_attn_procs_lora(path: Path, current: dict[str, torch.Tensor], prefixed: bool = True) -> Path:
    """Write the 2023 attn-procs file holding the same update as a current-layout state dict whose alpha is its rank
    (a weights-only torch pickle when `path` ends in .bin)."""
    tensors = {k: v.contiguous() for k, v in attn_procs_state_dict(current, prefixed).items()}
    if Path(path).suffix == ".bin":
        torch.save(tensors, path)  # pytorch_lora_weights.bin: what diffusers 0.14's unet.save_attn_procs wrote
    else:
        save_file(tensors, str(path))
    return Path(path)


def fused_deltas(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Load a LoRA file into a fresh tiny pipeline with diffusers' own loader, fuse it, and return, for every
    weight that changed, `<component>.<module>` → fused weight − base weight (float64)."""
    pipe = tiny_sd_pipeline(seed)
    components = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    base = {c: {k: v.detach().clone() for k, v in m.state_dict().items()} for c, m in components.items()}
    path = Path(path)
    if not any(k.startswith(("unet.", "text_encoder.", "lora_unet_", "lora_te")) for k in _keys(path)):
        # an unprefixed attn-procs file: what unet.save_attn_procs wrote, loaded as diffusers loads a UNet's own LoRA
        pipe.unet.load_lora_adapter(str(path.parent), weight_name=path.name, prefix=None)
    else:
        pipe.load_lora_weights(str(path.parent), weight_name=path.name)  # from the file: its metadata's configs apply
    pipe.fuse_lora(components=list(components), lora_scale=1.0)
    pipe.unload_lora_weights()
    deltas = {}
    for component, model in components.items():
        for key, value in model.state_dict().items():
            before = base[component].get(key)
            if before is not None and key.endswith(".weight") and not torch.equal(before, value):
                deltas[f"{component}.{key.removesuffix('.weight')}"] = value.double() - before.double()
    return deltas


def write_flux_lora(directory: Path, seed: int = 0, rank: int = 4, alpha: float | None = 2.0) -> Path:
    """A LoRA on the tiny Flux transformer's attention saved by `FluxPipeline.save_lora_weights`
    (`transformer.<module>.lora_A.weight` ...), with a `transformer.<module>.alpha` beside each pair when `alpha` is
    given (as trainers converting kohya files write; diffusers' Flux loader reads them as network alphas)."""
    layers = add_random_lora(tiny_flux_transformer(), UNET_TARGETS, seed, rank)
    FluxPipeline.save_lora_weights(directory, transformer_lora_layers=layers)
    path = Path(directory) / "pytorch_lora_weights.safetensors"
    if alpha is not None:
        tensors = load_file(str(path))
        stems = [k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight")]
        save_file({**tensors, **{f"{stem}.alpha": torch.tensor(alpha) for stem in stems}}, str(path))
    return path


def fused_flux_deltas(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """`transformer.<module>` → fused − base weight after diffusers' Flux loader loads the file into a fresh tiny
    transformer (its alphas as network alphas) and fuses it."""
    model = tiny_flux_transformer(seed)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state_dict, alphas = FluxPipeline.lora_state_dict(str(Path(path).parent), weight_name=Path(path).name, return_alphas=True)
    FluxPipeline.load_lora_into_transformer(state_dict, network_alphas=alphas, transformer=model)
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    return {
        f"transformer.{k.removesuffix('.weight')}": v.double() - base[k].double()
        for k, v in model.state_dict().items()
        if k in base and k.endswith(".weight") and not torch.equal(base[k], v)
    }


def _keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors or weights-only .bin file."""
    return list(torch.load(path, weights_only=True) if path.suffix == ".bin" else load_file(str(path)))
