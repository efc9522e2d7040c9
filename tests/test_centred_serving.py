"""The centred input Gram served (zoo/domain/centred_gram.py): `zoo train` keeps the reference it fitted on the
space's adapters, labelled or not, in its checkpoint, and a space whose search weighs the centred Gram scores each
result by it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import delete, select

from embed.serving.engine import QueryEngine
from embed.serving.results import Query
from embed.w2t.checkpoint import GRAM_REFERENCE, META
from embed.w2t.ensemble import W2TEnsemble
from tests.conftest import copy_seeded
from zoo.cli import main
from zoo.config import Settings
from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, fit_gram_reference
from zoo.domain.exact_scores import exact_cosines
from zoo.domain.similarity import ModuleStack, dense_modules
from zoo.errors import NotReadyError
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter, Label, Measurement
from zoo.store.session import session_factory


def _engine_and_checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[QueryEngine, Settings, Path]:
    zoo = copy_seeded(request, "sqlite", tmp_path)
    settings = Settings.load(zoo.url, zoo.data_dir)
    engine = QueryEngine(session_factory(settings.database_url), BlobStore(settings.blob_dir), settings.data_dir)
    with session_factory(settings.database_url)() as session:
        checkpoint = settings.data_dir / str(engine.space(session, "tiny").embedders["w2t"].checkpoint)
    return engine, settings, checkpoint


def _serve(checkpoint: Path, search: str) -> None:
    """Make the checkpoint serve `search` as hybrid (its choice on another zoo)."""
    meta = json.loads((checkpoint / META).read_text())
    (checkpoint / META).write_text(json.dumps({**meta, "search": search}))


def _factors(settings: Settings, ids: list[int]) -> list[dict]:
    blobs = BlobStore(settings.blob_dir)
    with session_factory(settings.database_url)() as session:
        return [dict(blobs.get_factors(str(session.get(Adapter, i).factors_blob))) for i in ids]


def _space_ids(settings: Settings) -> list[int]:
    with session_factory(settings.database_url)() as session:
        return sorted(session.scalars(select(Adapter.id)).all())


def _assert_reference_of(emb: W2TEnsemble, adapters: list[dict]) -> None:
    """The checkpoint's reference is the mean unit input Gram of `adapters` (fewer than 128: all of them)."""
    fitted = fit_gram_reference(ModuleStack.of(adapters, dense_modules(adapters)), range(len(adapters)))
    assert emb.gram_reference is not None and set(emb.gram_reference.modules) == set(fitted.modules)
    for name, (Q, lam) in fitted.modules.items():
        kept_Q, kept_lam = emb.gram_reference.modules[name]
        np.testing.assert_allclose(kept_lam, lam, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose((kept_Q.T * kept_lam) @ kept_Q, (Q.T * lam) @ Q, atol=1e-5)


def test_zoo_train_fits_the_reference_on_every_adapter_of_the_space_labelled_or_not(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """With the labels and measurements of half the seeded zoo taken away, `zoo train` still fits the centred Gram's
    reference on all 12 adapters: no label shapes it, and the unlabelled ones are as much the space's."""
    zoo = copy_seeded(request, "sqlite", tmp_path)
    settings = Settings.load(zoo.url, zoo.data_dir)
    ids = _space_ids(settings)
    unlabelled = ids[::2]
    with session_factory(settings.database_url)() as session, session.begin():
        session.execute(delete(Label).where(Label.adapter_id.in_(unlabelled)))
        session.execute(delete(Measurement).where(Measurement.adapter_id.in_(unlabelled)))
    rc = main(["--db", zoo.url, "--data-dir", str(zoo.data_dir), "train", "--space", "tiny", "--epochs", "2"])
    assert rc == 0
    with session_factory(settings.database_url)() as session:
        engine = QueryEngine(session_factory(settings.database_url), BlobStore(settings.blob_dir), settings.data_dir)
        checkpoint = settings.data_dir / str(engine.space(session, "tiny").embedders["w2t"].checkpoint)
    emb = W2TEnsemble.load(checkpoint)
    assert sorted(int(i) for i in emb.memory_ids) == ids[1::2]  # the memory: the labelled half
    everyone, labelled = _factors(settings, ids), _factors(settings, ids[1::2])
    _assert_reference_of(emb, everyone)
    with pytest.raises(AssertionError):  # the test tells the space's reference from the labelled half's
        _assert_reference_of(emb, labelled)


def _hybrid_top_8(engine: QueryEngine, settings: Settings) -> tuple[np.ndarray, ModuleStack, ModuleStack]:
    """Hybrid's scores of the first adapter's 8 nearest (checked in order, without it), and their and its stacks."""
    with session_factory(settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("w01", 1), 8, method="hybrid")
    ids = [r["adapter_id"] for r in found["results"]]
    scores = np.array([r["score"] for r in found["results"]])
    assert np.all(np.diff(scores) <= 1e-9) and len(ids) == 8 and 1 not in ids
    query, gallery = _factors(settings, [1]), _factors(settings, ids)
    layout = dense_modules(query + gallery)
    return scores, ModuleStack.of(gallery, layout), ModuleStack.of(query, layout)


def test_hybrid_search_by_the_centred_gram_scores_each_result_on_the_trained_reference(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    engine, settings, checkpoint = _engine_and_checkpoint(request, tmp_path)
    assert (checkpoint / GRAM_REFERENCE).exists()
    _serve(checkpoint, "centred_gram")  # before anything reads the checkpoint's metadata, which is cached
    emb = W2TEnsemble.load(checkpoint)
    _assert_reference_of(emb, _factors(settings, _space_ids(settings)))

    scores, gallery, query = _hybrid_top_8(engine, settings)
    np.testing.assert_allclose(scores, exact_cosines(gallery, query, CENTRED_GRAM, emb.gram_reference)[0], atol=1e-5)
    plain = exact_cosines(gallery, query, "input_gram")[0]
    assert not np.allclose(plain, scores, atol=1e-3)  # the test tells the centred Gram from the plain one


def test_hybrid_search_by_module_and_centred_gram_serves_their_mean(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    engine, settings, checkpoint = _engine_and_checkpoint(request, tmp_path)
    _serve(checkpoint, MODULE_CENTRED)
    emb = W2TEnsemble.load(checkpoint)
    scores, gallery, query = _hybrid_top_8(engine, settings)
    parts = [exact_cosines(gallery, query, s, emb.gram_reference)[0] for s in ("module", CENTRED_GRAM)]
    np.testing.assert_allclose(scores, (parts[0] + parts[1]) / 2, atol=1e-5)
    assert not np.allclose(scores, parts[0], atol=1e-3) and not np.allclose(scores, parts[1], atol=1e-3)


def test_a_checkpoint_without_a_reference_says_to_train_again(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    engine, settings, checkpoint = _engine_and_checkpoint(request, tmp_path)
    (checkpoint / GRAM_REFERENCE).unlink()  # a checkpoint from before the reference (this copy's own directory)
    _serve(checkpoint, "centred_gram")
    with session_factory(settings.database_url)() as session, pytest.raises(NotReadyError, match="run `zoo train` again"):
        engine.similar(session, "tiny", Query("w01", 1), 8, method="hybrid")
