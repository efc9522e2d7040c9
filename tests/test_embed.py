"""The embedder: invariance, training round trip, baselines, metrics, evaluation on a synthetic zoo."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.retrieval import sorted_retrieval
from embed.data.types import ZooAdapter, schema_of, split_positions
from embed.selection.metrics import KNN_K, retrieval, retrieval_per_query
from embed.selection.search_choice import MIX_WEIGHTS
from embed.training.evaluate import METHODS, evaluate, refactorized
from embed.training.train import TrainOptions, member_folds, train_w2t
from embed.w2t.checkpoint import META, checkpoint_meta
from embed.w2t.ensemble import W2TEnsemble
from zoo.domain.canonical import canonicalize
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS, PROTOTYPE, KnnPredictor, LearnedPredictor, SearchScore
from zoo.domain.similarity import (
    ModuleStack,
    dense_modules,
    dw_cosine_matrix,
    module_cosine_matrix,
    module_sketches,
    sketch_module_cosines,
    sketch_width,
)

MODULES = [(f"layers.{layer}.{t}", 24, 20) for layer in range(2) for t in ("q_proj", "v_proj")]


def synthetic_zoo(n_per_task: int = 12, tasks: int = 4, seed: int = 0) -> list[ZooAdapter]:
    """Adapters whose updates share a task direction plus noise; accuracy depends on the scale."""
    gen = torch.Generator().manual_seed(seed)
    centers = {
        (t, name): (torch.randn(out, 2, generator=gen), torch.randn(2, inp, generator=gen))
        for t in range(tasks)
        for name, out, inp in MODULES
    }
    adapters = []
    for t in range(tasks):
        for _ in range(n_per_task):
            r = int(torch.randint(2, 5, (1,), generator=gen))
            scale = float(torch.rand(1, generator=gen)) + 0.5
            factors = {}
            for name, out, inp in MODULES:
                cb, ca = centers[(t, name)]
                B = torch.cat([cb * scale, 0.3 * torch.randn(out, r - 2, generator=gen)], dim=1)
                A = torch.cat([ca, torch.randn(r - 2, inp, generator=gen)], dim=0)
                B = B + 0.2 * torch.randn(B.shape, generator=gen)
                factors[name] = canonicalize(A, B)
            adapters.append(
                ZooAdapter(
                    id=len(adapters) + 1,
                    name=f"a{len(adapters)}",
                    factors=factors,
                    labels={"task": f"task{t}", "rank": str(r)},
                    measurements={"test_accuracy": min(1.0, 0.4 + 0.4 * scale)},
                )
            )
    return adapters


@pytest.fixture(scope="module")
def zoo() -> list[ZooAdapter]:
    return synthetic_zoo()


def test_dw_inner_products_are_exact(zoo: list[ZooAdapter]) -> None:
    factors = [a.factors for a in zoo[:5]]
    stack = ModuleStack.of(factors, dense_modules(factors))
    gram = stack.inner_products(stack)
    for i in range(5):
        for j in range(5):
            ref = sum(float((zoo[i].factors[n].delta().double() * zoo[j].factors[n].delta().double()).sum()) for n, _, _ in MODULES)
            assert gram[i, j] == pytest.approx(ref, rel=1e-4)
    cos = dw_cosine_matrix(factors, factors)
    assert np.allclose(cos, gram / np.sqrt(np.outer(np.diag(gram), np.diag(gram))), atol=1e-6)


def test_module_sketch_tracks_module_cosine(zoo: list[ZooAdapter]) -> None:
    schema = schema_of("synthetic", zoo)
    factors = [a.factors for a in zoo]
    exact = module_cosine_matrix(factors, factors)
    sk = module_sketches(factors, schema.module_names, sketch_width(len(schema.modules)))
    approx = sketch_module_cosines(sk, sk, len(schema.modules))
    off = ~np.eye(len(zoo), dtype=bool)
    assert np.allclose(np.diag(approx), 1.0, atol=1e-5)
    assert np.corrcoef(approx[off], exact[off])[0, 1] > 0.8


def test_retrieval_metrics_by_hand() -> None:
    sim = np.array([[1.0, 0.9, 0.8, 0.1], [0.9, 1.0, 0.2, 0.7]])
    labels = ["a", "b", "a", "b"]
    r = retrieval(sim, ["a", "b"], labels, [0, 1])
    # query 0: ranking [1(b), 2(a), 3(b)] -> first hit at 2; query 1: ranking [0(a), 3(b), 2(a)] -> first hit at 2
    assert r["hit@1"] == 0.0 and r["hit@10"] == 1.0 and r["mrr"] == pytest.approx(0.5)
    assert r["ndcg@10"] == pytest.approx(1 / np.log2(3))


@given(
    queries=st.integers(1, 12),
    gallery=st.integers(1, 40),
    levels=st.sampled_from([3, 1000]),
    share_self=st.floats(0, 1),
    seed=st.integers(0, 2**31 - 1),
)
def test_retrieval_per_query_is_the_whole_sort_of_each_row(queries: int, gallery: int, levels: int, share_self: float, seed: int) -> None:
    """With ties (few score levels) or without, with or without a query's own column: the ranks counted and the top
    sorted alone give what sorting each row whole gives."""
    rng = np.random.default_rng(seed)
    sim = rng.integers(-levels, levels + 1, (queries, gallery)) / levels
    labels = [f"t{x}" for x in rng.integers(0, 4, gallery)]
    asked = [f"t{x}" for x in rng.integers(0, 5, queries)]
    own = [int(rng.integers(0, gallery)) if rng.random() < share_self else None for _ in range(queries)]
    got = retrieval_per_query(sim, asked, labels, own)
    for k, want in sorted_retrieval(sim, asked, labels, own).items():
        assert np.allclose(got[k], want), k


@given(n=st.integers(10, 400), members=st.integers(1, 12), val_fraction=st.floats(0.05, 0.5), seed=st.integers(0, 3))
def test_member_folds_spread_the_held_out_adapters_evenly(n: int, members: int, val_fraction: float, seed: int) -> None:
    folds = member_folds(n, members, TrainOptions(seed=seed, val_fraction=val_fraction))
    assert len(folds) == members
    n_val = max(1, round(val_fraction * n))
    times = np.zeros(n, np.int64)
    for f in folds:
        val, train = f.val.tolist(), set(f.train.tolist())
        assert len(val) == len(set(val)) == n_val and not set(val) & train and set(val) | train == set(range(n))
        times[val] += 1
    share = members * n_val / n  # each adapter is held out by this many members, to the nearest whole numbers
    assert times.min() >= np.floor(share) and times.max() <= np.ceil(share)


def test_ten_members_holding_out_a_fifth_hold_each_adapter_out_twice_and_the_default_once_at_most() -> None:
    for n in (10, 57, 300):
        twice, default = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for f in member_folds(n, 10, TrainOptions(val_fraction=0.2)):
            twice[f.val.tolist()] += 1
        for f in member_folds(n, TrainOptions().members, TrainOptions()):
            default[f.val.tolist()] += 1
        assert set(twice.tolist()) <= {1, 2, 3} and abs(twice.mean() - 2) < 0.1
        assert default.max() == 1 and default.sum() == 5 * round(0.15 * n)  # disjoint slices


@given(n=st.integers(2, 120), seed=st.integers(0, 3), shuffle=st.randoms(use_true_random=False))
def test_eval_split_depends_on_names_not_on_storage_order(n: int, seed: int, shuffle: random.Random) -> None:
    adapters = [ZooAdapter(i + 1, f"a{i:03d}", {}) for i in range(n)]
    restored = adapters[:]
    shuffle.shuffle(restored)
    restored = [ZooAdapter(100 + k, a.name, {}) for k, a in enumerate(restored)]  # ingested again, in another order
    names = lambda zoo, pos: sorted(zoo[p].name for p in pos)  # noqa: E731
    train, test = split_positions(adapters, 0.2, seed)
    train2, test2 = split_positions(restored, 0.2, seed)
    assert names(adapters, test) == names(restored, test2) and names(adapters, train) == names(restored, train2)
    assert sorted(train + test) == list(range(n)) and len(test) == max(1, round(0.2 * n))


def test_embedding_is_factorization_and_sign_invariant(zoo: list[ZooAdapter]) -> None:
    schema = schema_of("synthetic", zoo)
    emb = train_w2t(zoo, schema, TrainOptions(epochs=2, seed=0), progress=False)
    z0 = emb.embed(zoo[:8])
    z1 = emb.embed([refactorized(a, seed=i) for i, a in enumerate(zoo[:8])])
    assert np.min((z0 * z1).sum(axis=1)) >= 0.9999


@pytest.mark.slow  # trains W2T twice
def test_training_save_load_round_trip(zoo: list[ZooAdapter], tmp_path: Path) -> None:
    schema = schema_of("synthetic", zoo)
    emb = train_w2t(zoo, schema, TrainOptions(epochs=3, seed=1, attributes=None), progress=False)
    assert set(emb.config.categorical) == {"task", "rank"}
    assert emb.config.regression == ["test_accuracy"]
    assert len(emb.models) == TrainOptions().members
    assert all(1 <= sum(1 for h in emb.history if h["member"] == i) <= 3 for i in range(len(emb.models)))
    assert emb.predictors["test_accuracy"] in (HEAD, NEIGHBOURS) or isinstance(emb.predictors["test_accuracy"], KnnPredictor)
    assert emb.predictors["task"] in (HEAD, PROTOTYPE, LOGREG) or isinstance(emb.predictors["task"], KnnPredictor)
    assert all(p.name == emb.choices[k]["chosen"] for k, p in emb.predictors.items())
    assert set(emb.choices) == {"search", "task", "rank", "test_accuracy"} and emb.choices["search"]["chosen"] == emb.search.name
    assert len(emb.memory) == len(emb.memory_values["test_accuracy"]) == len(zoo)  # every adapter is measured
    emb.save(tmp_path / "ckpt")
    loaded = W2TEnsemble.load(tmp_path / "ckpt")
    assert np.allclose(loaded.embed(zoo[:6]), emb.embed(zoo[:6]), atol=1e-6)
    p0, v0 = emb.predict(zoo[:6])
    p1, v1 = loaded.predict(zoo[:6])
    assert np.allclose(p0["task"], p1["task"], atol=1e-6) and np.allclose(v0["test_accuracy"], v1["test_accuracy"], atol=1e-6)
    assert emb.search.w2t_weight in (0.0, *MIX_WEIGHTS) and loaded.search == emb.search
    assert loaded.predictors == emb.predictors and np.array_equal(loaded.memory, emb.memory)
    assert sorted(loaded.memory_ids.tolist()) == sorted(a.id for a in zoo) and loaded.memory_labels == emb.memory_labels
    measured = [a.measurements["test_accuracy"] for a in zoo]
    assert loaded.metric_range["test_accuracy"] == (min(measured), max(measured))
    assert min(measured) <= v1["test_accuracy"].min() and v1["test_accuracy"].max() <= max(measured)
    again = train_w2t(zoo, schema, TrainOptions(epochs=3, seed=1, attributes=None), progress=False)
    assert np.allclose(again.embed(zoo[:6]), emb.embed(zoo[:6]), atol=1e-5)  # deterministic from the seed


@pytest.mark.slow
def test_evaluate_reports_every_method(zoo: list[ZooAdapter]) -> None:
    schema = schema_of("synthetic", zoo)
    result = evaluate(zoo, schema, TrainOptions(epochs=5), test_fraction=0.25, seed=0, progress=False)
    assert (result["n_train"], result["n_test"]) == (36, 12)
    assert set(result["methods"]) == set(METHODS)
    dw = result["methods"]["dw_cosine"]
    assert dw["hit@1"] > 0.9 and dw["attr_acc"] > 0.9  # the synthetic tasks are well separated in dW
    assert result["methods"]["module_cosine"]["hit@1"] > 0.9 and result["methods"]["module_cosine"]["attr_acc"] > 0.9
    assert result["methods"]["raw_cosine"]["hit@1"] is None  # no source files for synthetic adapters
    assert result["invariance_min_cosine"] >= 0.9999
    for row in result["methods"].values():
        for key in ("hit@1", "mrr", "ndcg@10", "attr_acc"):
            assert row[key] is None or 0.0 <= row[key] <= 1.0


@pytest.mark.slow
def test_zoo_eval_command(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.factories import train_peft_adapter

    rows = ["name,task,test_accuracy"]
    for i in range(12):
        train_peft_adapter(tmp_path / "zoo" / f"a{i}", seed=i, steps=3, targets=("q_proj", "v_proj") if i % 2 else ("q_proj", "k_proj"))
        rows.append(f"a{i},{'qv' if i % 2 else 'qk'},{0.5 + i / 40}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    rc, _ = cli.json_lines("ingest", "--no-embed", str(tmp_path / "zoo"), "--labels", str(tmp_path / "labels.csv"), "--base-model", "tiny")
    assert rc == 0
    rc, (result,) = cli.json_lines("eval", "--epochs", "2", "--test-fraction", "0.25")
    assert rc == 0
    assert result["space"] == "tiny" and (result["n_train"], result["n_test"]) == (9, 3)
    assert set(result["methods"]) == set(METHODS)
    assert result["methods"]["raw_cosine"]["hit@1"] is not None  # the source files are still on disk
    rc, (combined,) = cli.json_lines(
        "eval", "--epochs", "1", "--members", "1", "--test-fraction", "0.25", "--splits", "2", "--seed", "3", "--no-contrastive"
    )
    assert rc == 0 and combined["seeds"] == [3, 4] and [r["seed"] for r in combined["splits"]] == [3, 4]
    assert set(combined["methods"]) == set(METHODS) and set(combined["methods"]["w2t_contrastive"].values()) == {None}
    assert combined["methods"]["w2t_supervised"]["hit@1"] is not None
    assert all("w2t_contrastive_train" not in r["seconds"] for r in combined["splits"])
    for name, row in combined["methods"].items():
        for key, mean in row.items():
            values = [r["methods"][name][key] for r in combined["splits"] if r["methods"][name][key] is not None]
            assert mean == (pytest.approx(np.mean(values)) if values else None)
            assert combined["methods_std"][name][key] == (pytest.approx(np.std(values)) if values else None)
    for key, agg in combined["search_regret"].items():  # cross-fitted: each split against the search best on the other
        rows = agg["splits"]
        for split, other, row in zip(combined["splits"], combined["splits"][::-1], rows, strict=True):
            theirs, ours = other["search_candidates"][key], split["search_candidates"][key]
            assert theirs[row["fixed"]] == max(theirs.values()) and row["served"] == split["search"]
            assert row["regret"] == pytest.approx(ours[row["fixed"]] - ours[row["served"]])
        assert agg["mean"] == pytest.approx(np.mean([row["regret"] for row in rows]))  # as many queries in each split
    assert set(combined["search_regret"]) == {"hit@1", "mrr", "ndcg@10"}
    rc, _, err = cli("eval", "--splits", "0")
    assert rc == 2 and "--splits must be at least 1" in err
    rc, _, err = cli("eval", "--space", "nope")
    assert rc == 2 and "no embedding space 'nope'" in err


def test_one_module_type_with_several_shapes() -> None:
    """BERT names three differently shaped layers `dense`: each shape gets its own projections."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"layer.0.attention.output.dense": (8, 8), "layer.0.intermediate.dense": (16, 8), "layer.0.output.dense": (8, 16)}
    adapters = [
        ZooAdapter(
            i + 1,
            f"b{i}",
            {n: canonicalize(torch.randn(2, d, generator=gen), torch.randn(o, 2, generator=gen)) for n, (o, d) in shapes.items()},
        )
        for i in range(4)
    ]
    schema = schema_of("bert", adapters)
    assert len(schema.type_shapes()) == 3
    emb = train_w2t(adapters, schema, TrainOptions(epochs=1), progress=False)
    assert emb.embed(adapters).shape == (4, emb.dim)


def test_schema_keeps_the_majority_shape_and_leaves_conflicting_adapters_out() -> None:
    """One module name with two shapes (adapters of 'unknown' base models) no longer breaks the space."""
    from embed.data.types import ZooAdapter, schema_of
    from zoo.domain.canonical import canonicalize

    def adapter(i: int, out: int) -> ZooAdapter:
        g = torch.Generator().manual_seed(i)
        return ZooAdapter(i, f"a{i}", {"layers.0.q_proj": canonicalize(torch.randn(2, 8, generator=g), torch.randn(out, 2, generator=g))})

    zoo = [adapter(1, 8), adapter(2, 8), adapter(3, 12)]
    schema = schema_of("unknown", zoo)
    assert schema.modules == (("layers.0.q_proj", 8, 8),)
    assert [schema.fits(a.factors) for a in zoo] == [True, True, False]


def test_a_contrastive_w2t_does_not_retire_the_supervised_one(db_url: str) -> None:
    from zoo.store.embedders import active_embedder, register, serving_embedders
    from zoo.store.session import session_factory
    from zoo.store.spaces import ensure_space

    with session_factory(db_url)() as session, session.begin():
        space = ensure_space(session, "tiny", (("m", 4, 4),))
        supervised = register(session, space, "w2t", 8, objective="supervised", checkpoint="s")
        contrastive = register(session, space, "w2t", 8, objective="contrastive", checkpoint="c")
        assert supervised.active and contrastive.active
        assert serving_embedders(session, space.id)["w2t"].id == supervised.id == active_embedder(session, space).id
        newer = register(session, space, "w2t", 8, objective="supervised", checkpoint="s2")
        assert not supervised.active and contrastive.active and serving_embedders(session, space.id)["w2t"].id == newer.id


@pytest.mark.parametrize("readout", ["prototype", "logreg"])
def test_few_shot_readouts_predict_after_a_round_trip(zoo: list[ZooAdapter], tmp_path: Path, readout: str) -> None:
    from embed.selection.choice import logistic_readout, prototype_predictions

    emb = train_w2t(zoo, schema_of("synthetic", zoo), TrainOptions(epochs=2, seed=0, members=2), progress=False)
    labels = emb.memory_labels["task"]
    emb.predictors["task"] = LearnedPredictor(readout)  # what training would store had this readout won out of fold
    if readout == "logreg":
        model = logistic_readout(emb.memory, labels)
        emb.readouts["task"] = {"classes": list(model.classes_), "coef": model.coef_.tolist(), "intercept": model.intercept_.tolist()}
    emb.save(tmp_path / "ckpt")
    probs, _ = W2TEnsemble.load(tmp_path / "ckpt").predict(zoo)
    classes = emb.config.categorical["task"]
    assert np.allclose(probs["task"].sum(axis=1), 1.0) and probs["task"].shape == (len(zoo), len(classes))
    predicted = [classes[i] for i in probs["task"].argmax(axis=1)]
    z = emb.embed(zoo)
    if readout == "prototype":
        assert predicted == prototype_predictions(np.vstack([emb.memory, z]), labels + [""] * len(zoo), list(range(len(labels))),
                                                  list(range(len(labels), len(labels) + len(zoo))))  # fmt: skip
    else:
        assert predicted == model.predict(z).tolist()


#: the methods' entries of checkpoints as written today and before: (stored, what they load as, what saving writes)
#: a checkpoint's entries for its methods
METHOD_KEYS = ("search", "exact_score", "hybrid_weight", "predictor", "knn")
CHECKPOINT_METHODS = [
    (  # today's: the search score by name (here with a second stage), the first stage's exact score and weight beside it
        {
            "search": "module+w2t@0.8 then top 5 by module+w2t@0.1",
            "exact_score": "module",
            "hybrid_weight": 0.8,
            "predictor": {"task": "knn", "rank": "prototype", "test_accuracy": "knn"},
            "knn": {"task": {"similarity": "module+w2t@0.3", "k": 3}, "test_accuracy": {"similarity": "w2t", "k": 1}},
        },
        (
            SearchScore("module", 0.8, 0.1, 5),
            {
                "task": KnnPredictor(SearchScore("module", 0.3), 3),
                "rank": PROTOTYPE,
                "test_accuracy": KnnPredictor(SearchScore("dw", 1.0), 1),
            },
        ),
        None,
    ),
    (  # a metric's kNN weighing its neighbours by a softmax at a temperature
        {
            "search": "input_gram",
            "exact_score": "input_gram",
            "hybrid_weight": 0.0,
            "predictor": {"task": "knn", "rank": "head", "test_accuracy": "knn"},
            "knn": {
                "task": {"similarity": "input_gram", "k": 3},
                "test_accuracy": {"similarity": "input_gram", "k": 10, "temperature": 0.01},
            },
        },
        (
            SearchScore("input_gram"),
            {
                "task": KnnPredictor(SearchScore("input_gram"), 3),
                "rank": HEAD,
                "test_accuracy": KnnPredictor(SearchScore("input_gram"), 10, 0.01),
            },
        ),
        None,
    ),
    (  # before second stages: the exact score and the W2T weight
        {
            "exact_score": "module",
            "hybrid_weight": 0.3,
            "predictor": {"task": "knn", "rank": "prototype", "test_accuracy": "knn"},
            "knn": {"task": {"similarity": "module+w2t@0.3", "k": 3}, "test_accuracy": {"similarity": "w2t", "k": 1}},
        },
        (
            SearchScore("module", 0.3),
            {
                "task": KnnPredictor(SearchScore("module", 0.3), 3),
                "rank": PROTOTYPE,
                "test_accuracy": KnnPredictor(SearchScore("dw", 1.0), 1),
            },
        ),
        {
            "search": "module+w2t@0.3",
            "exact_score": "module",
            "hybrid_weight": 0.3,
            "predictor": {"task": "knn", "rank": "prototype", "test_accuracy": "knn"},
            "knn": {"task": {"similarity": "module+w2t@0.3", "k": 3}, "test_accuracy": {"similarity": "w2t", "k": 1}},
        },
    ),
    (  # before the kNN predictors were chosen: "search", a 10-NN over the search score; module cosine the exact score
        {"hybrid_weight": 0.5, "predictor": {"task": "search", "rank": "head", "test_accuracy": "neighbours"}},
        (SearchScore("module", 0.5), {"task": KnnPredictor(SearchScore("module", 0.5), KNN_K), "rank": HEAD, "test_accuracy": NEIGHBOURS}),
        {
            "search": "module+w2t@0.5",
            "exact_score": "module",
            "hybrid_weight": 0.5,
            "predictor": {"task": "knn", "rank": "head", "test_accuracy": "neighbours"},
            "knn": {"task": {"similarity": "module+w2t@0.5", "k": KNN_K}},
        },
    ),
    (  # the same with the W2T cosine alone, which mixes in no exact score
        {"hybrid_weight": 1.0, "predictor": {"task": "search", "rank": "head", "test_accuracy": "head"}},
        (SearchScore("dw", 1.0), {"task": KnnPredictor(SearchScore("dw", 1.0), KNN_K), "rank": HEAD, "test_accuracy": HEAD}),
        {
            "search": "w2t",
            "exact_score": "dw",
            "hybrid_weight": 1.0,
            "predictor": {"task": "knn", "rank": "head", "test_accuracy": "head"},
            "knn": {"task": {"similarity": "w2t", "k": KNN_K}},
        },
    ),
]


@pytest.mark.parametrize(("stored", "methods", "written"), CHECKPOINT_METHODS)
def test_checkpoints_keep_their_methods_by_name(
    zoo: list[ZooAdapter], tmp_path: Path, stored: dict, methods: tuple[SearchScore, dict], written: dict | None
) -> None:
    """A checkpoint's search score and predictors, stored by name, load as typed values and are saved by the same
    names: today's checkpoints load and save unchanged, older ones load (no search name: the exact score and weight;
    no exact score: module cosine; the predictor "search": a 10-NN over the search score)."""
    emb = train_w2t(zoo[:16], schema_of("synthetic", zoo), TrainOptions(epochs=1, seed=0, members=2), progress=False)
    emb.save(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / META).read_text())
    for key in METHOD_KEYS:
        meta.pop(key, None)
    (tmp_path / "old" / META).write_text(json.dumps({**meta, **stored}))
    checkpoint_meta.cache_clear()
    loaded = W2TEnsemble.load(tmp_path / "old", device="cpu")
    assert (loaded.search, loaded.predictors) == methods
    loaded.save(tmp_path / "again")
    again = json.loads((tmp_path / "again" / META).read_text())
    assert {k: again[k] for k in METHOD_KEYS} == (written or stored)
    assert W2TEnsemble.load(tmp_path / "again", device="cpu").predictors == loaded.predictors


def test_embeddings_by_id_are_read_by_their_key(tmp_path: Path) -> None:
    """`load_embeddings(ids=...)` reads rows by the unique key (adapter, embedder) in SQLite, which keeps no statistics:
    with the version in the WHERE clause it ranged over the (embedder, version) index, every row of the embedder."""
    from sqlalchemy import event

    from zoo.store.embeddings import load_embeddings
    from zoo.store.models import Embedder
    from zoo.store.session import session_factory, upgrade

    url = f"sqlite:///{tmp_path / 'zoo.db'}"
    upgrade(url)
    statements: list[tuple[str, object]] = []
    with session_factory(url)() as session:
        event.listen(session.get_bind(), "before_cursor_execute", lambda _c, _k, sql, params, *_: statements.append((sql, params)))
        load_embeddings(session, Embedder(id=1, dim=4), after_version=0, ids=np.arange(1, 17))  # from 3 ids
        sql, params = statements[-1]
        plan = " ".join(str(row) for row in session.connection().exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params))  # type: ignore[arg-type]
    assert "adapter_id=? AND embedder_id=?" in plan, plan
