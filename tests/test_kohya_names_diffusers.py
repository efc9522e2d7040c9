"""kohya-ss names of modules beside the UNet blocks' attention and resnet convs, checked against diffusers' own
conversion (diffusers.loaders.lora_conversion_utils, as `lora_state_dict` runs it): SD's `conv_in`, `conv_out`,
`time_embedding.linear_1/2` and each resnet's `time_emb_proj` (in diffusers' and in the original SGM layout), SDXL's
`add_embedding` (SGM's `label_emb`) and `text_projection`, and the `lora_transformer_…` names of Flux's diffusers
modules that `_convert_kohya_flux_lora_to_diffusers` reads. Each is read under the path diffusers gives it, with the
delta diffusers' converted factors give."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
from safetensors.torch import save_file

from zoo.domain.base_models import guess_base_model
from zoo.domain.kohya_names import kohya_names, model_path
from zoo.domain.model_shapes import VOCABULARIES
from zoo.formats import read_adapter
from zoo.formats.diffusers import module_name

RANK = 2
W = 3072  # Flux.1's width
#: kohya name → (out, in, kernel or None), at SD 1.5's shapes
SD_NAMES = {
    "lora_unet_conv_in": (320, 4, 3),
    "lora_unet_conv_out": (4, 320, 3),
    "lora_unet_time_embedding_linear_1": (1280, 320, None),
    "lora_unet_time_embedding_linear_2": (1280, 1280, None),
    "lora_unet_down_blocks_0_resnets_0_time_emb_proj": (320, 1280, None),
    "lora_unet_down_blocks_2_resnets_1_time_emb_proj": (1280, 1280, None),
    "lora_unet_mid_block_resnets_1_time_emb_proj": (1280, 1280, None),
    "lora_unet_up_blocks_3_resnets_2_time_emb_proj": (320, 1280, None),
    "lora_unet_down_blocks_0_attentions_0_proj_in": (320, 320, None),  # a name the tables always knew
}
#: SDXL's in the original (SGM) UNet, as kohya-ss's SDXL training writes them, and its second text encoder's projection
SGM_NAMES = {
    "lora_unet_input_blocks_0_0": (320, 4, 3),
    "lora_unet_out_2": (4, 320, 3),
    "lora_unet_time_embed_0": (1280, 320, None),
    "lora_unet_time_embed_2": (1280, 1280, None),
    "lora_unet_label_emb_0_0": (1280, 2816, None),
    "lora_unet_label_emb_0_2": (1280, 1280, None),
    "lora_unet_input_blocks_1_0_emb_layers_1": (320, 1280, None),
    "lora_unet_input_blocks_8_0_emb_layers_1": (1280, 1280, None),
    "lora_unet_middle_block_0_emb_layers_1": (1280, 1280, None),
    "lora_unet_middle_block_2_emb_layers_1": (1280, 1280, None),
    "lora_unet_output_blocks_3_0_emb_layers_1": (640, 1280, None),
    "lora_unet_output_blocks_8_0_emb_layers_1": (320, 1280, None),
    "lora_te2_text_projection": (1280, 1280, None),
}
#: Flux's diffusers modules under kohya's `lora_transformer_` prefix (and CLIP-L's `lora_te1_`), as diffusers converts them
FLUX_NAMES = {
    "lora_transformer_transformer_blocks_0_attn_to_q": (W, W, None),
    "lora_transformer_transformer_blocks_3_attn_to_out_0": (W, W, None),
    "lora_transformer_transformer_blocks_18_attn_add_k_proj": (W, W, None),
    "lora_transformer_transformer_blocks_1_attn_to_add_out": (W, W, None),
    "lora_transformer_single_transformer_blocks_37_attn_to_v": (W, W, None),
    "lora_transformer_x_embedder": (W, 64, None),
    "lora_transformer_context_embedder": (W, 4096, None),
    "lora_transformer_proj_out": (64, W, None),
    "lora_transformer_norm_out_linear": (2 * W, W, None),
    "lora_transformer_time_text_embed_timestep_embedder_linear_1": (W, 256, None),
    "lora_transformer_time_text_embed_guidance_embedder_linear_2": (W, W, None),
    "lora_transformer_time_text_embed_text_embedder_linear_1": (W, 768, None),
    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj": (768, 768, None),
}
#: names diffusers' converters do not map to the module (the block's path, or dots for underscores), which zoo reads as
#: the module the tables name
MISNAMED_BY_DIFFUSERS = {
    "lora_unet_add_embedding_linear_1": "unet.add_embedding.linear_1",
    "lora_transformer_transformer_blocks_0_ff_net_0_proj": "transformer.transformer_blocks.0.ff.net.0.proj",
    "lora_transformer_single_transformer_blocks_0_proj_mlp": "transformer.single_transformer_blocks.0.proj_mlp",
    "lora_transformer_transformer_blocks_0_norm1_linear": "transformer.transformer_blocks.0.norm1.linear",
}


def _file(path: Path, names: dict[str, tuple[int, int, int | None]], seed: int = 0) -> dict[str, torch.Tensor]:
    """A kohya-layout file of these modules (convs as LoCon writes them), alpha 1 each; its tensors."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for stem, (out, inp, k) in names.items():
        down = torch.randn(RANK, inp, *((k, k) if k else ()), generator=gen)
        up = torch.randn(out, RANK, *((1, 1) if k else ()), generator=gen) * 0.1
        tensors |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(1.0)}
    save_file(tensors, str(path))
    return tensors


def _converted_deltas(converted: dict[str, torch.Tensor], alphas: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """module name (zoo's, from diffusers' converted key) → the delta diffusers' converted factors give."""
    out = {}
    for key, down in converted.items():
        for down_suffix, up_suffix in ((".lora.down.weight", ".lora.up.weight"), (".lora_A.weight", ".lora_B.weight")):
            if key.endswith(down_suffix):
                stem = key.removesuffix(down_suffix)
                up = converted[stem + up_suffix]
                scale = (alphas or {}).get(stem + ".alpha", down.shape[0]) / down.shape[0]
                out[module_name(stem, "attn-procs")] = scale * up.reshape(up.shape[0], -1).double() @ down.reshape(RANK, -1).double()
    return out


def _read_deltas(path: Path) -> dict[str, torch.Tensor]:
    data = read_adapter(path)
    assert data.format == "kohya"
    return {m.name: m.scale * m.B.double() @ m.A.double() for m in data.modules}


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, delta in theirs.items():
        assert torch.linalg.norm(ours[name] - delta) <= 1e-6 * torch.linalg.norm(delta), name


def test_sd_time_embedding_conv_in_out_and_time_emb_proj_names_read_as_diffusers_converts_them(tmp_path: Path) -> None:
    tensors = _file(tmp_path / "sd.safetensors", SD_NAMES)
    converted, alphas = StableDiffusionPipeline.lora_state_dict(dict(tensors))
    _assert_same(_read_deltas(tmp_path / "sd.safetensors"), _converted_deltas(converted, alphas))
    data = read_adapter(tmp_path / "sd.safetensors")
    assert guess_base_model([(m.name, *m.shape) for m in data.modules]).families == ("sd1.x", "sd2.x")  # shapes they share


def test_sdxl_sgm_names_of_conv_in_out_time_and_label_embeddings_read_as_diffusers_converts_them(tmp_path: Path) -> None:
    tensors = _file(tmp_path / "sgm.safetensors", SGM_NAMES)
    converted, alphas = StableDiffusionXLPipeline.lora_state_dict(dict(tensors), unet_config=SimpleNamespace(layers_per_block=2))
    _assert_same(_read_deltas(tmp_path / "sgm.safetensors"), _converted_deltas(converted, alphas))
    data = read_adapter(tmp_path / "sgm.safetensors")
    assert guess_base_model([(m.name, *m.shape) for m in data.modules]).families == ("sdxl",)


def test_flux_lora_transformer_names_read_as_diffusers_converts_them(tmp_path: Path) -> None:
    tensors = _file(tmp_path / "flux.safetensors", FLUX_NAMES)
    converted = _convert_kohya_flux_lora_to_diffusers(dict(tensors))  # alpha / rank folded into the factors
    _assert_same(_read_deltas(tmp_path / "flux.safetensors"), _converted_deltas(converted, None))
    data = read_adapter(tmp_path / "flux.safetensors")
    assert guess_base_model([(m.name, *m.shape) for m in data.modules if m.name.startswith("transformer.")]).families == ("flux.1",)


def test_names_diffusers_misconverts_are_read_as_the_modules_they_name() -> None:
    """diffusers maps these to another name (a block's path: its Flux converter handles only attention projections
    in blocks; `add.embedding.linear` for SDXL's diffusers-named add_embedding); zoo reads the module the name names."""
    for name, path in MISNAMED_BY_DIFFUSERS.items():
        assert model_path(name) == path, name
    assert model_path("lora_transformer_transformer_blocks_23_attn_to_q") is None  # SD3.5's 24th block: no table has it


def test_the_kohya_export_names_every_sd_module_by_the_name_it_is_read_from() -> None:
    """kohya_name of each SD table module's path is its kohya name (SDXL's `text_projection` outside `text_model`)."""
    for family in ("sd1.5", "sdxl"):
        modules = [m for m in VOCABULARIES[family]() if m.path is not None]
        named = kohya_names([str(m.path) for m in modules])
        wrong = [(m.path, named[str(m.path)]) for m in modules if named[str(m.path)] != m.name]
        assert not wrong, wrong
