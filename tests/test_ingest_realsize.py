"""Deduplication of adapters at the real widths of public models (a block of each, zoo.reference.real_shapes):
the same update in another layout or factorization is found, a near one outside the tolerance is kept, and a
zoo dense in norms is searched for near duplicates without reading the factors of candidates that cannot be."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.numpy import save
from safetensors.torch import load_file, save_file
from sqlalchemy import select, update

from zoo.config import Settings
from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.fingerprint import DUPLICATE_RTOL, FINGERPRINT_DIM, SCREEN_SIGMAS, may_be_duplicate, relative_distance, sketch
from zoo.domain.kohya_names import model_path
from zoo.reference.real_shapes import MODELS, write_adapter
from zoo.services.ingest import IngestOptions, Ingestor
from zoo.store.blobs import MAPPED_FROM, BlobStore, BlobWriter, factor_arrays
from zoo.store.models import Adapter
from zoo.store.session import session_factory

PEFT_PREFIX = "base_model.model."
#: stem suffixes of the factor tensors of each layout (down/A, up/B)
SUFFIXES = {"peft": (".lora_A.weight", ".lora_B.weight"), "kohya": (".lora_down.weight", ".lora_up.weight"),
            "diffusers": (".lora_A.weight", ".lora_B.weight")}  # fmt: skip

#: one module's factors as the file holds them (conv kernels unflattened) and its alpha (None: alpha = rank)
Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float | None]]


class CountingBlobStore(BlobStore):
    """The real blob store, counting the candidates' factors it is asked to read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def get_factors(self, digest: str) -> list[tuple[str, CanonicalFactors]]:
        self.reads.append(digest)
        return super().get_factors(digest)


def make_ingestor(settings: Settings, base_model: str) -> tuple[Ingestor, CountingBlobStore]:
    blobs = CountingBlobStore(settings.blob_dir)
    return Ingestor(session_factory(settings.database_url), blobs, IngestOptions(base_model=base_model)), blobs


def read_factors(path: Path, layout: str) -> Factors:
    """Stem → (down/A, up/B, alpha) of a file written by real_shapes, read with safetensors (not zoo's readers)."""
    down, up = SUFFIXES[layout]
    if layout == "peft":
        tensors = load_file(str(path / "adapter_model.safetensors"))
        alpha = float(json.loads((path / "adapter_config.json").read_text())["lora_alpha"])
        return {k[len(PEFT_PREFIX) : -len(down)]: (v, tensors[k[: -len(down)] + up], alpha) for k, v in tensors.items() if k.endswith(down)}
    tensors = load_file(str(path))
    out: Factors = {}
    for k, v in tensors.items():
        if k.endswith(down):
            stem = k[: -len(down)]
            alpha = tensors.get(stem + ".alpha")
            out[stem] = (v, tensors[stem + up], None if alpha is None else float(alpha))
    return out


def write_peft(directory: Path, factors: Factors, base_model: str) -> Path:
    """A PEFT directory of the factors (one rank and alpha for all modules), float32."""
    ranks = {a.shape[0] for a, _, _ in factors.values()}
    alphas = {alpha if alpha is not None else float(a.shape[0]) for a, _, alpha in factors.values()}
    assert len(ranks) == 1 and len(alphas) == 1
    directory.mkdir(parents=True)
    tensors = {}
    for stem, (a, b, _) in factors.items():
        tensors[f"{PEFT_PREFIX}{stem}.lora_A.weight"] = a.float().contiguous()
        tensors[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = b.float().contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "base_model_name_or_path": base_model, "r": ranks.pop(), "lora_alpha": alphas.pop()}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def write_kohya(path: Path, factors: Factors) -> Path:
    """A kohya single file of the factors, with each module's alpha, float32."""
    tensors = {}
    for stem, (a, b, alpha) in factors.items():
        tensors[f"{stem}.lora_down.weight"] = a.float().contiguous()
        tensors[f"{stem}.lora_up.weight"] = b.float().contiguous()
        tensors[f"{stem}.alpha"] = torch.tensor(alpha if alpha is not None else float(a.shape[0]))
    save_file(tensors, str(path))
    return path


def transformed(factors: Factors, a_scale: float = 1.0, b_scale: float = 1.0, alpha_scale: float = 1.0) -> Factors:
    """The factors scaled in float32 (powers of two keep them exact; fp16's subnormals would not)."""
    return {
        stem: (a.float() * a_scale, b.float() * b_scale, (alpha if alpha is not None else float(a.shape[0])) * alpha_scale)
        for stem, (a, b, alpha) in factors.items()
    }


def noisy(factors: Factors, relative: float, seed: int) -> Factors:
    """B of every module with Gaussian noise of `relative` times its RMS per entry."""
    g = torch.Generator().manual_seed(seed)
    out: Factors = {}
    for stem, (a, b, alpha) in factors.items():
        b = b.float()
        out[stem] = (a, b + relative * b.pow(2).mean().sqrt() * torch.randn(b.shape, generator=g), alpha)
    return out


def in_other_layout(factors: Factors, layout: str, path: Path, base_model: str) -> Path:
    """The factors in the other family of layouts: a PEFT directory as a kohya file, a single file as a PEFT directory
    (its kohya names as the model paths a converter gives them)."""
    if layout == "peft":
        return write_kohya(path.with_suffix(".safetensors"), factors)
    return write_peft(path, {model_path(name) or name: f for name, f in factors.items()}, base_model)


def update_norm(factors: Factors) -> float:
    """||dW||_F over all modules, from the factors in float64 (tr((BᵀB)(AAᵀ)) per module)."""
    total = 0.0
    for a, b, alpha in factors.values():
        a2, b2 = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
        scale = (alpha if alpha is not None else a2.shape[0]) / a2.shape[0]
        total += scale**2 * float(((b2.T @ b2) * (a2 @ a2.T)).sum())
    return math.sqrt(total)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_real_width_adapters_are_found_again_in_another_layout_and_factorization(kind: str, settings: Settings, tmp_path: Path) -> None:
    """One block of each model: the same update as A·4 and B/4 in the other layout, or with alpha doubled and B halved,
    is the stored adapter; a copy 1e-5 away is too (confirmed by its factors, read because its probe values cannot rule
    it out, when its canonical hash differs); a copy 1e-2 away (ten times the tolerance) is another adapter."""
    model = MODELS[kind]
    path = write_adapter(kind, tmp_path / "written", family=0, member=0, layers=1)
    factors = read_factors(path, model.layout)
    ingestor, blobs = make_ingestor(settings, model.base_model)
    first = ingestor.ingest(path)
    assert first.status == "ingested", first.error

    variants = {
        "rescaled": in_other_layout(transformed(factors, a_scale=4.0, b_scale=0.25), model.layout, tmp_path / "rescaled", model.base_model),
        "alpha": write_kohya(tmp_path / "alpha.safetensors", transformed(factors, b_scale=0.5, alpha_scale=2.0)),
    }
    for name, variant in variants.items():
        again = ingestor.ingest(variant)
        assert (again.status, again.adapter_id) == ("duplicate", first.adapter_id), (name, again.error)

    with session_factory(settings.database_url)() as s, s.begin():  # as if a copy's hash rounded the other way
        s.execute(update(Adapter).where(Adapter.id == first.adapter_id).values(canonical_hash="f" * 64))
    near = ingestor.ingest(write_kohya(tmp_path / "near.safetensors", noisy(factors, 1e-5, seed=1)))
    assert (near.status, near.adapter_id) == ("duplicate", first.adapter_id), near.error
    assert len(blobs.reads) == 1  # the one candidate, not ruled out by its probe values: read and confirmed

    far = ingestor.ingest(write_kohya(tmp_path / "far.safetensors", noisy(factors, 1e-2, seed=2)))
    assert far.status == "ingested" and far.adapter_id != first.adapter_id, far.error
    with session_factory(settings.database_url)() as s:
        stored = s.execute(select(Adapter.dw_norm, Adapter.dw_probes)).all()
    assert len(stored) == 2 and all(isinstance(raw, list) and len(raw) == FINGERPRINT_DIM for _, raw in stored)


def test_a_dense_norm_window_is_searched_without_reading_candidates_factors(settings: Settings, tmp_path: Path) -> None:
    """Llama-3-8B-wide adapters (one layer) rescaled to one norm: each new one has every stored one as a near-duplicate
    candidate and reads none of their factors; a copy of one (its hash made to differ) reads its original's factors
    only. Without stored probe values (adapters from before migration 0010) every candidate is read, as before."""
    model = MODELS["llama3-8b"]
    count = 8
    paths = []
    for i in range(count + 1):
        factors = read_factors(write_adapter("llama3-8b", tmp_path / "written", family=i % 3, member=i, layers=1), "peft")
        paths.append(write_peft(tmp_path / f"dense{i}", transformed(factors, b_scale=1.0 / update_norm(factors)), model.base_model))
    ingestor, blobs = make_ingestor(settings, model.base_model)
    for p in paths[:count]:
        assert ingestor.ingest(p).status == "ingested"
    with session_factory(settings.database_url)() as s:
        norms = s.scalars(select(Adapter.dw_norm)).all()
    assert len(norms) == count and max(norms) / min(norms) < 1 + 1e-5  # all within one duplicate window (1e-3 wide)
    assert blobs.reads == []

    with session_factory(settings.database_url)() as s, s.begin():
        original = s.scalars(select(Adapter).where(Adapter.name == "dense3")).one()
        original.canonical_hash = "f" * 64  # as if the copy's hash rounded the other way
    copy = ingestor.ingest(write_kohya(tmp_path / "copy.safetensors", noisy(read_factors(paths[3], "peft"), 1e-6, seed=3)))
    assert (copy.status, copy.adapter_id) == ("duplicate", original.id), copy.error
    assert blobs.reads == [original.factors_blob]

    with session_factory(settings.database_url)() as s, s.begin():  # as stored before migration 0010
        s.execute(update(Adapter).values(dw_probes=None))
    assert ingestor.ingest(paths[count]).status == "ingested"
    assert len(blobs.reads) == 1 + count  # every stored candidate read and found different


def random_factors(seed: int, out: int, inp: int, rank: int) -> CanonicalFactors:
    g = torch.Generator().manual_seed(seed)
    return canonicalize(torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g))


def test_the_screen_keeps_duplicates_at_the_tolerance_and_rules_out_different_updates() -> None:
    """x + D for rank-1 D (the heaviest tail of a probe difference) of norm exactly the tolerance is never ruled out
    over 300 draws of probes (module names); of norm ||x|| it always is; stored values that are missing or malformed
    rule out nothing."""
    for trial in range(300):
        name = f"layers.{trial}.q_proj"
        x = random_factors(trial, 40, 32, 4)
        g = torch.Generator().manual_seed(10_000 + trial)
        u, v = torch.randn(40, 1, generator=g), torch.randn(32, 1, generator=g)
        for size, duplicate in ((DUPLICATE_RTOL, True), (1.0, False)):
            c = size * float(x.S.double().norm()) / float(u.norm() * v.norm())
            y = canonicalize(torch.cat([x.S[:, None] * x.V.T, v.T]), torch.cat([x.U, c * u], dim=1))
            assert (relative_distance([(name, x)], [(name, y)]) <= DUPLICATE_RTOL * (1 + 1e-3)) == duplicate
            sx, sy = sketch([(name, x)]), sketch([(name, y)])
            assert may_be_duplicate(sx, sy.raw, sy.norm) == duplicate, (trial, size)
    sx = sketch([("m", random_factors(0, 8, 8, 2))])
    unknown = ([], None, [math.nan] * FINGERPRINT_DIM, ["1"] * FINGERPRINT_DIM, [True] * FINGERPRINT_DIM, [0.0] * (FINGERPRINT_DIM - 1))
    assert all(may_be_duplicate(sx, stored, sx.norm) for stored in unknown)
    assert may_be_duplicate(sx, [1e9] * FINGERPRINT_DIM, None)
    assert not may_be_duplicate(sx, [v + 2 * SCREEN_SIGMAS * DUPLICATE_RTOL * sx.norm for v in sx.raw], sx.norm)


@settings(max_examples=40, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True), seed=st.integers(0, 99))
def test_a_staged_blob_has_the_bytes_safetensors_writes(names: list[str], seed: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The blob ingest writes from the factors' memory is byte for byte safetensors.numpy.save's (so a digest does not
    depend on the writer), under the SHA-256 of those bytes, and loads back to the same factors."""
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(5, 2, generator=g), torch.rand(2, generator=g), torch.randn(3, 2, generator=g)) for _ in names]
    modules = [(n, CanonicalFactors(*p)) for n, p in zip(names, parts, strict=True)]
    store = BlobStore(tmp_path_factory.mktemp("blobs"))
    staged = store.stage_factors(modules)
    expected = save(factor_arrays(modules))
    assert staged.tmp.read_bytes() == expected and staged.size == len(expected)
    assert staged.digest == hashlib.sha256(expected).hexdigest()
    store.commit(staged)
    assert not staged.tmp.exists() and store.path(staged.digest).read_bytes() == expected
    back = dict(store.get_factors(staged.digest))
    assert all(torch.equal(back[n].U, f.U) and torch.equal(back[n].S, f.S) and torch.equal(back[n].V, f.V) for n, f in modules)
    shutil.rmtree(store.root)


@pytest.mark.parametrize("rows", [8, 40_000])
def test_a_blob_read_whole_or_mapped_loads_back_and_a_truncated_one_is_refused(rows: int, tmp_path: Path) -> None:
    """Blobs under MAPPED_FROM bytes are read whole, larger ones through a memory map: both load back the factors
    stored, and a truncated blob of either size raises what `zoo export` reports (SafetensorError)."""
    g = torch.Generator().manual_seed(rows)
    parts = [(torch.randn(rows, 4, generator=g), torch.rand(4, generator=g), torch.randn(6, 4, generator=g)) for _ in range(2)]
    modules = [(f"m{i}", CanonicalFactors(*p)) for i, p in enumerate(parts)]
    store = BlobStore(tmp_path)
    staged = store.stage_factors(modules)
    store.commit(staged)
    assert (staged.size >= MAPPED_FROM) == (rows > 8)
    back = dict(store.get_factors(staged.digest))
    assert all(torch.equal(back[n].U, f.U) and torch.equal(back[n].S, f.S) and torch.equal(back[n].V, f.V) for n, f in modules)
    path = store.path(staged.digest)
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[: staged.size // 2])
    with pytest.raises(SafetensorError):
        store.get(staged.digest)


def test_a_blob_writer_commits_or_leaves_nothing_and_reports_its_errors(tmp_path: Path) -> None:
    """A discarded writer leaves no file whether or not it had finished; a committed blob stays; a writer that cannot
    write raises its error where its digest is asked for."""
    modules = [(f"m{i}", random_factors(i, 300, 200, 8)) for i in range(40)]
    store = BlobStore(tmp_path / "blobs")
    early = BlobWriter(store, modules)
    early.discard()
    finished = BlobWriter(store, modules)
    finished.staged()
    finished.discard()
    assert [p for p in store.root.rglob("*") if p.is_file()] == []
    kept = BlobWriter(store, modules)
    store.commit(kept.staged())
    kept.discard()
    assert [p for p in store.root.rglob("*") if p.is_file()] == [store.path(kept.digest())]
    (tmp_path / "a file").write_text("not a directory")
    failing = BlobWriter(BlobStore(tmp_path / "a file"), modules)
    with pytest.raises(OSError):
        failing.digest()
    failing.discard()
