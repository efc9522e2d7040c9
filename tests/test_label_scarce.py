"""The label-scarce protocol (`zoo eval --labelled-per-task N` / `--label-fraction F`): which adapters keep labels,
what the kNN rows may see, and that its row `default` is what `zoo search` and `zoo predict` do after `zoo train`."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embed.data.types import ZooAdapter, schema_of
from embed.selection.calibration import expected_calibration_error
from embed.selection.metrics import classification, knn_classify, knn_regress, regression, retrieval, weighted_mean
from embed.training.evaluate import evaluate
from embed.training.splits import labelled_split
from embed.training.train import categorical_attributes, train_w2t
from embed.training.train_options import TrainOptions
from tests.conftest import CLI
from tests.test_embed import synthetic_zoo
from zoo.domain.exact_scores import EXACT_SCORES, exact_cosines
from zoo.domain.methods import KnnPredictor
from zoo.domain.similarity import ModuleStack, dense_modules


def _named(tasks: list[str]) -> list[ZooAdapter]:
    return [ZooAdapter(i + 1, f"a{i:03d}", {}, {"task": t} if t else {}) for i, t in enumerate(tasks)]


@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    unlabelled=st.integers(0, 5),
    n=st.integers(1, 12),
    seed=st.integers(0, 5),
    shuffle=st.randoms(use_true_random=False),
)
def test_labelled_split_keeps_n_per_task_and_a_query_for_each(
    sizes: list[int], unlabelled: int, n: int, seed: int, shuffle: random.Random
) -> None:
    tasks = [f"t{t}" for t, size in enumerate(sizes) for _ in range(size)] + [""] * unlabelled
    shuffle.shuffle(tasks)
    adapters = _named(tasks)
    labelled, queries = labelled_split(adapters, n, None, seed)
    assert not set(labelled) & set(queries) and sorted(labelled + queries) == [p for p, t in enumerate(tasks) if t]
    for t, size in enumerate(sizes):
        kept = [p for p in labelled if tasks[p] == f"t{t}"]
        assert len(kept) == min(n, size - 1)  # every task keeps at least one query
        assert any(tasks[p] == f"t{t}" for p in queries)
    # the split depends on names and tasks, not on the order the adapters were stored in
    restored = adapters[:]
    shuffle.shuffle(restored)
    restored = [ZooAdapter(500 + k, a.name, {}, a.labels) for k, a in enumerate(restored)]
    again, _ = labelled_split(restored, n, None, seed)
    assert sorted(restored[p].name for p in again) == sorted(adapters[p].name for p in labelled)


@given(sizes=st.lists(st.integers(2, 40), min_size=1, max_size=6), fraction=st.floats(0.01, 0.99), seed=st.integers(0, 3))
def test_label_fraction_keeps_a_rounded_share_of_each_task(sizes: list[int], fraction: float, seed: int) -> None:
    tasks = [f"t{t}" for t, size in enumerate(sizes) for _ in range(size)]
    labelled, queries = labelled_split(_named(tasks), None, fraction, seed)
    for t, size in enumerate(sizes):
        kept = sum(1 for p in labelled if tasks[p] == f"t{t}")
        assert kept == min(max(1, round(fraction * size)), size - 1)


def test_labelled_split_refuses_bad_arguments() -> None:
    adapters = _named(["a", "a", "b", "b"])
    for per_task, fraction in ((None, None), (2, 0.5), (0, None), (None, 0.0), (None, 1.0)):
        with pytest.raises(ValueError):
            labelled_split(adapters, per_task, fraction, 0)


def test_a_task_head_with_most_adapters_unlabelled() -> None:
    """A user's zoo: a few labelled adapters among many unlabelled ones still get a task head (and a task predictor)."""
    zoo = synthetic_zoo(n_per_task=10, tasks=4)
    labelled, _ = labelled_split(zoo, 3, None, 0)
    scarce = [a if p in labelled else ZooAdapter(a.id, a.name, a.factors) for p, a in enumerate(zoo)]
    assert categorical_attributes(scarce)["task"] == ["task0", "task1", "task2", "task3"]  # 12 of 40 labelled
    emb = train_w2t(scarce, schema_of("synthetic", scarce), TrainOptions(epochs=2, members=2), progress=False)
    assert emb.config.categorical == {"task": ["task0", "task1", "task2", "task3"]} and "task" in emb.predictors
    assert sorted(emb.memory_ids.tolist()) == sorted(zoo[p].id for p in labelled)  # only the labelled are remembered
    # sparse attributes (a value per adapter, or known for few of the labelled) get no head
    extra = {p: {"uid": a.name, **({"x": str(p % 2)} if p < 8 else {})} for p, a in enumerate(scarce) if p in labelled}
    rare = [ZooAdapter(a.id, a.name, a.factors, {**a.labels, **extra.get(p, {})}) for p, a in enumerate(scarce)]
    assert set(categorical_attributes(rare)) == {"task", "rank"}


def test_scarce_evaluation_predicts_from_the_labelled_only() -> None:
    zoo = synthetic_zoo(n_per_task=8, tasks=4, seed=3)
    result = evaluate(zoo, schema_of("synthetic", zoo), TrainOptions(epochs=2, members=2), seed=1, progress=False, contrastive=False,
                      labelled_per_task=3)  # fmt: skip
    labelled, queries = labelled_split(zoo, 3, None, 1)
    assert (result["n_train"], result["n_test"]) == (12, 20) and result["protocol"] == "3 labelled per task"
    factors = [a.factors for a in zoo]
    stack = ModuleStack.of(factors, dense_modules(factors))
    tasks = [a.labels["task"] for a in zoo]
    perf = np.array([a.measurements["test_accuracy"] for a in zoo])
    for score in EXACT_SCORES:
        sim = exact_cosines(stack, stack, score)
        sub = sim[np.ix_(queries, labelled)]
        want = {
            **retrieval(sim[queries], [tasks[q] for q in queries], tasks, list(queries)),  # the gallery: every other adapter
            **classification(knn_classify(sub, [tasks[p] for p in labelled]), [tasks[q] for q in queries]),
            **regression(knn_regress(sub, perf[labelled]), perf[queries]),
        }
        row = result["methods"][f"{score}_cosine"]
        assert row == pytest.approx({k: want.get(k, row[k]) for k in row})
    default = result["methods"]["default"]
    assert all(default[k] is not None for k in ("attr_acc", "perf_spearman", "hit@1", "mrr", "ndcg@10"))
    assert set(result["choices"]) == {"search", "task", "test_accuracy"}
    # per query, for the paired intervals and the cross-fitted regret over splits (embed.training.evaluate.summarize): every row's
    # measures, and every search score the choice had, the one served among them giving the default row's retrieval
    per_query = result["per_query"]
    assert per_query.tasks == [tasks[q] for q in queries] and per_query.served == result["search"]
    for key in ("hit@1", "mrr", "ndcg@10"):
        assert per_query.methods["default"][key] == pytest.approx(per_query.candidates[per_query.served][key])
        assert per_query.methods["default"][key].mean() == pytest.approx(default[key]) == result["search_candidates"][key][per_query.served]
    assert per_query.methods["dw_cosine"]["attr_acc"].mean() == pytest.approx(result["methods"]["dw_cosine"]["attr_acc"])
    assert per_query.methods["default"]["attr_acc"].mean() == pytest.approx(default["attr_acc"])
    # 5 training-free exact scores (the centred input Gram and its mean with module cosine on the split's labelled), the
    # search's channel metric fitted on the labelled (embed/selection/fitted.py) and its fusion with dW
    # (zoo/domain/fusion.py), each alone and mixed at 0.1 … 0.9, W2T alone; each of the 7 × 10 one-stage mixes below 0.9
    # under every heavier one below 1 (45 pairs per exact score), re-ordering its top 5 or 10; and each of the metric's
    # 10 mixes below 1 re-ordered by the fusion at its weight, top 5 or 10
    free = {"centred_gram", "module_centred"}
    assert {"metric:search", "fused:search", "metric:search then top 10 by fused:search", *free} <= set(per_query.candidates)
    assert len(per_query.candidates) == len(result["search_candidates"]["mrr"]) == 71 + 7 * 45 * 2 + 10 * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("db_url", "objective", "unlabelled"),
    [("sqlite", "supervised", None), pytest.param("postgresql", "both", 0.5, marks=pytest.mark.postgres)],
    indirect=["db_url"],
)  # each objective on one database: the database's part (labels, embeddings, the checkpoint stored) is any zoo's
def test_default_row_is_what_search_and_predict_do_after_train(cli: CLI, tmp_path: Path, objective: str, unlabelled: float | None) -> None:
    """Adapters ingested with labels on N per task only, `zoo train --objective [--unlabelled-per-labelled]`, then
    `zoo search` and `zoo predict` on each unlabelled adapter: their scores are the eval's row `default` under the same
    labels and options (with `both`, each epoch draws half as many unlabelled adapters as it has labelled ones)."""
    from embed.data.dataset import load_adapters
    from tests.factories import train_peft_adapter
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    targets = {"qv": ("q_proj", "v_proj"), "qk": ("q_proj", "k_proj"), "kv": ("k_proj", "v_proj"), "qkv": ("q_proj", "k_proj", "v_proj")}
    names, tasks, accuracy = [], {}, {}
    for i in range(24):
        task = sorted(targets)[i % 4]
        name = f"s{i:02d}"
        train_peft_adapter(tmp_path / "zoo" / name, seed=i, steps=2 + i % 5, targets=targets[task])
        names.append(name)
        tasks[name], accuracy[name] = task, 0.4 + 0.02 * (i % 5) + 0.01 * (i % 4)
    labelled, _ = labelled_split(_named([tasks[n] for n in names]), 3, None, 2)
    kept = {names[p] for p in labelled}
    rows = ["name,task,test_accuracy"] + [f"{n},{tasks[n]},{accuracy[n]}" for n in names if n in kept]
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    rc, _ = cli.json_lines("ingest", "--no-embed", str(tmp_path / "zoo"), "--labels", str(tmp_path / "labels.csv"), "--base-model", "tiny")
    assert rc == 0
    # three members each holding out half: every adapter held out by one or two, scored by their mean
    train = ("train", "--epochs", "3", "--members", "3", "--val-fraction", "0.5", "--seed", "2", "--objective", objective)
    if unlabelled is not None:
        train += ("--unlabelled-per-labelled", str(unlabelled))
    rc, (info,) = cli.json_lines(*train)
    assert rc == 0 and info["heads"] == ["task"] and set(info["predictors"]) == {"task", "test_accuracy"}
    # accuracy here grows with the steps, so with the run's size: served by a kNN that reads it (weighs its neighbours
    # by size, or follows the trend of value with size)
    served = KnnPredictor.parse(info["predictors"]["test_accuracy"])
    assert served.width is not None or served.trend

    with session_factory(cli.settings.database_url)() as session:
        stored = load_adapters(session, BlobStore(cli.settings.blob_dir), "tiny")
    full = [ZooAdapter(a.id, a.name, a.factors, {"task": tasks[a.name]}, {"test_accuracy": accuracy[a.name]}) for a in stored]
    options = TrainOptions(epochs=3, seed=2, members=3, val_fraction=0.5, unlabelled_per_labelled=unlabelled)
    result = evaluate(
        full, schema_of("tiny", full), options, seed=2, progress=False, contrastive=False, labelled_per_task=3, objective=objective
    )
    assert result["objective"] == info["objective"] == objective and result["choices"] == info["choices"]  # the same W2T, the same choices

    ids = [a.id for a in full]
    queries = [p for p, a in enumerate(full) if a.name not in kept]
    sim = np.full((len(queries), len(full)), -np.inf)
    predicted, values, confidence = [], [], []
    for row, q in enumerate(queries):
        rc, (found,) = cli.json_lines("search", str(ids[q]), "-k", "1000")
        assert rc == 0 and found["method"] == "hybrid" and len(found["results"]) == len(full) - 1
        for place, hit in enumerate(found["results"]):  # in the order served: a second stage re-orders the first's top
            sim[row, ids.index(hit["adapter_id"])] = -place
        rc, (pred,) = cli.json_lines("predict", str(ids[q]))
        assert rc == 0 and pred["search"] == info["choices"]["search"]["chosen"]
        predicted.append(pred["attributes"]["task"][0]["value"])
        confidence.append(pred["attributes"]["task"][0]["probability"])
        values.append(pred["metrics"]["test_accuracy"]["value"])
    gallery = [a.labels["task"] for a in full]
    served = {
        **retrieval(sim, [gallery[q] for q in queries], gallery, list(queries)),
        **classification(predicted, [gallery[q] for q in queries]),
        **regression(np.array(values), np.array([full[q].measurements["test_accuracy"] for q in queries])),
    }
    right = np.array([p == gallery[q] for p, q in zip(predicted, queries, strict=True)])
    served["attr_ece"] = expected_calibration_error(np.array(confidence), right)
    served["attr_wrong_at_100"] = float(((np.array(confidence) >= 0.995) & ~right).sum())
    assert served == pytest.approx(result["methods"]["default"], abs=1e-4)


@given(
    st.lists(st.floats(-10, 10), min_size=1, max_size=12).flatmap(
        lambda v: st.tuples(st.just(v), st.lists(st.floats(1e-6, 1.0), min_size=len(v), max_size=len(v)))
    )
)
def test_weighted_mean_is_exact_when_neighbours_agree(values_weights: tuple[list[float], list[float]]) -> None:
    values, weights = np.array(values_weights[0]), np.array(values_weights[1])
    assert weighted_mean(values, weights) == pytest.approx(float((weights * values).sum() / weights.sum()), abs=1e-9)
    assert weighted_mean(np.full(len(values), values[0]), weights) == values[0]  # one neighbour's value, exactly
    assert min(values) - 1e-9 <= weighted_mean(values, weights) <= max(values) + 1e-9
