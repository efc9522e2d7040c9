"""The ingest pipeline against real databases: one transaction per adapter, dedup, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select, text

from tests.factories import train_peft_adapter, write_kohya_file
from zoo.config import Settings
from zoo.domain.canonical import canonicalize
from zoo.domain.fingerprint import DUPLICATE_RTOL, relative_distance
from zoo.formats import AdapterData, LoraModule, read_adapter
from zoo.labels import LabelRow
from zoo.services.ingest import IngestOptions, Ingestor, ingest_source
from zoo.services.threads import SMALL_ADAPTER_ELEMENTS, small_work_on_one_thread
from zoo.sources import Origin
from zoo.store.blobs import BlobStore
from zoo.store.locks import norm_window, store_locks
from zoo.store.models import Adapter, AdapterText, Label, Measurement, Module
from zoo.store.repository import NEAR_DUPLICATE_LIMIT, duplicate_candidates
from zoo.store.search_text import refresh_search_text
from zoo.store.session import make_engine, session_factory


def make_ingestor(settings: Settings, **options: object) -> Ingestor:
    return Ingestor(session_factory(settings.database_url), BlobStore(settings.blob_dir), IngestOptions(**options))


def row_counts(settings: Settings) -> tuple[int, int]:
    with session_factory(settings.database_url)() as s:
        return s.scalar(select(func.count(Adapter.id))), s.scalar(select(func.count(Module.id)))


def blob_files(settings: Settings) -> list[Path]:
    return sorted(settings.blob_dir.rglob("*.safetensors")) if settings.blob_dir.exists() else []


def refactorize(src: Path, dst: Path, seed: int) -> None:
    """The same update in another factorization: B·G and G⁻¹·A per module."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith("lora_A.weight")]:
        b_key = key.replace("lora_A", "lora_B")
        r = tensors[key].shape[0]
        G = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))[0] * torch.linspace(1, 3, r, dtype=torch.float64)
        tensors[b_key] = (tensors[b_key].double() @ G).float()
        tensors[key] = (torch.linalg.inv(G) @ tensors[key].double()).float()
    save_file(tensors, str(dst / "adapter_model.safetensors"))


def test_ingest_stores_adapter_modules_spectra_and_factors(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a", targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    result = make_ingestor(settings, base_model="tiny-lm").ingest(tmp_path / "a")
    assert result.status == "ingested", result.error
    with session_factory(settings.database_url)() as s:
        a = s.get(Adapter, result.adapter_id)
        assert a.base_model == "tiny-lm" and a.format == "peft" and a.rank == 4 and a.alpha == 8
        assert a.canonical_hash == result.canonical_hash
        mods = {m.name: m for m in a.modules}
        assert len(mods) == 8
        q = mods["layers.1.q_proj"]
        assert (q.layer_index, q.module_type, q.out_features, q.in_features, q.rank) == (1, "q_proj", 16, 16, 4)
        stored = dict(BlobStore(settings.blob_dir).get_factors(a.factors_blob))
    data = read_adapter(tmp_path / "a")
    m = next(m for m in data.modules if m.name == "layers.1.q_proj")
    ref = canonicalize(m.A, m.B, m.scale)
    assert q.singular_values == pytest.approx(ref.S.tolist(), rel=1e-4)
    assert q.spectral_norm == pytest.approx(float(ref.S[0]), rel=1e-4)
    assert torch.allclose(stored["layers.1.q_proj"].delta(), ref.delta(), atol=1e-5)


def test_refactorized_copy_is_a_duplicate(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a", seed=1)
    refactorize(tmp_path / "a", tmp_path / "b", seed=7)
    assert read_adapter(tmp_path / "b").modules[0].A.sum() != read_adapter(tmp_path / "a").modules[0].A.sum()
    ingestor = make_ingestor(settings)
    first = ingestor.ingest(tmp_path / "a")
    blobs_before = blob_files(settings)
    second = ingestor.ingest(tmp_path / "b")
    assert (first.status, second.status) == ("ingested", "duplicate")
    assert second.adapter_id == first.adapter_id
    assert row_counts(settings)[0] == 1
    assert blob_files(settings) == blobs_before  # the duplicate's blob was not kept
    third = ingestor.ingest(tmp_path / "a")
    assert (third.status, third.adapter_id, third.canonical_hash) == ("duplicate", first.adapter_id, first.canonical_hash)


def test_different_adapters_are_not_duplicates(settings: Settings, tmp_path: Path) -> None:
    ingestor = make_ingestor(settings)
    ids = set()
    for seed in range(3):
        train_peft_adapter(tmp_path / f"a{seed}", seed=seed)
        r = ingestor.ingest(tmp_path / f"a{seed}")
        assert r.status == "ingested"
        ids.add(r.adapter_id)
    assert len(ids) == 3


def test_same_update_under_another_base_model_is_kept(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a")
    assert make_ingestor(settings, base_model="m1").ingest(tmp_path / "a").status == "ingested"
    assert make_ingestor(settings, base_model="m2").ingest(tmp_path / "a").status == "ingested"


def test_bad_inputs_fail_and_write_nothing(settings: Settings, tmp_path: Path) -> None:
    good = tmp_path / "good"
    train_peft_adapter(good)
    truncated = tmp_path / "trunc.safetensors"
    write_kohya_file(truncated)
    truncated.write_bytes(truncated.read_bytes()[:-64])
    nan_dir = tmp_path / "nan"
    shutil.copytree(good, nan_dir)
    tensors = load_file(str(nan_dir / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(nan_dir / "adapter_model.safetensors"))

    ingestor = make_ingestor(settings)
    results = [ingest_source(ingestor, str(p)) for p in (truncated, nan_dir, tmp_path / "missing", good)]
    assert [r.status for r in results] == ["failed", "failed", "failed", "ingested"]
    assert "trunc.safetensors: truncated" in results[0].error
    assert "contains NaN or Inf" in results[1].error and str(nan_dir) in results[1].error
    assert "no such file or directory" in results[2].error
    assert row_counts(settings)[0] == 1
    assert len(blob_files(settings)) == 1


def _fail_inserts_of_module(url: str, name: str) -> None:
    """A real database-side failure half-way through an adapter's rows (after its adapter row)."""
    with make_engine(url).begin() as conn:
        if url.startswith("sqlite"):
            conn.execute(
                text(
                    f"CREATE TRIGGER fail_module BEFORE INSERT ON module WHEN NEW.name = '{name}' "
                    "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION fail_module() RETURNS trigger AS $$ BEGIN "
                    f"IF NEW.name = '{name}' THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(text("DROP TRIGGER IF EXISTS fail_module ON module"))
            conn.execute(text("CREATE TRIGGER fail_module BEFORE INSERT ON module FOR EACH ROW EXECUTE FUNCTION fail_module()"))


def _drop_failure(url: str) -> None:
    with make_engine(url).begin() as conn:
        conn.execute(text("DROP TRIGGER IF EXISTS fail_module" + ("" if url.startswith("sqlite") else " ON module")))


def test_failed_database_write_leaves_no_rows_and_no_blob(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a")
    _fail_inserts_of_module(settings.database_url, "layers.1.v_proj")
    try:
        failed = make_ingestor(settings).ingest(tmp_path / "a")
        assert failed.status == "failed" and "injected failure" in failed.error and str(tmp_path / "a") in failed.error
        assert row_counts(settings) == (0, 0)
        assert blob_files(settings) == []
    finally:
        _drop_failure(settings.database_url)
    assert make_ingestor(settings).ingest(tmp_path / "a").status == "ingested"


def test_kohya_and_checkpoints(settings: Settings, tmp_path: Path) -> None:
    write_kohya_file(tmp_path / "k.safetensors")
    g = torch.Generator().manual_seed(0)
    base = {"l.weight": torch.randn(32, 24, generator=g)}
    tuned = {"l.weight": base["l.weight"] + torch.randn(32, 2, generator=g) @ torch.randn(2, 24, generator=g)}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(tuned, str(tmp_path / "tuned.safetensors"))
    plain = make_ingestor(settings)
    k = plain.ingest(tmp_path / "k.safetensors")
    assert k.status == "ingested"
    full = plain.ingest(tmp_path / "tuned.safetensors")
    assert full.status == "ingested"
    delta = make_ingestor(settings, base_checkpoint=tmp_path / "base.safetensors").ingest(tmp_path / "tuned.safetensors")
    assert delta.status == "ingested" and "low-rank deltas" in delta.notes[0]
    with session_factory(settings.database_url)() as s:
        assert s.get(Adapter, k.adapter_id).base_model == "sd-v1-5"
        f = s.get(Adapter, full.adapter_id)
        assert f.format == "checkpoint" and f.factors_blob is None
        assert f.modules[0].kind == "full" and f.modules[0].power_law_alpha is not None
        d = s.get(Adapter, delta.adapter_id)
        assert d.format == "checkpoint-delta" and d.modules[0].canonical_rank == 2
    assert plain.ingest(tmp_path / "tuned.safetensors").status == "duplicate"


def test_duplicate_check_tolerance(settings: Settings, tmp_path: Path) -> None:
    """A copy with a 1% perturbation is a different adapter; one at 1e-5 is the same."""
    train_peft_adapter(tmp_path / "a", seed=3)
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    for eps, name in ((1e-2, "far"), (1e-5, "near")):
        shutil.copytree(tmp_path / "a", tmp_path / name)
        noisy = {k: v * (1 + eps * torch.randn_like(v)) if "lora_B" in k else v for k, v in tensors.items()}
        save_file(noisy, str(tmp_path / name / "adapter_model.safetensors"))
    x = read_adapter(tmp_path / "a")
    y = read_adapter(tmp_path / "near")
    fx = [(m.name, canonicalize(m.A, m.B, m.scale)) for m in x.modules]
    fy = [(m.name, canonicalize(m.A, m.B, m.scale)) for m in y.modules]
    assert relative_distance(fx, fy) < 1e-4
    ingestor = make_ingestor(settings)
    first = ingestor.ingest(tmp_path / "a")
    assert ingestor.ingest(tmp_path / "far").status == "ingested"
    near = ingestor.ingest(tmp_path / "near")
    assert (near.status, near.adapter_id) == ("duplicate", first.adapter_id)


def stored_labels(settings: Settings, adapter_id: int) -> tuple[dict[str, str], dict[str, float], str]:
    """Given labels, test measurements and the search document of an adapter."""
    with make_engine(settings.database_url).connect() as c:
        labels = dict(c.execute(select(Label.key, Label.value).where(Label.adapter_id == adapter_id, Label.source == "given")).all())
        measured = dict(c.execute(select(Measurement.metric, Measurement.value).where(Measurement.adapter_id == adapter_id)).all())
        document = c.execute(select(AdapterText.document).where(AdapterText.adapter_id == adapter_id)).scalar_one()
    return labels, measured, document


def test_stored_files_are_duplicates_before_any_math_and_get_their_labels(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a", seed=2)
    ingestor = make_ingestor(settings)
    first = ingestor.ingest(tmp_path / "a", labels=LabelRow({"task": "qv"}, {"test_accuracy": 0.5}))
    assert first.status == "ingested" and set(first.timings) == {"read", "canonicalize", "describe", "store"}
    with session_factory(settings.database_url)() as s:
        assert (
            s.get(Adapter, first.adapter_id).file_sha256
            == hashlib.sha256((tmp_path / "a" / "adapter_model.safetensors").read_bytes()).hexdigest()
        )
    shutil.copytree(tmp_path / "a", tmp_path / "copy")  # the same files elsewhere: found by their SHA-256
    again = ingestor.ingest(tmp_path / "copy", labels=LabelRow({"task": "qk", "style": "terse"}, {"test_accuracy": 0.75}))
    assert (again.status, again.adapter_id, again.canonical_hash, again.name) == (
        "duplicate",
        first.adapter_id,
        first.canonical_hash,
        "copy",
    )
    assert set(again.timings) == {"read", "store"}  # nothing was canonicalized
    labels, measured, document = stored_labels(settings, first.adapter_id)
    assert labels == {"task": "qk", "style": "terse"} and measured == {"test_accuracy": 0.75}
    assert "task qk" in document and "style terse" in document
    assert row_counts(settings)[0] == 1
    with make_engine(settings.database_url).connect() as c:
        label_ids = c.execute(select(Label.id).order_by(Label.id)).scalars().all()
    unchanged = ingestor.ingest(tmp_path / "a", labels=LabelRow({"task": "qk"}, {"test_accuracy": 0.75}))
    assert (unchanged.status, unchanged.adapter_id) == ("duplicate", first.adapter_id)
    with make_engine(settings.database_url).connect() as c:  # labels it has already are not written again
        assert c.execute(select(Label.id).order_by(Label.id)).scalars().all() == label_ids

    # what the update depends on besides the weights is compared too: the same weights at another alpha are
    # another update, and under another base model another adapter
    shutil.copytree(tmp_path / "a", tmp_path / "alpha")
    config = json.loads((tmp_path / "alpha" / "adapter_config.json").read_text())
    (tmp_path / "alpha" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    other = ingestor.ingest(tmp_path / "alpha")
    assert other.status == "ingested" and "canonicalize" in other.timings
    assert make_ingestor(settings, base_model="elsewhere").ingest(tmp_path / "a").status == "ingested"
    # a stored adapter deleted meanwhile is not answered from its hash
    with session_factory(settings.database_url)() as s, s.begin():
        s.delete(s.get(Adapter, other.adapter_id))
    assert ingestor.ingest(tmp_path / "alpha").status == "ingested"


def test_kohya_files_and_checkpoints_are_recognized_by_their_hash(settings: Settings, tmp_path: Path) -> None:
    write_kohya_file(tmp_path / "k.safetensors")
    g = torch.Generator().manual_seed(0)
    base = {"l.weight": torch.randn(32, 24, generator=g)}
    save_file({"l.weight": base["l.weight"] + torch.randn(32, 24, generator=g) * 0.01}, str(tmp_path / "tuned.safetensors"))
    save_file(base, str(tmp_path / "base.safetensors"))
    plain = make_ingestor(settings)
    for name in ("k.safetensors", "tuned.safetensors"):
        first = plain.ingest(tmp_path / name)
        again = plain.ingest(tmp_path / name)
        assert (again.status, again.adapter_id, set(again.timings)) == ("duplicate", first.adapter_id, {"read", "store"}), name
    # with a base, a stored full checkpoint is not the low-rank delta the same file now gives
    delta = make_ingestor(settings, base_checkpoint=tmp_path / "base.safetensors").ingest(tmp_path / "tuned.safetensors")
    assert delta.status == "ingested" and "low-rank deltas" in delta.notes[0]


def test_a_near_duplicate_is_found_among_many_adapters_of_close_norm(settings: Settings, tmp_path: Path) -> None:
    """The near-duplicate check reads a few candidates of the closest norms (repository.NEAR_DUPLICATE_LIMIT a side),
    and still finds a re-factorized copy whose canonical hash differs (as it can at a rounding boundary) among
    more adapters of the same structure and base, within the tolerance on both sides of its norm."""
    train_peft_adapter(tmp_path / "a", seed=4)
    refactorize(tmp_path / "a", tmp_path / "b", seed=9)
    ingestor = make_ingestor(settings)
    first = ingestor.ingest(tmp_path / "a")
    decoys = 3 * NEAR_DUPLICATE_LIMIT
    with session_factory(settings.database_url)() as s, s.begin():
        a = s.get(Adapter, first.adapter_id)
        a.canonical_hash = "f" * 64  # as if the copy's hash rounded the other way
        norm, structure, base = a.dw_norm, a.structure_hash, a.base_model  # the space of its shapes: no base is named
        for i in range(decoys):  # norms closer to the copy's than the tolerance, on both sides, but never closer than a's
            side = 1 if i % 2 else -1
            s.add(Adapter(name=f"decoy{i}", source_uri=f"decoy{i}", base_model=base, format="peft", canonical_hash=f"{i:064d}",
                          structure_hash=structure, dw_norm=norm * (1 + side * (i + 1) * DUPLICATE_RTOL / (decoys + 2)),
                          file_sha256=f"{i:064d}", size_bytes=1, factors_blob=a.factors_blob))  # fmt: skip
    with session_factory(settings.database_url)() as s:
        found = duplicate_candidates(s, base, "1" * 64, structure, norm, DUPLICATE_RTOL)
    assert len(found) == 2 * NEAR_DUPLICATE_LIMIT and found[0].id == first.adapter_id
    gaps = [abs(c.dw_norm - norm) for c in found]
    assert gaps == sorted(gaps)
    copy = ingestor.ingest(tmp_path / "b")
    assert (copy.status, copy.adapter_id) == ("duplicate", first.adapter_id)
    with session_factory(settings.database_url)() as s:  # an exact hash comes first, however far its norm
        farthest = s.scalars(select(Adapter.id).where(Adapter.name == f"decoy{decoys - 1}")).one()
        assert duplicate_candidates(s, base, f"{decoys - 1:064d}", structure, norm, DUPLICATE_RTOL)[0].id == farthest


@given(norm=st.floats(1e-30, 1e30), t=st.floats(0.0, 1.0))
def test_writers_of_updates_within_the_tolerance_share_a_lock(norm: float, t: float) -> None:
    low, high = norm_window(norm, DUPLICATE_RTOL)
    other = low + t * (high - low)
    mine, theirs = store_locks("b", "s", norm, DUPLICATE_RTOL), store_locks("b", "s", other, DUPLICATE_RTOL)
    assert set(mine) & set(theirs) and len(mine) <= 3
    assert not set(mine) & set(store_locks("b", "s", norm * 1.01, DUPLICATE_RTOL))  # far apart: stored at once
    assert not set(mine) & set(store_locks("b", "other structure", norm, DUPLICATE_RTOL))


def test_a_new_adapters_search_document_is_the_one_refresh_writes(settings: Settings, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a")
    origin = Origin("hf://someone/a-repo", "abc123", author="someone", license="mit", tags=["lora", "Ünïcode"],
                    card="# A card\nabout digits", metadata={"datasets": ["mnist"], "pipeline_tag": "image-classification"})  # fmt: skip
    result = make_ingestor(settings).ingest(tmp_path / "a", labels=LabelRow({"task": "qv"}, {"test_accuracy": 0.5}), origin=origin)
    assert result.status == "ingested", result.error
    labels, _, written = stored_labels(settings, result.adapter_id)
    assert labels == {"task": "qv", "dataset": "mnist"}
    with session_factory(settings.database_url)() as s, s.begin():
        refresh_search_text(s, [result.adapter_id])
    assert stored_labels(settings, result.adapter_id)[2] == written
    assert all(word in written.split() for word in ("someone", "mnist", "unicode", "qv", "digits"))


def test_small_adapters_are_described_on_one_thread(tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "a")
    small = read_adapter(tmp_path / "a")
    wide = LoraModule("m", torch.zeros(8, SMALL_ADAPTER_ELEMENTS // 8), torch.zeros(8, 8), alpha=8.0, scale=1.0)
    big = AdapterData(tmp_path, "peft", [], modules=[wide])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for data, inside in ((small, 1), (big, 2)):
            with small_work_on_one_thread(data):
                assert torch.get_num_threads() == inside
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
