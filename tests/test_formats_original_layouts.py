"""LoRAs in the models' original layouts: SDXL's SGM UNet names (kohya-ss's SDXL training, A1111), Flux's Black Forest
Labs names (kohya-ss's Flux LoRAs) and XLabs' Flux processors; each read as diffusers converts or fuses it, and its base
model guessed from its names and shapes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import StableDiffusionXLPipeline
from safetensors.torch import load_file, save_file

from tests.conftest import CLI
from tests.diffusers_models import fused_flux_deltas
from zoo.domain.base_models import guess_base_model
from zoo.domain.model_shapes import VOCABULARIES
from zoo.formats import read_adapter
from zoo.formats.diffusers import module_name


def _pair(out: int, fan_in: int, gen: torch.Generator, rank: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, fan_in, generator=gen), torch.randn(out, rank, generator=gen) * 0.1


def test_sgm_names_of_an_sdxl_lora_read_as_diffusers_converts_them_and_guess_sdxl(tmp_path: Path) -> None:
    """`lora_unet_input_blocks_4_1_…`, `middle_block_`, `output_blocks_`: attention, resnet convs, shortcuts, samplers."""
    modules = [m for m in VOCABULARIES["sdxl"]() if m.aliases]
    kinds = [m for m in modules if m.path and ("samplers" in m.path or "shortcut" in m.path or "mid_block.resnets" in m.path)]
    picked = list({m.name: m for m in modules[::23] + kinds}.values())
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for m in picked:
        down, up = _pair(m.out, m.fan_in, gen)
        stem = m.aliases[0]
        tensors |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(1.0)}
    path = tmp_path / "sgm.safetensors"
    save_file(tensors, str(path))

    # diffusers' own conversion of the SGM names (SDXL's UNet: two layers a block)
    converted, _ = StableDiffusionXLPipeline.lora_state_dict(dict(tensors), unet_config=SimpleNamespace(layers_per_block=2))
    stems = [k.removesuffix("_lora.down.weight").removesuffix(".lora.down.weight") for k in converted if k.endswith("down.weight")]
    data = read_adapter(path)
    assert data.format == "kohya" and sorted(m.name for m in data.modules) == sorted(module_name(s, "attn-procs") for s in stems)
    by_name = {m.name: m for m in data.modules}
    for m in picked:
        got = by_name[str(m.path)]
        stem = m.aliases[0]
        assert torch.equal(got.B @ got.A, tensors[f"{stem}.lora_up.weight"] @ tensors[f"{stem}.lora_down.weight"])
    guess = guess_base_model([(m.name, *m.shape) for m in data.modules])
    assert guess.families == ("sdxl",) and guess.matched == len(picked)


def test_flux_bfl_names_guess_flux() -> None:
    """kohya-ss's Flux names (`lora_unet_double_blocks_0_img_attn_qkv`, fused q·k·v) and `diffusion_model.` ones."""
    shapes = [("double_blocks.0.img_attn.qkv", 9216, 3072), ("double_blocks.0.txt_mlp.2", 3072, 12288)]
    shapes.append(("single_blocks.3.linear1", 21504, 3072))
    kohya = [("lora_unet_" + n.replace(".", "_"), o, i) for n, o, i in shapes]
    for named in (kohya, [("diffusion_model." + n, o, i) for n, o, i in shapes]):
        assert guess_base_model(named).families == ("flux.1",), named
    assert not guess_base_model([("lora_unet_double_blocks_0_img_attn_qkv", 3072, 3072)]).known  # not the fused shape


def write_xlabs_lora(path: Path, width: int = 32, rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """An XLabs (x-flux) LoRA of the tiny Flux transformer (tests/diffusers_models.py: one double and one single
    block, 32 wide, MLP 4·32): its processors' qkv/proj LoRA layers."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    layers = {
        "double_blocks.0.processor.qkv_lora1": (3 * width, width),
        "double_blocks.0.processor.proj_lora1": (width, width),
        "double_blocks.0.processor.qkv_lora2": (3 * width, width),
        "double_blocks.0.processor.proj_lora2": (width, width),
        "single_blocks.0.processor.qkv_lora": (3 * width, width),
        "single_blocks.0.processor.proj_lora": (width, 5 * width),
    }
    for stem, (out, fan_in) in layers.items():
        down, up = _pair(out, fan_in, gen, rank)
        tensors |= {f"{stem}.down.weight": down, f"{stem}.up.weight": up}
    save_file(tensors, str(path))
    return tensors


def test_an_xlabs_flux_lora_reads_the_delta_diffusers_fuses(tmp_path: Path) -> None:
    """Each fused q·k·v module is the rows of what diffusers fuses into to_q, to_k, to_v (add_*_proj for the text
    stream; a single block's q, k, v rows of linear1, its MLP rows untouched)."""
    path = tmp_path / "xlabs.safetensors"
    write_xlabs_lora(path)
    data = read_adapter(path)
    assert data.format == "xlabs" and {m.scale for m in data.modules} == {1.0}
    dw = {m.name: m.scale * m.B.double() @ m.A.double() for m in data.modules}
    fused = fused_flux_deltas(path)
    double, single = "transformer.transformer_blocks.0.", "transformer.single_transformer_blocks.0."
    want = {
        "double_blocks.0.img_attn.qkv": torch.cat([fused[f"{double}attn.to_{p}"] for p in "qkv"]),
        "double_blocks.0.img_attn.proj": fused[f"{double}attn.to_out.0"],
        "double_blocks.0.txt_attn.qkv": torch.cat([fused[f"{double}attn.add_{p}_proj"] for p in "qkv"]),
        "double_blocks.0.txt_attn.proj": fused[f"{double}attn.to_add_out"],
        "single_blocks.0.linear1": torch.cat(
            [*(fused[f"{single}attn.to_{p}"] for p in "qkv"), torch.zeros(4 * 32, 32, dtype=torch.float64)]
        ),
        "single_blocks.0.linear2": fused[f"{single}proj_out"],
    }
    assert set(dw) == set(want) and len(fused) == 12
    for name, delta in want.items():
        assert torch.linalg.norm(dw[name] - delta) <= 1e-5 * torch.linalg.norm(delta), name


def test_a_kohya_flux_lora_names_its_modules_as_xlabs_does(tmp_path: Path) -> None:
    """kohya-ss's Flux names (`lora_unet_double_blocks_0_img_attn_qkv`) are read as Flux's module paths: the same update
    in kohya's and XLabs' layouts has the same modules, and is what diffusers fuses from the kohya file."""
    xlabs = write_xlabs_lora(tmp_path / "xlabs.safetensors")
    kohya = {}
    for stream, n in (("img", "1"), ("txt", "2")):
        for layer in ("qkv", "proj"):
            stem = f"lora_unet_double_blocks_0_{stream}_attn_{layer}"
            down, up = (
                xlabs[f"double_blocks.0.processor.{layer}_lora{n}.down.weight"],
                xlabs[f"double_blocks.0.processor.{layer}_lora{n}.up.weight"],
            )
            kohya |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(float(down.shape[0]))}
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    data, reference = read_adapter(tmp_path / "kohya.safetensors"), read_adapter(tmp_path / "xlabs.safetensors")
    want = {m.name: m.scale * m.B.double() @ m.A.double() for m in reference.modules if m.name.startswith("double_blocks.")}
    got = {m.name: m.scale * m.B.double() @ m.A.double() for m in data.modules}
    assert data.format == "kohya" and set(got) == set(want) and all(torch.allclose(got[n], want[n]) for n in want)
    fused = fused_flux_deltas(tmp_path / "kohya.safetensors")
    attn = "transformer.transformer_blocks.0.attn."
    assert torch.allclose(got["double_blocks.0.img_attn.qkv"], torch.cat([fused[f"{attn}to_{p}"] for p in "qkv"]), atol=1e-6)
    assert torch.allclose(got["double_blocks.0.txt_attn.proj"], fused[f"{attn}to_add_out"], atol=1e-6)


def test_a_bfl_flux_lora_in_peft_style_names_its_modules_as_xlabs_does(tmp_path: Path) -> None:
    """`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`: Flux's own names without the prefix, one fused
    q·k·v module, the same modules and dW as the XLabs file of the same update."""
    xlabs = write_xlabs_lora(tmp_path / "xlabs.safetensors")
    layers = {"qkv_lora1": "img_attn.qkv", "proj_lora1": "img_attn.proj", "qkv_lora2": "txt_attn.qkv", "proj_lora2": "txt_attn.proj"}
    bfl = {}
    for old, new in layers.items():
        stem = f"diffusion_model.double_blocks.0.{new}"
        bfl |= {f"{stem}.lora_A.weight": xlabs[f"double_blocks.0.processor.{old}.down.weight"]}
        bfl |= {f"{stem}.lora_B.weight": xlabs[f"double_blocks.0.processor.{old}.up.weight"]}
    save_file(bfl, str(tmp_path / "bfl.safetensors"))
    data, reference = read_adapter(tmp_path / "bfl.safetensors"), read_adapter(tmp_path / "xlabs.safetensors")
    want = {m.name: m.scale * m.B @ m.A for m in reference.modules if m.name.startswith("double_blocks.")}
    got = {m.name: m.scale * m.B @ m.A for m in data.modules}
    assert set(got) == set(want) and all(torch.allclose(got[n], want[n]) for n in want)


def test_the_kohya_export_of_an_xlabs_flux_lora_is_kohya_ss_flux_and_reingests_as_it(cli: CLI, tmp_path: Path) -> None:
    """Flux's own module names export under kohya-ss's Flux names (which diffusers loads: the test above), and the
    export ingests as the adapter it came from (a duplicate). diffusers' kohya Flux conversion splits linear1 at
    Flux.1's real widths, so it cannot load this tiny one's single block."""
    write_xlabs_lora(tmp_path / "xlabs.safetensors")
    rc, [original] = cli.json_lines("ingest", "--no-embed", str(tmp_path / "xlabs.safetensors"), "--base-model", "flux-dev")
    assert rc == 0 and original["status"] == "ingested", original
    out = tmp_path / "kohya.safetensors"
    rc, [exported] = cli.json_lines("export", str(original["adapter_id"]), "--format", "kohya", "--out", str(out))
    assert rc == 0 and not exported["notes"], exported
    assert {k.split(".")[0] for k in load_file(str(out))} >= {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"}
    rc, [again] = cli.json_lines("ingest", "--no-embed", str(out), "--base-model", "flux-dev")
    assert rc == 0 and again["status"] == "duplicate" and again["canonical_hash"] == original["canonical_hash"], again
