"""PEFT LoRA on Conv1d, Conv2d and Conv3d layers: read, flattened to out × in·k..., equal to PEFT's own delta
weights; grouped convolutions (whose LoRA PEFT cannot merge) refused by name."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from torch import nn

from tests.test_formats import assert_matches_peft
from zoo.errors import InputError
from zoo.formats import read_adapter


class ConvNets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 8, 5, padding=2)
        self.c2 = nn.Conv2d(3, 6, (3, 2), stride=2)
        self.c3 = nn.Conv3d(2, 4, 3)
        self.pw = nn.Conv2d(6, 5, 1)
        self.grouped = nn.Conv2d(8, 16, 3, groups=4)


def test_conv1d_conv2d_conv3d_lora_match_peft(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = get_peft_model(ConvNets(), LoraConfig(r=3, lora_alpha=6, target_modules=["c1", "c2", "c3", "pw"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "a"))
    assert_matches_peft(tmp_path / "a", model)  # dW of every module equals PEFT's get_delta_weight, flattened
    shapes = {m.name: (m.kind, m.shape, m.rank) for m in read_adapter(tmp_path / "a").modules}
    assert shapes == {"c1": ("conv", (8, 15), 3), "c2": ("conv", (6, 18), 3), "c3": ("conv", (4, 54), 3), "pw": ("conv", (5, 6), 3)}


def test_grouped_conv_lora_is_refused_by_name(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns that it cannot merge LoRA into a grouped conv
        model = get_peft_model(ConvNets(), LoraConfig(r=4, target_modules=["grouped"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "g"))
    reason = r"grouped: LoRA on a grouped convolution \(B's kernel \[16, 1, 1, 1\] has 1 input channel for rank 4\) is not supported"
    with pytest.raises(InputError, match=reason):
        read_adapter(tmp_path / "g")


def test_conv1d_checkpoint_delta_is_a_conv_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = {"c1.weight": torch.randn(8, 3, 5), "c1.bias": torch.randn(8)}
    tuned = {"c1.weight": base["c1.weight"] + (torch.randn(8, 1) @ torch.randn(1, 15)).reshape(8, 3, 5), "c1.bias": base["c1.bias"]}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    (m,) = read_adapter(tmp_path / "tuned.safetensors", base=tmp_path / "base.safetensors").modules
    assert m.kind == "conv" and m.shape == (8, 15) and m.rank == 1
    delta = (m.scale * m.B @ m.A).reshape(8, 3, 5)
    assert torch.allclose(delta, tuned["c1.weight"] - base["c1.weight"], atol=1e-5)


def test_tucker_locon_update_is_its_three_convs(tmp_path: Path) -> None:
    """LyCORIS LoCon's Tucker form (1×1 down, kh×kw mid, 1×1 up) is read as the update its three convolutions apply."""
    torch.manual_seed(0)
    down, mid, up = torch.randn(4, 6, 1, 1), torch.randn(4, 4, 3, 3), torch.randn(5, 4, 1, 1)
    stem = "lora_unet_down_blocks_0_resnets_0_conv1"
    tensors = {f"{stem}.lora_down.weight": down, f"{stem}.lora_mid.weight": mid, f"{stem}.lora_up.weight": up}
    tensors[f"{stem}.alpha"] = torch.tensor(2.0)
    save_file(tensors, str(tmp_path / "tucker.safetensors"))
    (m,) = read_adapter(tmp_path / "tucker.safetensors").modules
    assert (m.kind, m.shape, m.rank, m.scale) == ("conv", (5, 54), 4, 0.5)
    x = torch.randn(2, 6, 9, 9)
    three_convs = nn.functional.conv2d(nn.functional.conv2d(nn.functional.conv2d(x, down), mid, padding=1), up)
    one_conv = nn.functional.conv2d(x, (m.B.float() @ m.A.float()).reshape(5, 6, 3, 3), padding=1)
    assert torch.allclose(one_conv, three_convs, atol=1e-4)


def test_tucker_locon_with_mismatched_mid_is_refused(tmp_path: Path) -> None:
    stem = "lora_unet_conv_in"
    tensors = {f"{stem}.lora_down.weight": torch.randn(4, 6, 1, 1), f"{stem}.lora_mid.weight": torch.randn(3, 4, 3, 3)}
    tensors[f"{stem}.lora_up.weight"] = torch.randn(5, 4, 1, 1)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    reason = r"bad.safetensors.*shape mismatch in lora_unet_conv_in: lora_down \[4, 6, 1, 1\], lora_mid \[3, 4, 3, 3\]"
    with pytest.raises(InputError, match=reason):
        read_adapter(tmp_path / "bad.safetensors")
