"""kohya-ss names of the LoRA modules of SD-family pipelines (SD 1.x/2.x, SDXL), from diffusers' names.

kohya sd-scripts names a module by its model and its path in that model with dots made underscores:
`lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q` for the UNet's
`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`, and `lora_te_text_model_encoder_layers_0_self_attn_q_proj`
for the CLIP text encoder's `text_model.encoder.layers.0.self_attn.q_proj` (`lora_te1_` and `lora_te2_` for SDXL's
two). A1111 and ComfyUI load these names; diffusers' `load_lora_weights` converts them back.

diffusers names a module `unet.<path>` and `text_encoder.<path>` (`text_encoder_2.` for SDXL's second); its
current files drop CLIP's `text_model.`, and a UNet saved alone has no `unet.` prefix.

Back from kohya's names: underscores are ambiguous (`down_blocks_0_attentions_0_proj_in`, `ff_net_0_proj`), so a kohya
name is read as a path by lookup in the module tables of zoo/domain/model_shapes.py (SD 1.5, SD 2.1 and SDXL, which give
each name one path: a path is a name's in every family that has it), `model_path`; so is the kohya name of an SD
UNet module in the original (SGM/LDM) layout that kohya-ss's SDXL training and A1111 write,
`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q` → `unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`.
"""

from __future__ import annotations

import functools

from zoo.domain.model_shapes import VOCABULARIES

UNET = "lora_unet_"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
#: kohya prefix of each text encoder: (one text encoder, SDXL's two)
TEXT_PREFIXES = {"text_encoder": ("lora_te_", "lora_te1_"), "text_encoder_2": ("lora_te2_", "lora_te2_")}
#: kohya-ss's prefixes: the UNet's (and Flux's own modules'), the text encoders', and Flux's diffusers modules'
KOHYA_PREFIXES = (UNET, "lora_te_", "lora_te1_", "lora_te2_", "lora_transformer_")
#: first path parts of a diffusers UNet's modules (a UNet's file without the `unet.` prefix)
UNET_ROOTS = ("down_blocks", "mid_block", "up_blocks", "conv_in", "conv_out", "time_embedding", "add_embedding", "conv_norm_out")
CLIP_ROOT = "text_model"
#: the projection of SDXL's second text encoder, outside its text_model (`lora_te2_text_projection`)
TEXT_PROJECTION = "text_projection"
#: first path parts of Flux's modules in its own names
FLUX_ROOTS = ("double_blocks.", "single_blocks.")


def is_kohya_name(name: str) -> bool:
    """Whether a module name is a kohya-ss one (`lora_unet_…`, `lora_te_…`, `lora_te1_…`, `lora_te2_…`)."""
    return name.startswith(KOHYA_PREFIXES) and "." not in name


def kohya_name(name: str, two_text_encoders: bool) -> str | None:
    """The kohya-ss name of a module named `name` (a kohya name stays as it is), None when it is not a module of an
    SD-family UNet or text encoder, nor one of Flux's own (Black Forest Labs') modules that kohya-ss's Flux LoRAs
    name (`double_blocks.0.img_attn.qkv` → `lora_unet_double_blocks_0_img_attn_qkv`; not diffusers' Flux
    `transformer.…`, nor an unknown name). `two_text_encoders`: the adapter has modules of SDXL's second text encoder,
    so the first is `lora_te1_`."""
    if is_kohya_name(name):
        return name
    if name.startswith(FLUX_ROOTS) and model_path(UNET + name.replace(".", "_")) == name:
        return UNET + name.replace(".", "_")
    component, _, path = name.partition(".")
    if component == "unet" and path:
        return UNET + path.replace(".", "_")
    if component in TEXT_ENCODERS and path:
        # CLIP's modules are under text_model (kohya names them so), but for the projection after it (SDXL's second)
        path = path if path.startswith(f"{CLIP_ROOT}.") or path == TEXT_PROJECTION else f"{CLIP_ROOT}.{path}"
        return TEXT_PREFIXES[component][two_text_encoders] + path.replace(".", "_")
    if component in UNET_ROOTS:
        return UNET + name.replace(".", "_")
    return None


def kohya_names(names: list[str]) -> dict[str, str | None]:
    """`kohya_name` of each of an adapter's module names."""
    two = any(n.startswith(("text_encoder_2.", "lora_te2_")) for n in names)
    return {n: kohya_name(n, two) for n in names}


@functools.cache
def _paths() -> dict[str, str]:
    """kohya name (and SGM alias) → dotted path of every module the model tables name both ways."""
    return {name: m.path for shapes in VOCABULARIES.values() for m in shapes() if m.path is not None for name in (m.name, *m.aliases)}


def model_path(name: str) -> str | None:
    """The dotted path, as diffusers names it (`unet.down_blocks.0.attentions.0.proj_in`,
    `text_encoder.encoder.layers.0.self_attn.q_proj`), of a kohya-named module that the model tables know, else None."""
    return _paths().get(name) if is_kohya_name(name) else None
