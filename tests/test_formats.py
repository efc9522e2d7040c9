"""Reading real PEFT adapters, kohya files and checkpoints; refusing bad input by name and reason."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
from pathlib import Path

import pytest
import torch
from peft import AdaLoraConfig, IA3Config, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from tests.factories import VOCAB, TinyLM, train_peft_adapter, write_kohya_file
from zoo.domain.canonical import canonicalize
from zoo.domain.kohya_names import kohya_name
from zoo.errors import InputError
from zoo.formats import read_adapter
from zoo.formats.records import layer_index, module_type


def peft_deltas(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own get_delta_weight for every LoRA layer, keyed like our module names."""
    out = {}
    for name, mod in peft_model.named_modules():
        has_lora = "default" in getattr(mod, "lora_A", {}) or "default" in getattr(mod, "lora_embedding_A", {})
        if has_lora and hasattr(mod, "get_delta_weight"):
            out[name.removeprefix("base_model.model.")] = mod.get_delta_weight("default").detach()
    return out


def assert_matches_peft(path: Path, peft_model: nn.Module) -> None:
    data = read_adapter(path)
    expected = peft_deltas(peft_model)
    assert sorted(m.name for m in data.modules) == sorted(expected)
    for m in data.modules:
        got = canonicalize(m.A, m.B, m.scale).delta()
        ref = expected[m.name].reshape(got.shape)
        assert torch.allclose(got, ref, atol=1e-5 * max(1.0, float(ref.abs().max()))), m.name


def test_peft_linear_adapter_matches_peft_delta(tmp_path: Path) -> None:
    model = train_peft_adapter(tmp_path / "a", targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert_matches_peft(tmp_path / "a", model)
    data = read_adapter(tmp_path / "a")
    assert data.format == "peft"
    assert data.config["r"] == 4 and data.config["lora_alpha"] == 8
    assert {m.scale for m in data.modules} == {2.0}
    assert sorted(data.config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_peft_conv1d_fan_in_fan_out_and_embedding(tmp_path: Path) -> None:
    model = train_peft_adapter(tmp_path / "gpt2", targets=("c_fc", "c_proj"), fan_in_fan_out=True)
    assert_matches_peft(tmp_path / "gpt2", model)
    assert all(m.transposed for m in read_adapter(tmp_path / "gpt2").modules)
    model = train_peft_adapter(tmp_path / "emb", targets=("embed",))
    assert_matches_peft(tmp_path / "emb", model)
    (m,) = read_adapter(tmp_path / "emb").modules
    assert m.kind == "embedding" and m.shape == (24, 16)


def test_peft_rslora_and_patterns(tmp_path: Path) -> None:
    model = train_peft_adapter(
        tmp_path / "p",
        targets=("q_proj", "v_proj"),
        r=8,
        lora_alpha=16,
        use_rslora=True,
        rank_pattern={"layers.1.q_proj": 2},
        alpha_pattern={"v_proj": 4},
    )
    assert_matches_peft(tmp_path / "p", model)
    mods = {m.name: m for m in read_adapter(tmp_path / "p").modules}
    assert mods["layers.1.q_proj"].rank == 2
    assert mods["layers.0.q_proj"].scale == pytest.approx(16 / math.sqrt(8))
    assert mods["layers.0.v_proj"].scale == pytest.approx(4 / math.sqrt(8))


def test_peft_dora_and_modules_to_save_are_recorded(tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "d", use_dora=True, modules_to_save=["head"])
    data = read_adapter(tmp_path / "d")
    assert data.config["use_dora"] is True
    assert any(k.endswith("lora_magnitude_vector") for k in data.extra_tensors)
    assert "head.weight" in data.extra_tensors
    assert len(data.modules) == 4


def test_peft_conv2d(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

    model = get_peft_model(ConvNet(), LoraConfig(r=2, target_modules=["conv"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "c"))
    assert_matches_peft(tmp_path / "c", model)
    (m,) = read_adapter(tmp_path / "c").modules
    assert m.kind == "conv" and m.shape == (8, 27)


def test_peft_bin_weights_only_equals_safetensors(tmp_path: Path) -> None:
    model = train_peft_adapter(tmp_path / "st")
    model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").exists()
    a, b = read_adapter(tmp_path / "st"), read_adapter(tmp_path / "bin")
    for x, y in zip(a.modules, b.modules, strict=True):
        assert x.name == y.name and torch.equal(x.A, y.A) and torch.equal(x.B, y.B)


def test_peft_files_can_be_named_directly(tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a")
    assert read_adapter(tmp_path / "a" / "adapter_model.safetensors").path == tmp_path / "a"


def test_kohya_file(tmp_path: Path) -> None:
    path = tmp_path / "style.safetensors"
    tensors = write_kohya_file(path, rank=4, alpha=2.0, metadata={"ss_network_dim": "4", "ss_sd_model_name": "sd-v1-5"})
    data = read_adapter(path)
    assert data.format == "kohya"
    assert data.base_model == "sd-v1-5"
    assert data.metadata["ss_network_dim"] == "4"
    mods = {m.name: m for m in data.modules}  # kohya's names, read as the UNet's module paths
    conv = mods["unet.down_blocks.1.resnets.0.conv1"]
    assert conv.kind == "conv" and conv.shape == (12, 72) and conv.scale == pytest.approx(0.5)
    lin = mods["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"]
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    expected = 0.5 * tensors[f"{stem}.lora_up.weight"].float() @ tensors[f"{stem}.lora_down.weight"].float()
    assert torch.allclose(canonicalize(lin.A, lin.B, lin.scale).delta(), expected, atol=1e-4)
    assert layer_index(lin.name) == 0 and module_type(lin.name) == "to_q"


@pytest.mark.parametrize("alpha", [None, 0.0])
def test_kohya_missing_or_zero_alpha_means_alpha_equals_rank(tmp_path: Path, alpha: float | None) -> None:
    path = tmp_path / "k.safetensors"
    write_kohya_file(path, rank=4, alpha=alpha)
    assert {m.scale for m in read_adapter(path).modules} == {1.0}


def test_diffusers_dotted_keys(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "d.safetensors"
    save_file(
        {
            "unet.mid_block.attentions.0.to_k.lora.down.weight": torch.randn(4, 20, generator=g),
            "unet.mid_block.attentions.0.to_k.lora.up.weight": torch.randn(30, 4, generator=g),
        },
        str(path),
    )
    (m,) = read_adapter(path).modules
    assert m.shape == (30, 20) and m.scale == 1.0 and m.name == "unet.mid_block.attentions.0.to_k"


@pytest.mark.parametrize("key,missing", [("hada_w1_a", "hada_w1_b, hada_w2_a, hada_w2_b"), ("lokr_w1", "lokr_w2_a, lokr_w2_b")])
def test_incomplete_lycoris_module_is_refused_by_name(tmp_path: Path, key: str, missing: str) -> None:
    """LyCORIS files are read (tests/test_formats_lycoris.py); a module short of its factors is refused, naming them."""
    path = tmp_path / "ly.safetensors"
    save_file({f"lora_unet_mid_block_attentions_0_proj_in.{key}": torch.randn(4, 8)}, str(path))
    with pytest.raises(InputError, match=f"proj_in: {missing} missing") as exc:
        read_adapter(path)
    assert str(path) in str(exc.value)


def test_checkpoint_with_base_becomes_low_rank_delta(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = {"layer.weight": torch.randn(64, 48, generator=g), "layer.bias": torch.randn(64, generator=g)}
    low = torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g)
    tuned = {"layer.weight": base["layer.weight"] + low + 1e-4 * torch.randn(64, 48, generator=g), "layer.bias": base["layer.bias"]}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    data = read_adapter(tmp_path / "tuned.safetensors", base=tmp_path / "base.safetensors", energy=0.99)
    assert data.format == "checkpoint-delta"
    (m,) = data.modules
    assert m.rank == 3
    rec = canonicalize(m.A, m.B, m.scale).delta()
    assert torch.linalg.norm(rec - low) / torch.linalg.norm(low) < 1e-3
    assert "99%" in data.notes[0] and "exact" in data.notes[0]


def test_checkpoint_without_base_keeps_full_matrices(tmp_path: Path) -> None:
    save_file({"w": torch.randn(40, 30), "b": torch.randn(40)}, str(tmp_path / "ck.safetensors"))
    data = read_adapter(tmp_path / "ck.safetensors")
    assert data.format == "checkpoint" and not data.modules
    assert [fm.name for fm in data.full_matrices] == ["w"]
    assert data.extra_tensors == {"b": [40]}


def test_checkpoint_shape_mismatch_with_base(tmp_path: Path) -> None:
    save_file({"w": torch.randn(40, 30)}, str(tmp_path / "base.safetensors"))
    save_file({"w": torch.randn(40, 31)}, str(tmp_path / "ck.safetensors"))
    with pytest.raises(InputError, match="shape mismatch for w"):
        read_adapter(tmp_path / "ck.safetensors", base=tmp_path / "base.safetensors")


# ---- bad input --------------------------------------------------------------------------


def _peft_dir(tmp_path: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4, **config}))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def test_truncated_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_kohya_file(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(InputError, match="truncated") as exc:
        read_adapter(path)
    assert str(path) in str(exc.value)
    path.write_bytes(data[:5])
    with pytest.raises(InputError, match="truncated"):
        read_adapter(path)


def test_oversized_header(tmp_path: Path) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    says = "not a safetensors file: its first 8 bytes give a header length of 1099511627776, more than its 10 bytes"
    with pytest.raises(InputError, match=says):
        read_adapter(path)


def test_corrupt_header(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{[")
    with pytest.raises(InputError, match="not a safetensors file: its 4-byte header is not JSON"):
        read_adapter(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{[\xff\xfe")  # a JSON header's start, then none
    with pytest.raises(InputError, match="corrupt safetensors header"):
        read_adapter(path)


def _safetensors(entries: list[tuple[str, str, list[int], bytes]], metadata: dict[str, str] | None = None, tail: bytes = b"") -> bytes:
    """A safetensors file written by hand (name, dtype, shape, bytes in order), so that offsets can be odd."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(raw for *_, raw in entries) + tail


def test_weights_are_read_once_hashed_and_viewed_in_place(tmp_path: Path) -> None:
    path = tmp_path / "k.safetensors"
    tensors = write_kohya_file(path)
    data = read_adapter(path)
    assert data.file_sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and data.size_bytes == path.stat().st_size
    for m in data.modules:
        assert torch.equal(m.A, tensors[f"{kohya_name(m.name, False)}.lora_down.weight"].reshape(m.A.shape[0], -1))
    # a tensor at an offset its element size does not divide (the format allows it) is read right
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(2, 5, generator=g), torch.randn(3, 2, generator=g)
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(_safetensors([("m.alpha", "F16", [], torch.tensor(2.0).half().numpy().tobytes()),
                                  ("m.lora_down.weight", "F32", [2, 5], down.numpy().tobytes()),
                                  ("m.lora_up.weight", "F32", [3, 2], up.numpy().tobytes())]))  # fmt: skip
    (m,) = read_adapter(odd).modules
    assert torch.equal(m.A, down) and torch.equal(m.B, up) and m.alpha == 2.0


@pytest.mark.parametrize(
    ("offsets", "tail", "reason"),
    [((0, 8), b"junk", "4 data bytes after the last tensor"), ((4, 12), b"", "4 data bytes at offset 0 belong to no tensor")],
)
def test_tensor_data_must_fill_the_file_exactly(tmp_path: Path, offsets: tuple[int, int], tail: bytes, reason: str) -> None:
    raw = torch.ones(2).numpy().tobytes()
    header = {"w.lora_down.weight": {"dtype": "F32", "shape": [1, 2], "data_offsets": list(offsets)}}
    text = json.dumps(header).encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + (b"\0" * offsets[0]) + raw + tail)
    with pytest.raises(InputError, match=reason) as exc:
        read_adapter(path)
    assert str(path) in str(exc.value)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_code_running_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    d = tmp_path / "evil"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    marker = tmp_path / "pwned"
    with open(d / "adapter_model.bin", "wb") as fh:
        pickle.dump({"x": _Exploit(marker)}, fh)
    with pytest.raises(InputError, match="not a weights-only torch file") as exc:
        read_adapter(d)
    assert "adapter_model.bin" in str(exc.value)
    assert not marker.exists()
    loose = tmp_path / "model.pt"
    loose.write_bytes((d / "adapter_model.bin").read_bytes())
    with pytest.raises(InputError, match="weights-only"):
        read_adapter(loose)
    assert not marker.exists()


def test_nan_weights(tmp_path: Path) -> None:
    A = torch.randn(4, 8)
    A[0, 0] = float("nan")
    d = _peft_dir(tmp_path, {"base_model.model.q.lora_A.weight": A, "base_model.model.q.lora_B.weight": torch.randn(6, 4)})
    with pytest.raises(InputError, match="q: factor A contains NaN or Inf"):
        read_adapter(d)


def test_shape_mismatch(tmp_path: Path) -> None:
    d = _peft_dir(tmp_path, {"base_model.model.q.lora_A.weight": torch.randn(4, 8), "base_model.model.q.lora_B.weight": torch.randn(6, 3)})
    with pytest.raises(InputError, match="shape mismatch in q"):
        read_adapter(d)


def test_missing_partner(tmp_path: Path) -> None:
    d = _peft_dir(tmp_path, {"base_model.model.q.lora_A.weight": torch.randn(4, 8)})
    with pytest.raises(InputError, match="q has lora_A but no lora_B"):
        read_adapter(d)


def test_a_single_file_lora_with_every_down_factor_missing_is_refused_not_read_as_a_checkpoint(tmp_path: Path) -> None:
    """With every `lora_down` renamed away, no reader claims the file: its lone `lora_up`s still say it is a LoRA."""
    path = tmp_path / "lora.safetensors"
    tensors = write_kohya_file(path)
    save_file({(f"renamed_{i}" if "lora_down" in k else k): t for i, (k, t) in enumerate(tensors.items())}, str(path))
    with pytest.raises(
        InputError, match=r"3 tensors named as one factor of a low-rank pair, with no partner \(lora_unet_.*\.lora_up\.weight"
    ):
        read_adapter(path)
    # a checkpoint with a stray factor name among its weight matrices is still a checkpoint
    save_file({"proj.weight": torch.randn(8, 8), "mlp.weight": torch.randn(8, 8), "extra.lora_up.weight": torch.randn(8, 2)}, str(path))
    assert read_adapter(path).format == "checkpoint"


def test_empty_adapter(tmp_path: Path) -> None:
    d = _peft_dir(tmp_path, {"base_model.model.head.weight": torch.randn(3, 3)})
    with pytest.raises(InputError, match="empty adapter"):
        read_adapter(d)


def test_rank_disagreeing_with_config(tmp_path: Path) -> None:
    d = _peft_dir(tmp_path, {"base_model.model.q.lora_A.weight": torch.randn(2, 8), "base_model.model.q.lora_B.weight": torch.randn(6, 2)})
    with pytest.raises(InputError, match="rank mismatch in q"):
        read_adapter(d)


def test_unsupported_peft_type(tmp_path: Path) -> None:
    d = _peft_dir(tmp_path, {"x": torch.randn(2)}, peft_type="LOHA")
    with pytest.raises(InputError, match="unsupported PEFT type LOHA"):
        read_adapter(d)


def test_missing_path_and_wrong_things(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        read_adapter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="not an adapter directory"):
        read_adapter(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InputError, match="unsupported file type"):
        read_adapter(tmp_path / "notes.txt")


def test_base_model_of_tiny_model_is_unset(tmp_path: Path) -> None:
    TinyLM()
    train_peft_adapter(tmp_path / "a")
    assert read_adapter(tmp_path / "a").base_model is None


def test_training_checkpoints_are_read_as_the_state_dict_they_nest(tmp_path: Path) -> None:
    """PyTorch Lightning's checkpoint (`state_dict` beside optimizer states and counters), a training loop's
    `model_state_dict`, DeepSpeed's `module` with DDP's `module.` prefix on every name: each reads as its weights."""
    tensors = write_kohya_file(tmp_path / "plain.safetensors", conv=False)
    want = [(m.name, m.scale, m.A, m.B) for m in read_adapter(tmp_path / "plain.safetensors").modules]
    adam = {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(4, 32)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}
    checkpoints = {
        "lightning.ckpt.pt": {
            "epoch": 3,
            "global_step": 120,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": tensors,
            "optimizer_states": [adam],
            "lr_schedulers": [],
            "callbacks": {},
        },
        "loop.pt": {"model_state_dict": tensors, "optimizer_state_dict": adam, "epoch": 2},
        "deepspeed.bin": {"module": {f"module.{k}": v for k, v in tensors.items()}, "buffer_names": [], "dp_world_size": 1},
    }
    for name, checkpoint in checkpoints.items():
        torch.save(checkpoint, tmp_path / name)
        data = read_adapter(tmp_path / name)
        assert data.format == "kohya" and len(data.modules) == len(want), name
        for m, (n, scale, A, B) in zip(data.modules, want, strict=True):
            assert (m.name, m.scale) == (n, scale) and torch.equal(m.A, A) and torch.equal(m.B, B), name

    torch.save({"epoch": 1, "optimizer_states": [adam]}, tmp_path / "no-weights.pt")
    with pytest.raises(InputError, match=r"no-weights.pt.*expected a dict of tensors \(or a training checkpoint with one under state_dict"):
        read_adapter(tmp_path / "no-weights.pt")


def write_adalora_adapter(directory: Path, prune: bool) -> PeftModel:
    """An AdaLoRA adapter of TinyLM written by PEFT: random A, E, B (init_r 6), and with `prune` a few steps of
    AdaLoRA's own training that end by masking ranks (its rank_pattern: the saved factors keep fewer ranks)."""
    config = AdaLoraConfig(init_r=6, target_r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"], total_step=4, tinit=0, tfinal=1)
    model = get_peft_model(TinyLM(), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    if prune:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids, labels = torch.randint(0, VOCAB, (8, 6), generator=gen), torch.randint(0, 3, (8,), generator=gen)
        for step in range(4):
            torch.nn.functional.cross_entropy(model(ids), labels).backward()
            opt.step()
            model.base_model.update_and_allocate(step)
            opt.zero_grad()
    model.save_pretrained(str(directory))
    return model


@pytest.mark.parametrize("prune", [False, True])
def test_adalora_is_read_as_the_delta_peft_merges(tmp_path: Path, prune: bool) -> None:
    """dW = B·diag(E)·A · lora_alpha / (ranknum + 1e-5), ranknum = init_r, the ranks AdaLoRA kept: PEFT's own merge."""
    write_adalora_adapter(tmp_path / "ada", prune)
    saved = load_file(str(tmp_path / "ada" / "adapter_model.safetensors"))
    assert prune == any(t.shape[0] < 6 for k, t in saved.items() if k.endswith(".lora_A"))
    data = read_adapter(tmp_path / "ada")
    assert data.config["peft_type"] == "ADALORA"
    base = TinyLM().state_dict()
    merged = PeftModel.from_pretrained(TinyLM(), str(tmp_path / "ada")).merge_and_unload().state_dict()
    changed = {k.removesuffix(".weight") for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {m.name for m in data.modules}
    for m in data.modules:
        want = merged[f"{m.name}.weight"].double() - base[f"{m.name}.weight"].double()
        assert torch.linalg.norm(m.scale * m.B.double() @ m.A.double() - want) <= 1e-5 * torch.linalg.norm(want), m.name


def test_ia3_is_refused_saying_why_and_what_to_pass(tmp_path: Path) -> None:
    get_peft_model(TinyLM(), IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[])).save_pretrained(str(tmp_path / "ia3"))
    with pytest.raises(InputError, match=r"adapter_config.json.*IA3 is a per-channel rescale.*not a low-rank update.*--base BASE"):
        read_adapter(tmp_path / "ia3")


def test_a_safetensors_file_whose_every_name_is_prefixed_is_read_without_the_prefix(tmp_path: Path) -> None:
    """DeepSpeed/DDP's `module.` and a flattened checkpoint's `state_dict.` before every name of a LoRA file."""
    tensors = write_kohya_file(tmp_path / "plain.safetensors", conv=False)
    want = [(m.name, m.scale, m.A, m.B) for m in read_adapter(tmp_path / "plain.safetensors").modules]
    for prefix in ("module.", "state_dict.module."):
        save_file({prefix + k: v for k, v in tensors.items()}, str(tmp_path / "prefixed.safetensors"))
        data = read_adapter(tmp_path / "prefixed.safetensors")
        assert data.format == "kohya" and [(m.name, m.scale) for m in data.modules] == [(n, s) for n, s, _, _ in want], prefix
        assert all(torch.equal(m.A, A) and torch.equal(m.B, B) for m, (_, _, A, B) in zip(data.modules, want, strict=True))
