"""W2T at real sizes: tokens of bounded width (a seeded Gaussian projection per side) and bounded count
(modules grouped by type and layer), trained from projected data, recorded in the checkpoint and reproduced at
query time; old checkpoints still load at full width."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from sqlalchemy import select

from embed.data.dataset import ExactScores, load_adapters, read_training_set
from embed.data.tokens import (
    MAX_MODULE_TOKENS,
    TOKEN_WIDTH,
    TokenSpec,
    module_groups,
    modules_by_type,
    project,
    token_shapes,
    tokenize,
    torch_threads,
)
from embed.data.types import SpaceSchema, ZooAdapter, schema_of
from embed.serving.embedding_resource import stored_schema
from embed.serving.module_store import module_layout
from embed.training.train import train_w2t
from embed.training.train_options import FULL_WIDTH_TOKEN_BYTES, STEP_RANK_TOKENS, TrainOptions, token_spec
from embed.training.views import module_view
from embed.w2t.checkpoint import MEMORY, META, checkpoint_meta
from embed.w2t.ensemble import TOKENS_PER_BATCH, W2TEnsemble
from embed.w2t.model import W2T
from tests.conftest import CLI
from zoo.domain.canonical import CanonicalFactors
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.reference.real_shapes import write_zoo
from zoo.store.blobs import BlobStore
from zoo.store.embeddings import load_embeddings
from zoo.store.models import Adapter, Embedder
from zoo.store.session import session_factory


def _unit_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=gen)
    return x / x.norm(dim=1, keepdim=True)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(300, 4096), width=st.sampled_from([64, 128, 256]), c=st.floats(-1.0, 1.0), seed=st.integers(0, 2**16))
def test_projection_preserves_inner_products(d: int, width: int, c: float, seed: int) -> None:
    """⟨R u, R u′⟩ estimates ⟨u, u′⟩ = c without bias and with the Gaussian JL variance (1 + c²)/p, over 200 pairs."""
    spec, gen = TokenSpec(width, seed), torch.Generator().manual_seed(seed)
    u, w = _unit_rows(200, d, gen), _unit_rows(200, d, gen)
    w = w - (w * u).sum(1, keepdim=True) * u  # orthogonal to u, then u' = c u + √(1 - c²) w
    u2 = c * u + math.sqrt(1 - c * c) * w / w.norm(dim=1, keepdim=True)
    pu, pu2 = spec.project("u", u), spec.project("u", u2)
    assert pu.shape == (200, width)
    err = ((pu * pu2).sum(1) - (u * u2).sum(1)).double()
    var = (1 + c * c) / width
    assert abs(float(err.mean())) < 5 * math.sqrt(var / 200) + 0.02  # unbiased (R's own deviation from isometry: ~√(2/(pd)))
    assert float((err**2).mean()) < 1.6 * var  # the Gaussian variance, not more
    assert float(err.abs().max()) < 6 * math.sqrt(var)  # no pair far off: a JL bound over 200 pairs


@given(d=st.integers(1, 512), seed=st.integers(0, 100))
def test_narrow_sides_keep_their_identity_and_projections_are_fixed(d: int, seed: int) -> None:
    spec = TokenSpec(256, seed)
    x = torch.randn(3, d)
    if d <= 256:
        assert spec.projector("v", d) is None and torch.equal(spec.project("v", x), x)
    else:
        assert torch.equal(spec.projector("v", d), TokenSpec(256, seed).projector("v", d))  # the same R from the seed
        assert not torch.equal(spec.projector("u", d), spec.projector("v", d))  # u and v sides draw their own
        assert spec.project("v", x).shape == (3, 256)


@given(
    types=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=1, max_size=12),
    max_tokens=st.integers(0, 64),
)
def test_module_groups_are_bounded_and_keep_to_one_type_and_neighbouring_layers(types: list[tuple[int, int]], max_tokens: int) -> None:
    """Types of `n` layers × `per` modules a layer: at most max(max_tokens, types) groups (one a module when they fit),
    each of one type and of consecutive layers."""
    modules = [(f"layers.{layer}.t{t}.{j}", 8 + t, 8) for t, (n, per) in enumerate(types) for layer in range(n) for j in range(per)]
    schema = SpaceSchema("x", tuple(sorted(modules)))
    groups, count = module_groups(schema, max_tokens)
    total = len(modules)
    if not max_tokens or total <= max_tokens:
        assert count == total and sorted(torch.cat(list(groups.values())).tolist()) == list(range(total))
        return
    assert count <= max(max_tokens, len(types))
    by_type = modules_by_type(schema)
    seen: set[int] = set()
    for mtype, names in by_type.items():
        g = groups[mtype].tolist()
        assert not seen & set(g)  # a group holds one type
        seen |= set(g)
        layers = [schema.layer_of(n) for n in names]
        for group in set(g):
            mine = sorted(layers[i] for i in range(len(names)) if g[i] == group)
            others = [layers[i] for i in range(len(names)) if g[i] != group]
            assert not any(mine[0] < x < mine[-1] for x in others)  # consecutive layers
    assert seen == set(range(count))


def _thousand_modules(family: int, member: int) -> ZooAdapter:
    """An adapter of 1,000 modules (250 layers × 4 types of real widths: 4,096 × 1,024 to 320 × 2,880, r 4), half of
    each module's rank shared with its family: canonical factors made directly (orthonormal U and V)."""
    shapes = {"q_proj": (1024, 4096), "k_proj": (320, 2880), "v_proj": (640, 640), "o_proj": (4096, 1024)}
    gen, shared = torch.Generator().manual_seed(1000 * family + member), torch.Generator().manual_seed(10_000 + family)
    factors = {}
    for layer in range(250):
        for t, (out, inp) in shapes.items():
            U, V = torch.randn(out, 4, generator=gen), torch.randn(inp, 4, generator=gen)
            U[:, :2], V[:, :2] = torch.randn(out, 2, generator=shared), torch.randn(inp, 2, generator=shared)
            S = torch.tensor([4.0, 3.0, 2.0, 1.0])
            factors[f"layers.{layer}.{t}"] = CanonicalFactors(torch.linalg.qr(U)[0], S, torch.linalg.qr(V)[0])
    return ZooAdapter(1 + 10 * family + member, f"f{family}-m{member}", factors, labels={"task": f"f{family}"})


@pytest.mark.slow
def test_a_thousand_module_adapter_makes_bounded_tokens_and_embeds() -> None:
    """1,000 modules at real widths: tokens at most TOKEN_WIDTH wide, at most MAX_MODULE_TOKENS module tokens and a
    readout of as many blocks; a W2T trained on four such adapters embeds them in bounded batches, the same from
    factors projected beforehand (the training set's form), and a training step sees a bounded share of the modules."""
    with torch_threads(1):  # 4,000 small QRs: two threads wait on each other at each on a busy machine
        adapters = [_thousand_modules(f, m) for f in range(2) for m in range(2)]
    schema = schema_of("wide", adapters)
    assert len(schema.modules) == 1000
    emb = train_w2t(adapters, schema, TrainOptions(epochs=1, members=1, val_fraction=0.0), progress=False)
    spec = emb.config.tokens
    assert spec == TokenSpec(TOKEN_WIDTH, 0, MAX_MODULE_TOKENS)
    tokens = tokenize(adapters[:1], schema, emb.rank, spec)
    assert max(max(t.u.shape[-1], t.v.shape[-1]) for t in tokens.values()) == TOKEN_WIDTH
    assert emb.config.n_tokens <= MAX_MODULE_TOKENS and max(int(t.groups.max()) for t in tokens.values()) < emb.config.n_tokens
    model: W2T = emb.models[0]
    assert model.readout is not None and model.readout[1].in_features == emb.config.n_tokens * emb.config.outer_dim**2
    assert emb.batch_rows * len(schema.modules) * emb.rank <= TOKENS_PER_BATCH
    z = emb.embed(adapters)
    assert z.shape == (4, emb.dim) and np.allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    projected = [project(a, spec) for a in adapters]
    assert max(f.U.shape[0] for f in projected[0].factors.values()) == TOKEN_WIDTH
    assert np.allclose(emb.embed(projected), z, atol=1e-5)
    view, scale = module_view(tokenize(adapters, schema, emb.rank, spec), torch.arange(4), STEP_RANK_TOKENS, torch.Generator())
    assert sum(t.mask.shape[1] for t in view.values()) * emb.rank <= STEP_RANK_TOKENS and scale == 1000 / (STEP_RANK_TOKENS // emb.rank)


def test_widths_are_kept_while_an_adapters_tokens_are_small() -> None:
    """By default a space keeps full width while an adapter's full-width tokens fit FULL_WIDTH_TOKEN_BYTES (the
    reference zoos: all-MiniLM-L6, q/k/v/o and both MLP matrices, r16), and is projected past it (one Llama-3-8B
    layer at r16); a width named in the options is used as named."""
    minilm = SpaceSchema("minilm", tuple(sorted((f"layer.{i}.{n}", o, d) for i in range(6) for n, o, d in _MINILM)))
    llama = SpaceSchema("llama", tuple(sorted((f"layers.0.{n}", o, d) for n, (o, d) in _LLAMA.items())))
    assert 4 * 16 * sum(o + i for _, o, i in minilm.modules) <= FULL_WIDTH_TOKEN_BYTES < 4 * 16 * sum(o + i for _, o, i in llama.modules)
    assert token_spec(TrainOptions(), minilm, 16) == TokenSpec(0, 0, MAX_MODULE_TOKENS)
    assert token_spec(TrainOptions(), llama, 16) == TokenSpec(TOKEN_WIDTH, 0, MAX_MODULE_TOKENS)
    assert token_spec(TrainOptions(token_width=64, seed=3), minilm, 16) == TokenSpec(64, 3, MAX_MODULE_TOKENS)


_MINILM = [("query", 384, 384), ("key", 384, 384), ("value", 384, 384), ("attention.output.dense", 384, 384)]
_MINILM += [("intermediate.dense", 1536, 384), ("output.dense", 384, 1536)]
_LLAMA = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096)}
_LLAMA |= {"gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336)}


def _ingest(cli: CLI, kind: str, root: Path, layers: int) -> list[dict]:
    written = write_zoo(kind, root / kind, families=3, members=4, layers=layers)
    labels = root / f"{kind}.csv"
    labels.write_text("name,task\n" + "".join(f"{p.stem if p.suffix else p.name},f{f}\n" for p, f in written))
    rc, rows = cli.json_lines("ingest", "--no-embed", *[str(p) for p, _ in written], "--base-model", kind, "--labels", str(labels))
    assert rc == 0 and all(r["status"] == "ingested" for r in rows), rows
    return rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("db_url", "kind", "layers"),
    [("sqlite", "sdxl", 2), pytest.param("postgresql", "llama3-8b", 1, marks=pytest.mark.postgres)],
    indirect=["db_url"],
)  # the database's part (the checkpoint and the embeddings stored) is the same for both widths: each width on one
def test_zoo_train_on_real_widths_projects_and_round_trips(kind: str, layers: int, cli: CLI, tmp_path: Path) -> None:
    """`zoo train` on twelve real-width adapters: the checkpoint records its projection; the embeddings it made in
    training from the projected training set (its memory) are what the loaded checkpoint gives for the adapters'
    full factors, and what `zoo embed` stores; old checkpoints (no projection recorded) load at full width."""
    rows = _ingest(cli, kind, tmp_path, layers)
    rc, (report,) = cli.json_lines("train", "--space", kind, "--epochs", "2", "--members", "2", "--json")
    assert rc == 0 and report["n_adapters"] == 12, report
    checkpoint = Path(report["checkpoint"])
    meta = json.loads((checkpoint / META).read_text())
    config = meta["config"]
    assert (config["token_width"], config["projection_seed"], config["max_module_tokens"]) == (TOKEN_WIDTH, 0, MAX_MODULE_TOKENS)
    assert max(max(s) for s in meta["token_shapes"].values()) == TOKEN_WIDTH
    assert max(max(s) for s in config["type_shapes"].values()) > TOKEN_WIDTH  # real widths, projected
    loaded = W2TEnsemble.load(checkpoint, device="cpu")
    blobs = BlobStore(cli.settings.blob_dir)
    with session_factory(cli.settings.database_url)() as session:
        by_id = {r["adapter_id"]: dict(blobs.get_factors(str(session.get(Adapter, r["adapter_id"]).factors_blob))) for r in rows}
    memory = load_file(str(checkpoint / MEMORY))
    ids = memory["ids"].tolist()
    full = [ZooAdapter(i, str(i), by_id[i]) for i in ids]
    assert np.allclose(loaded.embed(full), memory["embedding"].numpy(), atol=1e-5)  # query-time projection = training's
    rc, _ = cli.json_lines("embed")
    assert rc == 0
    with session_factory(cli.settings.database_url)() as session:
        embedder = session.scalars(select(Embedder).where(Embedder.checkpoint.is_not(None), Embedder.active)).one()
        stored_ids, vectors = load_embeddings(session, embedder)
    at = {int(i): j for j, i in enumerate(stored_ids.tolist())}
    assert np.allclose(vectors[[at[i] for i in ids]], memory["embedding"].numpy(), atol=1e-5)  # what zoo embed stores
    # an old checkpoint: the same weights trained at full width, saved without the new config fields, loads and embeds
    old = train_w2t(
        [ZooAdapter(i, str(i), by_id[i], labels={"task": f"t{k % 3}"}) for k, i in enumerate(ids)],
        loaded.schema,
        TrainOptions(epochs=1, members=1, token_width=0, max_module_tokens=0),
        progress=False,
    )
    old.save(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / META).read_text())
    for key in ("token_width", "projection_seed", "max_module_tokens", "module_groups"):
        del meta["config"][key]
    del meta["token_shapes"]
    (tmp_path / "old" / META).write_text(json.dumps(meta))
    checkpoint_meta.cache_clear()
    again = W2TEnsemble.load(tmp_path / "old", device="cpu")
    assert again.config.tokens == TokenSpec() and token_shapes(again.schema, again.config.tokens) == again.config.type_shapes
    assert np.allclose(again.embed(full[:4]), old.embed(full[:4]), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the reader's projection, whatever the database
def test_the_training_set_is_read_projected_with_its_exact_scores(cli: CLI, tmp_path: Path) -> None:
    """read_training_set, a few adapters a chunk: tokens as tokenize makes them from the full factors, no factors kept;
    exact scores from a module stack as from the factors, and from module sketches close to them."""
    rows = _ingest(cli, "llama3-8b", tmp_path, layers=1)
    ids = [r["adapter_id"] for r in rows]
    sessions, blobs = session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir)
    with sessions() as session:
        full = load_adapters(session, blobs, "llama3-8b")
        schema = stored_schema(session, "llama3-8b")
        layout = module_layout(session, "llama3-8b", schema)
    assert schema == schema_of("llama3-8b", full)
    spec = TokenSpec(128, 3, 4)
    dense = {n for n, (o, i, r) in layout.items() if o * i <= 2 * r * (o + i)}
    exact = read_training_set(sessions, blobs, "llama3-8b", schema, ids, spec, 16, 5, (layout, dense))
    sketched = read_training_set(sessions, blobs, "llama3-8b", schema, ids, spec, 16, 5, None)
    want = tokenize(full, schema, 16, spec)
    for data in (exact, sketched):
        assert [a.id for a in data.adapters] == ids and all(not a.factors for a in data.adapters)
        assert all(torch.equal(data.tokens[t].u, want[t].u) and torch.equal(data.tokens[t].groups, want[t].groups) for t in want)
        assert max(t.u.shape[-1] for t in data.tokens.values()) == 128
    truth = ExactScores.of_factors(full)
    for score in EXACT_SCORES:
        assert np.allclose(exact.exact.among(ids)[score], truth.scores[score], atol=1e-5)
    assert sketched.exact.source == "module sketches"
    off = ~np.eye(len(ids), dtype=bool)
    assert np.corrcoef(sketched.exact.scores["module"][off], truth.scores["module"][off])[0, 1] > 0.9
