"""kohya-layout DoRA (`dora_scale`) against the library that writes and applies it: lycoris-lora's LoCon with
`weight_decompose=True` on a tiny model (a file of LoCon modules only is read as format kohya). zoo's dW is LyCORIS's
update before the weight is renormalized (`get_diff_weight`); the magnitude is recorded, not applied, and enters as
docs/formats.md says: LyCORIS's merged weight is m ⊙ (W0 + dW) / ‖W0 + dW‖, the norm per output row (`wd_on_out`, its
default) or per input channel; the adapter is marked DoRA, noted, and its export refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.conftest import CLI
from tests.diffusers_models import fused_deltas, tiny_sd_pipeline
from tests.test_formats_lycoris import applied_delta, lycoris_file, relative_error
from zoo.formats import read_adapter
from zoo.store.models import Adapter
from zoo.store.session import session_factory

pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("LyCORIS").setLevel(logging.ERROR)


def documented_merge(W0: torch.Tensor, dW: torch.Tensor, m: torch.Tensor, on_out: bool) -> torch.Tensor:
    """docs/formats.md's W' = m ⊙ (W0 + dW) / ‖W0 + dW‖: the norm over everything but the output row (on_out), or
    over everything but the input channel; m broadcast as the file stores it ((out, 1, …) or (1, in, …))."""
    W = (W0 + dW).double()
    dims = tuple(d for d in range(W.dim()) if d != (0 if on_out else 1))
    return m.double() * W / torch.linalg.vector_norm(W, dim=dims, keepdim=True)


@pytest.mark.parametrize("wd_on_out", [True, False])
def test_a_lycoris_dora_locon_is_its_direction_update_with_the_magnitude_recorded(tmp_path: Path, wd_on_out: bool) -> None:
    path = tmp_path / "dora.safetensors"
    net = lycoris_file(path, "locon", lora_dim=2, alpha=1, weight_decompose=True, wd_on_out=wd_on_out)
    tensors = load_file(path)
    data = read_adapter(path)
    assert data.format == "kohya" and data.config["use_dora"] is True, data.config
    assert any("DoRA magnitude (dora_scale, recorded, not applied)" in n for n in data.notes), data.notes
    modules = {m.name: m for m in data.modules}
    assert sorted(modules) == sorted(lora.lora_name for lora in net.loras)
    for lora in net.loras:
        layer, m = lora.org_module[0], modules[lora.lora_name]
        magnitude = tensors[f"{lora.lora_name}.dora_scale"]
        assert data.extra_tensors[f"{lora.lora_name}.dora_scale"] == list(magnitude.shape)
        assert magnitude.shape[0 if wd_on_out else 1] == layer.weight.shape[0 if wd_on_out else 1] and magnitude.numel() == max(
            magnitude.shape
        )
        with torch.no_grad():
            dW = (m.scale * m.B @ m.A).reshape(layer.weight.shape)
            assert relative_error(dW.double(), lora.get_diff_weight()[0].reshape(dW.shape).double()) < 1e-6
            merged = lora.get_merged_weight()[0].double()
            assert relative_error(documented_merge(layer.weight, dW, magnitude, wd_on_out), merged) < 1e-5
            applied, ours = applied_delta(lora, (merged - layer.weight.double()).float())  # what the forward applies
            assert relative_error(ours, applied) < 1e-4
            assert relative_error(applied_delta(lora, dW)[1], applied) > 1e-2  # dW alone is not: the magnitude matters
        assert isinstance(layer, nn.Conv2d) or m.kind == "linear"


def test_a_kohya_dora_file_is_stored_marked_and_not_exported(cli: CLI, tmp_path: Path) -> None:
    """Ingested, it says the magnitude is not applied; `zoo export` refuses it (a LoRA file of dW alone would apply
    another update) in every format."""
    path = tmp_path / "dora.safetensors"
    lycoris_file(path, "locon", lora_dim=2, alpha=1, weight_decompose=True)
    rc, (row,) = cli.json_lines("ingest", "--no-embed", str(path), "--base-model", "tiny")
    assert rc == 0 and row["status"] == "ingested" and any("DoRA magnitude" in n for n in row["notes"]), row
    for fmt in ("kohya", "diffusers", "peft"):
        rc, _, err = cli("export", str(row["adapter_id"]), "--format", fmt, "--out", str(tmp_path / f"out-{fmt}"))
        assert rc != 0 and "is a DoRA adapter" in err, (fmt, err)
    # stored before kohya files were marked DoRA (no use_dora in its config): its recorded dora_scale tensors say it
    with session_factory(cli.settings.database_url).begin() as session:
        adapter = session.get_one(Adapter, row["adapter_id"])
        adapter.config = {k: v for k, v in adapter.config.items() if k != "use_dora"}
    rc, _, err = cli("export", str(row["adapter_id"]), "--format", "kohya", "--out", str(tmp_path / "out-before"))
    assert rc != 0 and "is a DoRA adapter" in err, err


def test_diffusers_drops_a_kohya_dora_scale_and_applies_the_dw_zoo_stores(tmp_path: Path) -> None:
    """diffusers' `load_lora_weights` filters `dora_scale` out (with a warning) and fuses s·B·A: zoo's dW exactly, not the
    renormalized weight LyCORIS applies from the same file."""
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    W0 = tiny_sd_pipeline(0).unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight.detach()
    gen = torch.Generator().manual_seed(0)
    down, up = torch.randn(2, W0.shape[1], generator=gen) * 0.3, torch.randn(W0.shape[0], 2, generator=gen) * 0.3
    magnitude = W0.norm(dim=1, keepdim=True) * (1 + 0.2 * torch.randn(W0.shape[0], 1, generator=gen))  # (out, 1), as LyCORIS
    path = tmp_path / "dora.safetensors"
    tensors = {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(1.0)}
    save_file({**tensors, f"{stem}.dora_scale": magnitude}, str(path))
    (m,) = read_adapter(path).modules
    dW = (m.scale * m.B @ m.A).double()
    fused = fused_deltas(path)["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"]
    assert relative_error(fused, dW) < 1e-6
    renormalized = documented_merge(W0, dW.float(), magnitude, True) - W0.double()
    assert relative_error(fused, renormalized) > 0.1
