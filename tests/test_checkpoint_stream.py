"""Full checkpoints at real widths: a TinyLlama-shaped bf16 pair ingested with `zoo ingest FINETUNED --base BASE`,
matrix by matrix, the large file streamed tensor by tensor (not held), in bounded memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import CLI
from zoo.config import Settings
from zoo.errors import InputError
from zoo.formats import read_adapter
from zoo.formats.safe_load import StreamedFile, StreamedTensors, read_weight_file, safetensors_header, safetensors_tensors
from zoo.reference.real_checkpoints import TINYLLAMA, LlamaShape, write_checkpoint_pair

ENERGY, MAX_RANK = 0.9, 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One decoder block at TinyLlama's real widths (and a 512-token vocabulary)."""
    return write_checkpoint_pair(tmp_path_factory.mktemp("tinyllama"), layers=1, vocab=512)


def direct_deltas(base: Path, tuned: Path) -> dict[str, tuple[int, torch.Tensor, float]]:
    """Per weight matrix, from safetensors' own loader and an exact SVD of the delta: (the fewest components
    reaching ENERGY, capped at MAX_RANK; all singular values; ||delta||_F²)."""
    out = {}
    with safe_open(str(base), "pt") as fb, safe_open(str(tuned), "pt") as ft:
        for key in ft.keys():  # noqa: SIM118 - safe_open is no mapping
            w = ft.get_tensor(key)
            if w.ndim < 2:
                continue
            s = torch.linalg.svdvals(w.float() - fb.get_tensor(key).float()).double()
            total = float((s**2).sum())
            cum = torch.cumsum(s**2, 0) / total
            out[key] = (min(int((cum < ENERGY).sum()) + 1, MAX_RANK), s, total)
    return out


def test_the_writer_lays_out_tinyllama(pair: tuple[Path, Path]) -> None:
    assert TINYLLAMA.parameters == 1_100_048_384  # TinyLlama-1.1B's published parameter count
    base, tuned = pair
    expected = LlamaShape(layers=1, vocab=512).tensors()
    with safe_open(str(base), "pt") as fb, safe_open(str(tuned), "pt") as ft:
        assert set(fb.keys()) == set(ft.keys()) == set(expected)
        for key, shape in expected.items():
            w0, w = fb.get_tensor(key), ft.get_tensor(key)
            assert tuple(w.shape) == shape and w.dtype == torch.bfloat16
            relative = float(torch.linalg.vector_norm(w.float() - w0.float()) / torch.linalg.vector_norm(w0.float()))
            assert 0 < relative < 0.5
    assert ft_shape(tuned, "model.layers.0.self_attn.k_proj.weight") == [256, 2048]  # 4 key/value heads of 64
    assert write_checkpoint_pair(base.parent / "again", layers=1, vocab=512)[1].read_bytes() == tuned.read_bytes()  # seeded


def ft_shape(path: Path, key: str) -> list[int]:
    with safe_open(str(path), "pt") as f:
        return list(f.get_slice(key).get_shape())


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # heavy (real widths); the database's part is any ingest's
def test_a_tinyllama_pair_ingests_as_low_rank_deltas(cli: CLI, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    base, tuned = pair
    rc, (result,) = cli.json_lines("ingest", "--no-embed", str(tuned), "--base", str(base), "--base-model", "tinyllama")
    assert rc == 0 and result["status"] == "ingested", result
    rc, (shown,) = cli.json_lines("show", str(result["adapter_id"]))
    assert rc == 0 and shown["format"] == "checkpoint-delta"
    direct = direct_deltas(base, tuned)
    modules = {m["name"]: m for m in shown["modules"]}
    assert set(modules) == set(direct) and len(modules) == 9  # 7 projections, the embedding and lm_head
    captured = []
    for key, (rank, s, total) in direct.items():
        m = modules[key]
        assert m["shape"] == ft_shape(tuned, key)
        assert abs(m["rank"] - rank) <= 1, key  # the randomized SVD may differ at the energy boundary by a component
        stored = torch.tensor(m["singular_values"], dtype=torch.float64)
        assert len(stored) == m["rank"] and torch.allclose(stored, s[: len(stored)], rtol=1e-3), key
        captured.append(m["frobenius_norm"] ** 2 / total)
        assert captured[-1] == pytest.approx(float((s[: m["rank"]] ** 2).sum()) / total, abs=2e-3), key
    assert len({m["rank"] for m in modules.values()}) > 2  # the writer's deltas differ from matrix to matrix
    assert min(captured) > ENERGY - 2e-3 or any(m["rank"] == MAX_RANK for m in modules.values())
    noted = re.search(r"captured energy min ([0-9.]+), mean ([0-9.]+)", result["notes"][0])
    assert noted is not None, result["notes"]
    assert float(noted[1]) == pytest.approx(min(captured), abs=2e-3)
    assert float(noted[2]) == pytest.approx(sum(captured) / len(captured), abs=2e-3)

    # the same pair read streamed (tensor by tensor) is the same update: the stored adapter's duplicate
    monkeypatch.setenv("ZOO_STREAM_MIN_BYTES", "0")
    rc, (again,) = cli.json_lines("ingest", "--no-embed", str(tuned), "--base", str(base), "--base-model", "tinyllama")
    assert rc == 0 and again["status"] == "duplicate" and again["adapter_id"] == result["adapter_id"], again
    assert again["canonical_hash"] == result["canonical_hash"]


@pytest.mark.slow
def test_streamed_and_held_reads_give_the_same_factors(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    base, tuned = pair
    held = read_adapter(tuned, base=base)
    monkeypatch.setenv("ZOO_STREAM_MIN_BYTES", "0")
    assert isinstance(read_weight_file(tuned).data, StreamedFile)
    streamed = read_adapter(tuned, base=base)
    assert held.file_sha256 == streamed.file_sha256 and held.size_bytes == streamed.size_bytes == tuned.stat().st_size
    assert [m.name for m in held.modules] == [m.name for m in streamed.modules]
    for a, b in zip(held.modules, streamed.modules, strict=True):
        assert torch.equal(a.A, b.A) and torch.equal(a.B, b.B)  # same bytes, same seeded sketch
    assert held.extra_tensors == streamed.extra_tensors and set(held.extra_tensors) == {
        k for k, shape in LlamaShape(layers=1, vocab=512).tensors().items() if len(shape) == 1
    }
    full = read_adapter(tuned)  # without a base: every matrix's spectrum, computed as it is read
    assert len(full.full_matrices) == 9
    assert [fm.shape for fm in full.full_matrices] == [tuple(ft_shape(tuned, fm.name)) for fm in full.full_matrices]
    with safe_open(str(tuned), "pt") as ft:
        # one matrix of each shape but the MLP's 5632×2048 (their exact SVDs in float64 took 8 of this test's 41 s)
        for fm in {fm.shape: fm for fm in full.full_matrices if max(fm.shape) <= 2048}.values():
            W = ft.get_tensor(fm.name).float()
            assert np.allclose(fm.spectrum.singular_values, torch.linalg.svdvals(W.double()).numpy(), rtol=1e-4, atol=1e-6)


def test_a_streamed_file_changed_after_it_was_hashed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOO_STREAM_MIN_BYTES", "0")
    path = tmp_path / "ck.safetensors"
    save_file({"a": torch.ones(64, 32), "b": torch.ones(64, 32)}, str(path))
    wf = read_weight_file(path)
    tensors = safetensors_tensors(wf, safetensors_header(path, wf.data))
    assert isinstance(tensors, StreamedTensors) and torch.equal(tensors["a"], torch.ones(64, 32))
    save_file({"a": torch.ones(64, 32), "b": torch.zeros(64, 32)}, str(path))  # same size, other bytes
    with pytest.raises(InputError, match="changed while it was read") as exc:
        tensors["b"]
    assert str(path) in str(exc.value)


def test_a_streamed_checkpoint_names_the_file_and_the_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOO_STREAM_MIN_BYTES", "0")
    base, tuned, bad = tmp_path / "base.safetensors", tmp_path / "tuned.safetensors", tmp_path / "nan.safetensors"
    save_file({"l.w": torch.zeros(300, 1100), "l.v": torch.zeros(8, 8)}, str(base))
    save_file({"l.w": torch.ones(300, 1100), "l.v": torch.full((8, 8), float("nan"))}, str(bad))
    with pytest.raises(InputError, match="l.v contains NaN") as exc:
        read_adapter(bad, base=base)
    assert str(bad) in str(exc.value)
    save_file({"l.w": torch.zeros(300, 1101)}, str(tuned))
    with pytest.raises(InputError, match=r"shape mismatch for l.w: \[300, 1101\] here, \[300, 1100\] in the base") as exc:
        read_adapter(tuned, base=base)
    assert str(tuned) in str(exc.value)
    (tmp_path / "cut.safetensors").write_bytes(base.read_bytes()[:-4])
    with pytest.raises(InputError, match="truncated safetensors file") as exc:
        read_adapter(tuned, base=tmp_path / "cut.safetensors")
    assert "cut.safetensors" in str(exc.value)


def peak_rss_kib(settings: Settings, base: Path, tuned: Path) -> tuple[int, dict]:
    """Peak RSS (KiB) of `zoo ingest TUNED --base BASE` run as a child of a fresh interpreter, and its result."""
    measure = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    zoo = [sys.executable, "-m", "zoo.cli", "--db", settings.database_url, "--data-dir", str(settings.data_dir)]
    cmd = [sys.executable, "-c", measure, *zoo, "ingest", "--no-embed", str(tuned), "--base", str(base), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "ZOO_STREAM_MIN_BYTES": str(256 << 20)}).stdout
    *lines, peak = out.strip().splitlines()
    return int(peak), json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the reader's memory, whatever the database
def test_peak_memory_of_a_checkpoint_delta_is_bounded_by_a_matrix_not_the_files(settings: Settings, tmp_path: Path) -> None:
    """Four real-width blocks (352 MiB a file): the reader that held both files added 899 MiB of peak RSS over a pair with
    no blocks; reading a matrix at a time adds 30-100 MiB here (a 5632×2048 matrix: both bf16 tensors, the float32
    delta, the SVD's work, the factors, and how the allocator keeps freed memory), so half a file is the bound."""
    small = write_checkpoint_pair(tmp_path / "small", layers=0, vocab=2048)
    large = write_checkpoint_pair(tmp_path / "large", layers=4, vocab=2048)
    size = large[1].stat().st_size
    assert size > 256 << 20  # streamed at the default threshold
    before, small_result = peak_rss_kib(settings, *small)
    after, large_result = peak_rss_kib(settings, *large)
    assert small_result["status"] == large_result["status"] == "ingested", (small_result, large_result)
    extra = (after - before) * 1024
    assert extra < size / 2, f"ingesting 4 blocks took {extra / 2**20:.0f} MiB more than none (files of {size / 2**20:.0f} MiB)"
