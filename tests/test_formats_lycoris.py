"""LyCORIS LoHa, LoKr and full files written by lycoris-lora itself on a tiny model: zoo's dW of every module is the
update LyCORIS's own forward applies; the LoKr and LoHa factorizations are exact for any shapes (hypothesis)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lycoris import LycorisNetwork
from safetensors.torch import save_file
from torch import nn

from tests.conftest import CLI
from zoo.errors import InputError
from zoo.formats import read_adapter
from zoo.formats.lycoris import read_lycoris

pytestmark = pytest.mark.usefixtures("one_torch_thread")
logging.getLogger("LyCORIS").setLevel(logging.ERROR)


class Tiny(nn.Module):
    """A few Linear layers and Conv2d ones: LyCORIS picks a different LoKr layout for each shape."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 48)
        self.v = nn.Linear(48, 32)
        self.out = nn.Linear(64, 64)
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.wide = nn.Conv2d(16, 32, 3, padding=1)


def lycoris_file(
    path: Path, algo: str, conv_algo: str | None = None, targets: tuple[str, ...] = ("Linear", "Conv2d"), **kwargs: object
) -> LycorisNetwork:
    """A LyCORIS network of `algo` (Conv2d layers: `conv_algo`) on Tiny's `targets`, random non-zero weights (LyCORIS
    starts one factor at zero), saved by its own save_weights; the network stays applied to its model."""
    torch.manual_seed(0)
    LycorisNetwork.apply_preset({"target_module": list(targets), "module_algo_map": {"Conv2d": {"algo": conv_algo}} if conv_algo else {}})
    dims = {"conv_lora_dim": kwargs.get("lora_dim", 4), "conv_alpha": kwargs.get("alpha", 1)}
    net = LycorisNetwork(Tiny(), network_module=algo, **dims, **kwargs)  # type: ignore[no-untyped-call]
    net.apply_to()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    net.save_weights(str(path), torch.float32, {})
    return net


def applied_delta(lora: nn.Module, dW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what LyCORIS's forward adds to the layer's output, what dW adds) on a probe input: the identity for a Linear
    (so the first is dWᵀ itself), random images for a conv."""
    layer = lora.org_module[0]
    if isinstance(layer, nn.Linear):
        x = torch.eye(layer.in_features)
        applied = layer(x) - lora.org_forward(x)
        return applied, x @ dW.T
    x = torch.randn(2, layer.in_channels, 7, 7)
    return layer(x) - lora.org_forward(x), layer._conv_forward(x, dW.reshape(layer.weight.shape), None)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "algo,kwargs,layouts",
    [
        ("loha", {"lora_dim": 2, "alpha": 1}, {"hada_w1_a"}),
        ("loha", {"lora_dim": 2, "alpha": 3, "use_tucker": True}, {"hada_t1"}),
        # factor 4: full lokr_w1 and factored lokr_w2 on the Linears, both whole on the small conv
        ("lokr", {"lora_dim": 2, "alpha": 1, "factor": 4}, {"lokr_w1", "lokr_w2_a", "lokr_w2"}),
        ("lokr", {"lora_dim": 2, "alpha": 3, "factor": 8, "decompose_both": True}, {"lokr_w1_a", "lokr_w2_a"}),
        ("lokr", {"lora_dim": 2, "alpha": 1, "factor": 2, "use_tucker": True}, {"lokr_t2"}),
    ],
)
def test_dw_is_the_update_lycoris_applies(tmp_path: Path, algo: str, kwargs: dict, layouts: set[str]) -> None:
    path = tmp_path / f"{algo}.safetensors"
    net = lycoris_file(path, algo, **kwargs)
    data = read_adapter(path)
    assert data.format == "lycoris" and data.config["algorithms"] == {algo: 5}
    assert layouts <= {k.split(".", 1)[1] for k in _keys(path)}  # the layouts this case is about are in the file
    modules = {m.name: m for m in data.modules}
    assert sorted(modules) == sorted(lora.lora_name for lora in net.loras)
    for lora in net.loras:
        m = modules[lora.lora_name]
        assert isinstance(lora.org_module[0], nn.Conv2d) or m.kind == "linear"
        assert m.rank <= min(m.shape) // 2
        with torch.no_grad():
            applied, ours = applied_delta(lora, m.scale * m.B @ m.A)
        assert relative_error(ours, applied) < 1e-5, lora.lora_name


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_lokr_scale_is_alpha_over_the_factored_rank(tmp_path: Path) -> None:
    """LoKr's alpha/dim applies to a module with a factored side; with both sides whole, LyCORIS's scale is 1."""
    lycoris_file(tmp_path / "k.safetensors", "lokr", lora_dim=2, alpha=1, factor=4)
    modules = {m.name: m for m in read_adapter(tmp_path / "k.safetensors").modules}
    assert modules["lycoris_q"].scale == 0.5 and modules["lycoris_conv"].scale == 1.0


def test_whole_lokr_modules_are_read_as_full_rank_spectra(tmp_path: Path) -> None:
    """lora_dim past half the factors (LyCORIS's recommended 10000): lokr_w1 and lokr_w2 both whole, dW full rank, kept
    as its exact spectrum (the products of the two sides' singular values)."""
    path = tmp_path / "whole.safetensors"
    net = lycoris_file(path, "lokr", targets=("Linear",), lora_dim=10000, alpha=1)
    data = read_adapter(path)
    assert not data.modules and data.config == {"algorithms": {"lokr": 3}, "full_rank": True}
    assert "full-rank deltas, their exact spectra only" in data.notes[0]
    spectra = {fm.name: fm for fm in data.full_matrices}
    for lora in net.loras:
        x = torch.eye(lora.org_module[0].in_features)
        with torch.no_grad():
            dW = (lora.org_module[0](x) - lora.org_forward(x)).T  # what LyCORIS's forward adds, as a matrix
        expected = torch.linalg.svdvals(dW.double())
        fm = spectra[lora.lora_name]
        got = torch.tensor(fm.spectrum.singular_values, dtype=torch.float64)
        assert fm.shape == tuple(dW.shape) and got.numel() == min(dW.shape)
        assert torch.allclose(got, expected, rtol=1e-5)


def test_mixed_file_keeps_full_deltas_exact(tmp_path: Path) -> None:
    """LoKr Linears with `full` Conv2d modules (LyCORIS's per-module algorithm map): the full deltas are kept exact at
    full rank beside the low-rank modules; their bias deltas are recorded."""
    path = tmp_path / "mixed.safetensors"
    net = lycoris_file(path, "lokr", conv_algo="full", lora_dim=2, alpha=1, factor=4)
    data = read_adapter(path)
    assert data.config["algorithms"] == {"full": 2, "lokr": 3}
    assert "lycoris_conv.diff_b" in data.extra_tensors and any("bias or norm deltas" in n for n in data.notes)
    modules = {m.name: m for m in data.modules}
    assert modules["lycoris_conv"].rank == 16 and modules["lycoris_conv"].kind == "conv"
    for lora in net.loras:
        expected = lora.get_diff_weight()[0] if lora.lora_name.endswith("conv") or lora.lora_name.endswith("wide") else None
        m = modules[lora.lora_name]
        with torch.no_grad():
            if expected is not None:
                assert relative_error(m.scale * m.B @ m.A, expected.reshape(m.shape)) < 1e-6
            else:
                applied, ours = applied_delta(lora, m.scale * m.B @ m.A)
                assert relative_error(ours, applied) < 1e-5


def test_full_only_file_is_spectra_and_locon_is_kohya(tmp_path: Path) -> None:
    lycoris_file(tmp_path / "full.safetensors", "full")
    data = read_adapter(tmp_path / "full.safetensors")
    assert data.format == "lycoris" and not data.modules and len(data.full_matrices) == 5
    net = lycoris_file(tmp_path / "locon.safetensors", "locon", lora_dim=2, alpha=1, use_tucker=True)
    data = read_adapter(tmp_path / "locon.safetensors")  # LyCORIS writes LoCon in kohya's layout
    assert data.format == "kohya"
    modules = {m.name: m for m in data.modules}
    for lora in net.loras:
        m = modules[lora.lora_name]
        with torch.no_grad():
            applied, ours = applied_delta(lora, m.scale * m.B @ m.A)
        assert relative_error(ours, applied) < 1e-5


def test_dora_magnitude_is_recorded_not_applied(tmp_path: Path) -> None:
    path = tmp_path / "dora.safetensors"
    lycoris_file(path, "loha", lora_dim=2, alpha=1, weight_decompose=True)
    data = read_adapter(path)
    assert data.config["use_dora"] is True and "lycoris_q.dora_scale" in data.extra_tensors
    assert any("DoRA magnitude (dora_scale, recorded, not applied)" in n for n in data.notes)


@pytest.mark.parametrize(
    "tensors,reason",
    [
        ({"m.oft_blocks": torch.randn(2, 4, 4), "m.alpha": torch.tensor(1.0)}, r"m\.oft_blocks: LyCORIS OFT/BOFT"),
        ({"m.hada_w1_a": torch.randn(8, 2), "m.hada_w1_b": torch.randn(2, 8), "m.hada_w2_a": torch.randn(8, 2)}, r"m: hada_w2_b missing"),
        (
            {"m.lokr_w1": torch.randn(2, 2), "m.lokr_w2_a": torch.randn(8, 2), "m.lokr_w2_b": torch.randn(3, 8)},
            r"shape mismatch in m: lokr_w2_a",
        ),
        ({"m.lokr_w1": torch.randn(2, 2), "m.lokr_w2": torch.randn(4, 4), "m.lora_down.weight": torch.randn(2, 8)}, r"m mixes LyCORIS"),
        # a kron of two small stored sides past the width limit, refused before anything is built
        ({"m.lokr_w1": torch.randn(730, 1), "m.lokr_w2": torch.randn(730, 1)}, r"is 532,900 wide, past the limit"),
    ],
)
def test_unreadable_modules_are_refused_by_key(tmp_path: Path, tensors: dict[str, torch.Tensor], reason: str) -> None:
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InputError, match=reason):
        read_adapter(tmp_path / "bad.safetensors")


@st.composite
def factored(draw: st.DrawFn, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """A side of rows × cols: whole, or a product (rows × r)(r × cols) of any rank r."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if draw(st.booleans()):
        return torch.randn(rows, cols, generator=gen)
    r = draw(st.integers(1, 6))
    return torch.randn(rows, r, generator=gen), torch.randn(r, cols, generator=gen)


def _dense(side: tuple[torch.Tensor, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    return side[0] @ side[1] if isinstance(side, tuple) else side


def _check(tensors: dict[str, torch.Tensor], dense: torch.Tensor) -> None:
    """The read update is dense: as a module dW = scale·B·A, or as a spectrum its singular values."""
    data = read_lycoris(Path("x.safetensors"), tensors, {})
    if data.modules:
        (m,) = data.modules
        assert torch.allclose(m.scale * m.B.double() @ m.A.double(), dense.double(), rtol=1e-4, atol=1e-4 * float(dense.abs().max()))
    else:
        got = torch.tensor(data.full_matrices[0].spectrum.singular_values, dtype=torch.float64)
        expected = torch.linalg.svdvals(dense.double())
        assert torch.allclose(got, expected[: got.numel()], rtol=1e-4, atol=1e-6 * float(expected[0]))


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 5), st.integers(1, 9), st.integers(1, 9), st.floats(0.5, 8))
def test_lokr_factorization_is_exact(data: st.DataObject, a: int, c: int, b: int, d: int, alpha: float) -> None:
    w1, w2 = data.draw(factored(a, c)), data.draw(factored(b, d))
    tensors = {"m.alpha": torch.tensor(alpha)}
    for i, side in ((1, w1), (2, w2)):
        tensors.update({f"m.lokr_w{i}_a": side[0], f"m.lokr_w{i}_b": side[1]} if isinstance(side, tuple) else {f"m.lokr_w{i}": side})
    dim = w1[1].shape[0] if isinstance(w1, tuple) else w2[1].shape[0] if isinstance(w2, tuple) else None
    _check(tensors, (alpha / dim if dim else 1.0) * torch.kron(_dense(w1), _dense(w2)))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_loha_factorization_is_exact(out: int, inp: int, r1: int, r2: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = {
        f"m.hada_w{i}_{s}": torch.randn(*shape, generator=gen)
        for i, r in ((1, r1), (2, r2))
        for s, shape in (("a", (out, r)), ("b", (r, inp)))
    }
    dense = (w["m.hada_w1_a"] @ w["m.hada_w1_b"]) * (w["m.hada_w2_a"] @ w["m.hada_w2_b"]) * (2.0 / r1)
    _check({**w, "m.alpha": torch.tensor(2.0)}, dense)


def test_ingest_embed_search_finds_the_stored_file(cli: CLI, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    lycoris_file(src / "loha.safetensors", "loha", lora_dim=2, alpha=1)
    lycoris_file(src / "lokr.safetensors", "lokr", lora_dim=2, alpha=1, factor=4)
    lycoris_file(src / "tucker.safetensors", "lokr", lora_dim=2, alpha=1, factor=2, use_tucker=True)
    rc, results = cli.json_lines("ingest", "--no-embed", str(src), "--base-model", "tiny")
    assert rc == 0 and [r["status"] for r in results] == ["ingested"] * 3
    rc, (listed,) = cli.json_lines("list")
    assert [r["format"] for r in listed["results"]] == ["lycoris"] * 3
    shutil.copy(src / "lokr.safetensors", tmp_path / "lokr-copy.safetensors")
    rc, (again,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "lokr-copy.safetensors"), "--base-model", "tiny")
    lokr_id = next(r["adapter_id"] for r in results if r["source"].endswith("lokr.safetensors"))
    assert rc == 0 and again["status"] == "duplicate" and again["adapter_id"] == lokr_id
    rc, _ = cli.json_lines("embed")
    assert rc == 0
    rc, (found,) = cli.json_lines("search", str(tmp_path / "lokr-copy.safetensors"), "-k", "2")
    assert rc == 0 and found["stored_as"]["adapter_id"] == lokr_id
    assert len(found["results"]) == 2 and lokr_id not in [r["adapter_id"] for r in found["results"]]
    lycoris_file(tmp_path / "whole.safetensors", "lokr", targets=("Linear",), lora_dim=10000, alpha=1)
    rc, _, err = cli("search", str(tmp_path / "whole.safetensors"))
    assert rc == 2 and "a lycoris file read as full-rank spectra has no low-rank update to search with" in err
    # a LoKr is an exact B·A: its PEFT export (rank r1·r2, scale 1) ingests as the same adapter
    lycoris_file(tmp_path / "linear.safetensors", "lokr", targets=("Linear",), lora_dim=2, alpha=1, factor=4)
    rc, (linear,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "linear.safetensors"), "--base-model", "tiny")
    rc, _, _ = cli("export", str(linear["adapter_id"]), "--format", "peft", "--out", str(tmp_path / "peft"))
    rc, (exported,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "peft"), "--base-model", "tiny")
    assert rc == 0 and exported["status"] == "duplicate" and exported["adapter_id"] == linear["adapter_id"]
