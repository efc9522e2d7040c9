"""Adapters at the real widths of public models (a block or two of each, zoo.reference.real_shapes): ingested,
embedded into vectors of bounded size that track exact module cosine, searched by family, in bounded memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from sqlalchemy import select

from tests.conftest import CLI
from zoo.domain.kohya_names import model_path
from zoo.domain.similarity import (
    MAX_SEARCH_DIM,
    MODULE_SKETCH_DIM,
    module_cosine_matrix,
    module_sketches,
    sketch_module_cosines,
    sketch_width,
)
from zoo.reference.real_shapes import MODELS, write_adapter, write_zoo
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter, Embedder, EmbeddingSpace
from zoo.store.session import session_factory


@given(st.integers(1, 4 * MAX_SEARCH_DIM))
def test_sketch_width_bounds_the_vector(n_modules: int) -> None:
    width = sketch_width(n_modules)
    assert 1 <= width <= MODULE_SKETCH_DIM
    assert n_modules * width <= max(MAX_SEARCH_DIM, n_modules)
    if n_modules * MODULE_SKETCH_DIM <= MAX_SEARCH_DIM:
        assert width == MODULE_SKETCH_DIM  # small spaces keep every probe
    else:
        assert n_modules * (width + 1) > MAX_SEARCH_DIM  # and large ones use the whole budget


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_kind_is_read_at_its_real_widths(kind: str, cli: CLI, tmp_path: Path) -> None:
    """One block of each model ingests with the modules, shapes and dtype the generator wrote."""
    model = MODELS[kind]
    path = write_adapter(kind, tmp_path, family=0, member=0, layers=1)
    rc, rows = cli.json_lines("ingest", "--no-embed", str(path))
    assert rc == 0 and rows[0]["status"] == "ingested", rows
    rc, (shown,) = cli.json_lines("show", str(rows[0]["adapter_id"]))
    assert rc == 0
    stored = {(m["name"], *m["shape"]) for m in shown["modules"]}
    want = {(model_path(m.name) or m.name, m.out, m.fan_in) for m in model.modules(1)}  # kohya names read as model paths
    assert stored == want
    assert {m["rank"] for m in shown["modules"]} == {model.rank}
    assert max(o for _, o, _ in stored) >= 3072  # real widths, not toy ones


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[Path, int]]]:
    """Per kind, 3 families × 2 members at one or two blocks of real width."""
    root = tmp_path_factory.mktemp("realsize")
    return {kind: write_zoo(kind, root / kind, families=3, members=2, layers=2 if kind == "mistral-7b" else 1) for kind in MODELS}


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # heavy; the database's part is the same as any zoo's
def test_each_kind_is_searched_by_family(families: dict[str, list[tuple[Path, int]]], cli: CLI) -> None:
    """Per kind, the sketch estimate of module cosine tracks the exact one; `zoo embed` makes one space per base with
    vectors ≤ MAX_SEARCH_DIM; every adapter's nearest is its family's."""
    family_of: dict[int, int] = {}
    ids: dict[str, list[int]] = {}
    blobs = BlobStore(cli.settings.blob_dir)
    for kind, written in families.items():
        rc, rows = cli.json_lines("ingest", "--no-embed", *[str(p) for p, _ in written], "--base-model", kind)
        assert rc == 0 and all(r["status"] == "ingested" for r in rows), rows
        family_of.update({r["adapter_id"]: f for r, (_, f) in zip(rows, written, strict=True)})
        ids[kind] = [r["adapter_id"] for r in rows]
        with session_factory(cli.settings.database_url)() as session:
            factors = [dict(blobs.get_factors(str(session.get(Adapter, i).factors_blob))) for i in ids[kind]]
        _sketches_track_module_cosine(kind, factors)
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0
    assert {r["space"] for r in reports} == set(MODELS)
    with session_factory(cli.settings.database_url)() as session:
        dims = dict(session.execute(select(EmbeddingSpace.base_model, Embedder.dim).join(Embedder)).all())
    assert set(dims) == set(MODELS) and max(dims.values()) <= MAX_SEARCH_DIM, dims
    for kind, members in ids.items():
        for adapter_id in members:
            rc, (found,) = cli.json_lines("search", str(adapter_id), "-k", "1", "--space", kind, "--method", "module")
            assert rc == 0
            top = found["results"][0]["adapter_id"]
            assert top in members and family_of[top] == family_of[adapter_id], (kind, adapter_id, top)


def _sketches_track_module_cosine(kind: str, factors: list[dict]) -> None:
    names = sorted(factors[0])
    width = sketch_width(len(names))
    sketches = module_sketches(factors, names, width)
    assert sketches.shape == (len(factors), len(names) * width) and sketches.shape[1] <= MAX_SEARCH_DIM
    approx = sketch_module_cosines(sketches, sketches, len(names))
    exact = module_cosine_matrix(factors, factors)
    off = ~np.eye(len(factors), dtype=bool)
    assert np.allclose(np.diag(approx), 1.0, atol=1e-5)
    assert np.corrcoef(approx[off], exact[off])[0, 1] > 0.9, kind
    assert np.abs(approx[off] - exact[off]).max() < 0.2, kind


def _embed_peak_rss(tmp_path: Path, adapters: int) -> int:
    """Peak RSS (bytes) of `zoo embed` in a child process over `adapters` Llama-3-8B adapters of four real-width
    blocks, with embedding chunks of one adapter and no module store (which holds every adapter up to its own
    budget, ZOO_MODULE_STORE_BYTES)."""
    data = tmp_path / f"data-{adapters}"
    env = {**os.environ, "ZOO_DATA_DIR": str(data), "ZOO_EMBED_CHUNK_BYTES": str(16 << 20), "ZOO_MODULE_STORE_BYTES": "0"}
    env.pop("ZOO_DATABASE_URL", None)
    zoo = [sys.executable, "-m", "zoo.cli"]
    subprocess.run([*zoo, "init"], env=env, check=True, capture_output=True)
    written = write_zoo("llama3-8b", tmp_path / f"files-{adapters}", families=adapters, members=1, layers=4)
    subprocess.run([*zoo, "ingest", "--no-embed", *[str(p) for p, _ in written]], env=env, check=True, capture_output=True)
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *zoo, "embed", "--json"], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip()) * 1024


@pytest.mark.slow
def test_embed_memory_does_not_grow_with_the_zoo(tmp_path: Path) -> None:
    """Three times the adapters (each ~40 MB of float32 factors) cost `zoo embed` less than three adapters' factors (the
    whole zoo held at once would add six): allocator and thread noise is tens of MB."""
    few, many = _embed_peak_rss(tmp_path, 3), _embed_peak_rss(tmp_path, 9)
    per_adapter = 4 * sum(16 * (m.out + m.fan_in) for m in MODELS["llama3-8b"].modules(4))
    assert many - few < 3 * per_adapter, (few, many, per_adapter)


def _embed_rss(data: Path, *space: str) -> int:
    """Peak RSS (bytes) of `zoo embed` (of one space, or of all) in a child process over a copy of the data dir."""
    copy = data.with_name(f"{data.name}-{len(space)}")
    shutil.copytree(data, copy)
    env = {**os.environ, "ZOO_DATA_DIR": str(copy), "ZOO_EMBED_CHUNK_BYTES": str(16 << 20)}
    env.pop("ZOO_DATABASE_URL", None)
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    args = [sys.executable, "-c", code, sys.executable, "-m", "zoo.cli", "embed", *(["--space", *space] if space else []), "--json"]
    return int(subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout.strip()) * 1024


@pytest.mark.slow
def test_embed_memory_is_one_base_models_whatever_the_spaces(tmp_path: Path) -> None:
    """`zoo embed` of three base models' spaces holds what one needs: each space is embedded, scanned for relations
    and let go before the next (the relation step held every space's module store, ~130 MB each here, and the
    sketches' probes of every base model). The same six Llama-3-8B adapters of four real-width blocks are stored
    under three base models, so the spaces are alike and the one embedded alone is any of them."""
    data = tmp_path / "data"
    env = {**os.environ, "ZOO_DATA_DIR": str(data)}
    env.pop("ZOO_DATABASE_URL", None)
    zoo = [sys.executable, "-m", "zoo.cli"]
    subprocess.run([*zoo, "init"], env=env, check=True, capture_output=True)
    written = write_zoo("llama3-8b", tmp_path / "files", families=3, members=2, layers=4)
    for base in ("base-a", "base-b", "base-c"):
        subprocess.run(
            [*zoo, "ingest", "--no-embed", *[str(p) for p, _ in written], "--base-model", base], env=env, check=True, capture_output=True
        )
    one, three = _embed_rss(data, "base-a"), _embed_rss(data)
    store = 4 * len(written) * sum(16 * (m.out + m.fan_in + 1) for m in MODELS["llama3-8b"].modules(4))  # one space's module store
    assert three - one < store, (one, three, store)


def _write_thousand_module_adapter(directory: Path, family: int, member: int) -> Path:
    """A PEFT adapter of 1,000 modules (250 layers × 4 types, 32 wide, r 2): half of each module's rank shared
    with its family."""
    gen = torch.Generator().manual_seed(1000 * family + member)
    shared = torch.Generator().manual_seed(10_000 + family)
    tensors = {}
    for layer in range(250):
        for t in ("q_proj", "k_proj", "v_proj", "o_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            A, B = torch.randn(2, 32, generator=gen), torch.randn(32, 2, generator=gen)
            A[:1], B[:, :1] = torch.randn(1, 32, generator=shared), torch.randn(32, 1, generator=shared)
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = A, B * 0.01
    out = directory / f"wide-f{family}-m{member}"
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "thousand-modules"}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # heavy; the database's part is the same as any zoo's
def test_a_thousand_module_adapter_is_embedded_searched_and_predicted(cli: CLI, tmp_path: Path) -> None:
    """Ten 1,000-module adapters: `zoo embed` (vectors ≤ MAX_SEARCH_DIM), `zoo train`, then search by family and
    a prediction for an adapter read from a file."""
    paths = [_write_thousand_module_adapter(tmp_path / "zoo", f, m) for f in range(2) for m in range(5)]
    (tmp_path / "labels.csv").write_text("name,task\n" + "".join(f"{p.name},f{p.name.split('-')[1][1:]}\n" for p in paths))
    rc, rows = cli.json_lines("ingest", "--no-embed", str(tmp_path / "zoo"), "--labels", str(tmp_path / "labels.csv"))
    assert rc == 0 and len(rows) == 10
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0 and reports[0]["embedded"] == 10
    rc, _ = cli.json_lines("train", "--epochs", "1", "--members", "1")
    assert rc == 0
    with session_factory(cli.settings.database_url)() as session:
        dims = list(session.scalars(select(Embedder.dim).where(Embedder.active)))
    assert len(dims) == 4 and max(dims) <= MAX_SEARCH_DIM  # module sketch, raw-factor sketch, input-Gram sketch, W2T
    family = {r["adapter_id"]: r["name"].split("-")[1] for r in rows}
    for adapter_id in list(family)[::4]:
        rc, (found,) = cli.json_lines("search", str(adapter_id), "-k", "3", "--method", "module")
        assert rc == 0 and all(family[h["adapter_id"]] == family[adapter_id] for h in found["results"])
    query = _write_thousand_module_adapter(tmp_path / "queries", 1, 9)
    rc, (predicted,) = cli.json_lines("predict", str(query))
    assert rc == 0
    assert predicted["attributes"]["task"][0]["value"] == "f1"
