"""diffusers' LoRA layouts (current and 2023 attn-procs, written and loaded by diffusers itself), hand-converted names,
cloneofsimo's lora_diffusion files, and the refusal of low-rank pairs that no reader claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import CLI
from tests.diffusers_models import (
    attn_procs_state_dict,
    fused_deltas,
    fused_flux_deltas,
    write_attn_procs_lora,
    write_current_lora,
    write_flux_lora,
)
from tests.factories import write_kohya_file
from webapp import create_app
from zoo.formats import AdapterData, read_adapter
from zoo.store.models import Adapter
from zoo.store.session import session_factory


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A current-layout file with alpha 2·rank (scale 2), one with alpha = rank, and that one's update as 2023 attn-procs
    files: a .safetensors with `unet.` and `text_encoder.` keys, and a UNet-only .bin without the prefix."""
    root = tmp_path_factory.mktemp("diffusers")
    scaled = write_current_lora(root / "scaled", seed=1, rank=4, alpha=8.0)
    plain = write_current_lora(root / "plain", seed=2, rank=4, alpha=4.0)
    current = load_file(str(plain))
    return {
        "current": scaled,
        "current-alpha-rank": plain,
        "attn-procs": write_attn_procs_lora(root / "attn_procs.safetensors", current),
        "attn-procs-unet": write_attn_procs_lora(
            root / "pytorch_lora_weights.bin", {k: v for k, v in current.items() if k.startswith("unet.")}, False
        ),
    }


def assert_reads_what_diffusers_fuses(data: AdapterData, path: Path) -> None:
    """Every module's scale·B·A is the delta diffusers applies when it loads and fuses the file, to 1e-5 relative."""
    deltas = fused_deltas(path)
    assert {m.name for m in data.modules} == set(deltas)
    for m in data.modules:
        dw = m.scale * m.B.double() @ m.A.double()
        assert torch.linalg.norm(dw - deltas[m.name]) <= 1e-5 * torch.linalg.norm(deltas[m.name]), m.name


@pytest.mark.parametrize("name", ["current", "attn-procs", "attn-procs-unet"])
def test_each_layout_reads_the_delta_diffusers_applies(files: dict[str, Path], name: str) -> None:
    data = read_adapter(files[name])
    assert data.format == "diffusers" and data.config["layout"] == name.removesuffix("-unet")
    assert {m.name.split(".")[0] for m in data.modules} == ({"unet"} if name == "attn-procs-unet" else {"unet", "text_encoder"})
    assert {m.scale for m in data.modules} == ({2.0} if name == "current" else {1.0})  # lora_alpha / r from the metadata
    assert_reads_what_diffusers_fuses(data, files[name])


@pytest.mark.parametrize("alpha", [2.0, None])
def test_a_flux_transformer_file_reads_the_delta_diffusers_applies(tmp_path: Path, alpha: float | None) -> None:
    """`transformer.` keys, with `.alpha` tensors (diffusers' Flux loader applies them as network alphas) or without."""
    path = write_flux_lora(tmp_path, seed=3, rank=4, alpha=alpha)
    data = read_adapter(path)
    assert data.format == "diffusers" and {m.scale for m in data.modules} == {0.5 if alpha else 1.0}
    deltas = fused_flux_deltas(path)
    assert {m.name for m in data.modules} == set(deltas) and all(m.name.startswith("transformer.") for m in data.modules)
    for m in data.modules:
        assert torch.linalg.norm(m.scale * m.B.double() @ m.A.double() - deltas[m.name]) <= 1e-5 * torch.linalg.norm(deltas[m.name])


def test_attn_procs_and_current_layouts_of_one_update_are_one_adapter(files: dict[str, Path], cli: CLI) -> None:
    rc, rows = cli.json_lines("ingest", "--no-embed", str(files["current-alpha-rank"]), str(files["attn-procs"]))
    assert rc == 0 and [r["status"] for r in rows] == ["ingested", "duplicate"]
    assert rows[0]["canonical_hash"] == rows[1]["canonical_hash"]


def test_hand_converted_names_read_like_their_layout(files: dict[str, Path], tmp_path: Path) -> None:
    """`<name>_lora_down.weight`: a dotted diffusers name reads as the current layout's module, a kohya name as kohya."""
    old = attn_procs_state_dict(load_file(str(files["current-alpha-rank"])))
    hand = {k.replace("_lora.down.weight", "_lora_down.weight").replace("_lora.up.weight", "_lora_up.weight"): v for k, v in old.items()}
    save_file(hand, str(tmp_path / "hand.safetensors"))
    data, reference = read_adapter(tmp_path / "hand.safetensors"), read_adapter(files["current-alpha-rank"])
    assert (data.format, data.config["layout"]) == ("diffusers", "hand-converted")
    assert [(m.name, m.scale) for m in data.modules] == [(m.name, m.scale) for m in reference.modules]
    assert all(torch.equal(m.A, r.A) and torch.equal(m.B, r.B) for m, r in zip(data.modules, reference.modules, strict=True))

    kohya = write_kohya_file(tmp_path / "k.safetensors", conv=False)
    renamed = {k.replace(".lora_down.", "_lora_down.").replace(".lora_up.", "_lora_up."): v for k, v in kohya.items()}
    save_file(renamed, str(tmp_path / "k_hand.safetensors"))
    hand_kohya, plain_kohya = read_adapter(tmp_path / "k_hand.safetensors"), read_adapter(tmp_path / "k.safetensors")
    assert hand_kohya.format == "kohya"
    assert sorted((m.name, m.scale) for m in hand_kohya.modules) == sorted((m.name, m.scale) for m in plain_kohya.modules)


def write_lora_diffusion_file(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A file in lora_diffusion's published `save_safeloras_with_embeds` convention: `<model>:<i>:up` / `:down`, the
    injected classes and each rank in the metadata, and a textual-inversion token."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "unet:0:down": torch.randn(2, 32, generator=g),
        "unet:0:up": torch.randn(32, 2, generator=g),
        "unet:1:down": torch.randn(2, 8, 3, 3, generator=g),  # a conv layer
        "unet:1:up": torch.randn(16, 2, 1, 1, generator=g),
        "text_encoder:0:down": torch.randn(2, 24, generator=g),
        "text_encoder:0:up": torch.randn(24, 2, generator=g),
        "<s1>": torch.randn(24, generator=g),
    }
    metadata = {
        "unet": json.dumps(["CrossAttention", "Attention", "GEGLU"]),
        "text_encoder": json.dumps(["CLIPAttention"]),
        "<s1>": "<embed>",
    }
    metadata |= {f"{k.rsplit(':', 1)[0]}:rank": "2" for k in tensors if k.endswith(":down")}
    save_file(tensors, str(path), metadata)
    return tensors


def test_cloneofsimo_lora_diffusion_file(tmp_path: Path) -> None:
    tensors = write_lora_diffusion_file(tmp_path / "lora.safetensors")
    data = read_adapter(tmp_path / "lora.safetensors")
    assert data.format == "cloneofsimo"
    assert data.config["target_modules"] == {"text_encoder": ["CLIPAttention"], "unet": ["CrossAttention", "Attention", "GEGLU"]}
    assert data.config["embeddings"] == ["<s1>"] and data.extra_tensors == {"<s1>": [24]}
    by_name = {m.name: m for m in data.modules}
    assert sorted(by_name) == ["text_encoder:0", "unet:0", "unet:1"] and by_name["unet:1"].kind == "conv"
    for name, m in by_name.items():
        expected = tensors[f"{name}:up"].flatten(1) @ tensors[f"{name}:down"].flatten(1)
        assert m.scale == 1.0 and torch.allclose(m.B @ m.A, expected)


def test_low_rank_pairs_no_reader_claims_are_refused_and_nothing_is_stored(tmp_path: Path, cli: CLI) -> None:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "unknown.safetensors"
    tensors = {
        f"blocks.{i}.attn.q.{w}": torch.randn(*shape, generator=g) for i in range(2) for w, shape in (("down", (4, 64)), ("up", (64, 4)))
    }
    save_file(tensors, str(path))
    rc, out, err = cli("ingest", "--no-embed", str(path))
    assert rc != 0
    assert "2 low-rank factor pairs" in out + err and "blocks.0.attn.q.down [4, 64] / blocks.0.attn.q.up [64, 4]" in out + err
    assert "refused rather than stored as a full checkpoint" in out + err
    with session_factory(cli.settings.database_url)() as s:
        assert s.query(Adapter).count() == 0
    # a full checkpoint whose names happen to hold factor words is still one
    save_file(
        {"down_blocks.0.proj.weight": torch.randn(32, 32), "up_blocks.0.proj.weight": torch.randn(32, 32)}, str(tmp_path / "ck.safetensors")
    )
    assert read_adapter(tmp_path / "ck.safetensors").format == "checkpoint"
    # nor is an MLP whose down and up projections compose like factors (a partial fine-tune of a Llama-style block)
    mlp = {"layers.0.mlp.down_proj.weight": torch.randn(16, 64), "layers.0.mlp.up_proj.weight": torch.randn(64, 16)}
    save_file(mlp, str(tmp_path / "mlp.safetensors"))
    assert read_adapter(tmp_path / "mlp.safetensors").format == "checkpoint"


def test_a_diffusers_adapter_page_offers_its_downloads(files: dict[str, Path], cli: CLI) -> None:
    assert cli("ingest", "--no-embed", str(files["current"]))[0] == 0
    app = create_app({"ZOO_DATABASE_URL": cli.settings.database_url, "ZOO_DATA_DIR": str(cli.settings.data_dir), "TESTING": True})
    page = app.test_client().get("/adapters/1").get_data(as_text=True)
    assert " · diffusers" in page and "format=diffusers" in page and "format=peft" in page


def test_a_kohya_export_of_a_diffusers_lora_reingests_as_its_duplicate(files: dict[str, Path], cli: CLI, tmp_path: Path) -> None:
    """kohya's underscore names are read as the model's module paths: the kohya export of a diffusers file is the same
    adapter (its canonical hash), module by module, and each module's dW is what diffusers fuses from the kohya file."""
    rc, [original] = cli.json_lines("ingest", "--no-embed", str(files["current"]))
    assert rc == 0 and original["status"] == "ingested", original
    out = tmp_path / "kohya.safetensors"
    rc, [exported] = cli.json_lines("export", str(original["adapter_id"]), "--format", "kohya", "--out", str(out))
    assert rc == 0 and any(k.startswith("lora_unet_down_blocks_0_attentions_0_") for k in load_file(str(out))), exported
    rc, [again] = cli.json_lines("ingest", "--no-embed", str(out))
    assert rc == 0 and again["status"] == "duplicate" and again["canonical_hash"] == original["canonical_hash"], again

    data = read_adapter(out)
    assert data.format == "kohya" and {m.name for m in data.modules} == {m.name for m in read_adapter(files["current"]).modules}
    assert_reads_what_diffusers_fuses(data, out)
