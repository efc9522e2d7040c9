"""`zoo eval`: every method on one held-out split, one table.

Split by adapter (seeded), with full labels (a fraction held out) or scarce ones (a few labelled
adapters per task, the rest unlabelled queries). Retrieval: each held-out adapter is a query, the
gallery is every other adapter of the space, relevance = same task. Attributes (the task) and
performance (test accuracy) are predicted for held-out adapters from the labelled training adapters
only: kNN over them for similarity-only methods; the row `default` is what `zoo search` and
`zoo predict` do after `zoo train` (the search score and predictors chosen out of fold, embed/selection/choice.py).

Over several splits, methods are compared paired (embed/training/eval_summary.py).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from embed.data.dataset import profiles_of
from embed.data.tokens import max_rank
from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.calibration import expected_calibration_error
from embed.selection.choice import scores_for
from embed.selection.fitted import with_fused
from embed.selection.metrics import (
    KNN_K,
    classification,
    cosine,
    knn_classify,
    knn_regress,
    knn_vote_shares,
    regression,
    retrieval_per_query,
)
from embed.selection.search_choice import rerank_values, search_candidates
from embed.training.baselines import raw_factor_vectors, spectra_vectors
from embed.training.intervals import LEVEL, RESAMPLES
from embed.training.splits import protocol, split_of
from embed.training.train import remember_and_choose, train_w2t
from embed.training.train_options import TrainOptions
from embed.w2t.ensemble import W2TEnsemble
from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, REFERENCED, GramReference, fit_gram_reference, reference_sample
from zoo.domain.channel_metric import Bank, ChannelMetric, bank_matrices
from zoo.domain.exact_scores import exact_cosines, exact_matrices, module_centred
from zoo.domain.methods import KnnPredictor, SearchScore
from zoo.domain.similarity import (
    ModuleStack,
    dense_modules,
    module_sketches,
    sketch_module_cosines,
    sketch_width,
)
from zoo.labels import TASK_KEY

PERF_METRIC = "test_accuracy"
#: the rows of the exact scores that need the reference a split's labelled adapters fit (zoo/domain/centred_gram.py)
REFERENCED_ROWS = tuple(f"{s}_cosine" for s in REFERENCED)
#: `default` is what `zoo search` and `zoo predict` do once a supervised W2T is trained (embed/selection/choice.py), `module_cosine` before;
#: `default_without_metric` the same W2T's choice made without the channel metrics (TrainOptions.channel_metric)
METHODS = (
    "default",
    "default_without_metric",
    "dw_cosine",
    "module_cosine",
    "input_gram_cosine",
    *REFERENCED_ROWS,
    "w2t_supervised",
    "w2t_contrastive",
    "module_sketch",
    "raw_cosine",
    "spectra_knn",
)
#: attr_ece: expected calibration error of the task's probabilities as served; attr_wrong_at_100: wrong answers given
#: at ≥ 99.5 % (both only for `default`, the one row whose probabilities are served)
KEYS = (
    "attr_acc",
    "attr_macro_f1",
    "attr_ece",
    "attr_wrong_at_100",
    "perf_mae",
    "perf_spearman",
    "perf_kendall",
    "hit@1",
    "hit@10",
    "mrr",
    "ndcg@10",
)


#: the measure the closing line of `zoo eval` ranks the methods by: retrieval of adapters of the same task (higher is better)
MAIN_METRIC = "mrr"

#: the measures with a value per query (a retrieval, a task predicted): compared per query, paired
QUERY_KEYS = ("hit@1", "hit@10", "mrr", "ndcg@10", "attr_acc")
#: the default's per-query probability of the task it answers (beside attr_acc, whether it was right): what
#: embed.training.eval_summary.calibration pools the expected calibration error over splits from
CONFIDENCE = "attr_confidence"
#: the measures the default is compared on with each exact score (embed.training.eval_summary.summarize)
VERSUS_KEYS = ("hit@1", "mrr", "ndcg@10", "attr_acc", "perf_spearman")
#: the retrieval measures the search choice is judged on against the best fixed candidate (embed.training.eval_summary.cross_fitted_regret)
REGRET_KEYS = ("hit@1", "mrr", "ndcg@10")
#: the rows that predict by a kNN over a similarity with nothing learned
TRAINING_FREE_KNN = ("dw_cosine", "module_cosine", "input_gram_cosine", *REFERENCED_ROWS, "module_sketch", "raw_cosine", "spectra_knn")
#: how the intervals of embed.training.eval_summary.summarize are made, as its JSON says it
INTERVAL_SCHEME = (
    f"percentile {LEVEL:.0%} interval of the mean paired difference from {RESAMPLES} bootstrap resamples; a measure with a value "
    "per query resamples the splits and the queries' tasks, crossed (pigeonhole bootstrap, embed/training/intervals.py), one with a "
    "value per split (performance Spearman, MAE, Kendall) resamples the splits"
)


def refactorized(a: ZooAdapter, seed: int) -> ZooAdapter:
    """The same updates re-factorized with a random well-conditioned G, canonicalized again."""
    gen = torch.Generator().manual_seed(seed)
    factors: dict[str, CanonicalFactors] = {}
    for name, f in a.factors.items():
        if f.rank == 0:
            factors[name] = f
            continue
        q = torch.linalg.qr(torch.randn(f.rank, f.rank, generator=gen, dtype=torch.float64))[0]
        G = q * torch.linspace(1.0, 4.0, f.rank, dtype=torch.float64)
        B = ((f.U.double() * f.S.double()) @ G).float()
        A = (torch.linalg.inv(G) @ f.V.double().T).float()
        factors[name] = canonicalize(A, B)
    return ZooAdapter(a.id, a.name, factors, a.labels, a.measurements, a.source_uri)


@dataclass
class Scores:
    """A method's measures on one split: `means` of every one of KEYS (None: not measured), and `per_query` those of
    QUERY_KEYS it measured (and the default's CONFIDENCE), per query: the split's held-out adapters with a task, in order."""

    means: dict[str, float | None]
    per_query: dict[str, np.ndarray]

    def update(self, other: Scores) -> None:
        """Take `other`'s measures (those it has) in place of these."""
        self.means.update(other.means)
        self.per_query.update(other.per_query)


def _nothing() -> Scores:
    return Scores(dict.fromkeys(KEYS), {})


def _task_scores(predicted: list[str], truth: list[str]) -> Scores:
    """Accuracy and macro F1 of predicted tasks, and whether each was right."""
    right = np.array([p == t for p, t in zip(predicted, truth, strict=True)], float)
    return Scores(dict(classification(predicted, truth)), {"attr_acc": right})


def _score(
    sim: np.ndarray,
    all_ad: list[ZooAdapter],
    test_pos: list[int],
    train_pos: list[int],
    predict: bool,
    k: int = KNN_K,
    temperature: float | None = None,
    width: float | None = None,
    slope: np.ndarray | None = None,
    served: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Scores:
    tasks = [a.labels.get(TASK_KEY, "") for a in all_ad]
    out = _nothing()
    q = [p for p in test_pos if tasks[p]]
    if q:
        per = retrieval_per_query(sim[q], [tasks[p] for p in q], tasks, list(q))
        out.update(Scores({k: float(v.mean()) for k, v in per.items()}, per))
    if predict:
        sub = sim[np.ix_(test_pos, train_pos)]
        if all(tasks[p] for p in train_pos + test_pos):
            out.update(_task_scores(knn_classify(sub, [tasks[p] for p in train_pos], k), [tasks[p] for p in test_pos]))
        perf = np.array([all_ad[p].measurements.get(PERF_METRIC, np.nan) for p in range(len(all_ad))])
        if not np.isnan(perf[train_pos + test_pos]).any():
            sized = width is not None or slope is not None
            profiles = profiles_of(all_ad) if sized else None
            sizes = None if profiles is None else (profiles[test_pos], profiles[train_pos])
            estimates = knn_regress(sub, perf[train_pos], k, temperature, sizes, width, slope)
            if served is not None:  # as served: a trend may leave the labelled adapters' range (W2TEnsemble.clip)
                estimates = served(estimates)
            out.means.update(regression(estimates, perf[test_pos]))
    return out


@dataclass(frozen=True)
class SplitQueries:
    """One split's measures per query, which embed.training.eval_summary.summarize pairs across methods and splits: each query's task (its
    cluster), every method's QUERY_KEYS per query, every search candidate's REGRET_KEYS per query (by name, in
    search_candidates' order), and the name of the one served."""

    tasks: list[str]
    methods: dict[str, dict[str, np.ndarray]]
    candidates: dict[str, dict[str, np.ndarray]]
    served: str


@dataclass(frozen=True)
class Similarities:
    """Every method's similarities but W2T's, among all the adapters: they do not depend on the split, so several
    splits share them. `seconds`: what each took."""

    exact: dict[str, np.ndarray]
    sketch: np.ndarray
    raw: np.ndarray | None
    spectra: np.ndarray
    seconds: dict[str, float]
    #: the adapters' module stack, and the channel metrics' atoms among them (what a split's fitted metrics score
    #: them by, where the metric's module groups are the bank's)
    stack: ModuleStack | None = None
    bank: Bank | None = None

    def centred(self, reference: GramReference | None) -> dict[str, np.ndarray]:
        """The exact scores of the centred input Gram (REFERENCED) among all the adapters, by name, on the reference a
        split's labelled adapters fitted (none without one or without the stack); module cosine is split-free, so it is
        `exact`'s, not made again."""
        if reference is None or self.stack is None:
            return {}
        centred = exact_cosines(self.stack, self.stack, CENTRED_GRAM, reference)
        return {CENTRED_GRAM: centred, MODULE_CENTRED: module_centred(self.exact["module"], centred)}

    def reference(self, rows: list[int]) -> GramReference | None:
        """The centred input Gram's reference fitted on some of the adapters (None without the stack)."""
        return fit_gram_reference(self.stack, rows) if self.stack is not None else None

    def fitted(self, metrics: dict[str, ChannelMetric]) -> dict[str, np.ndarray]:
        """Each channel metric's similarity among all the adapters, by its score's name."""
        stack, bank = self.stack, self.bank
        if stack is None or bank is None:
            return {}
        return {name: m.similarity(bank) if bank.modules == m.groups else m.between(stack, stack) for name, m in metrics.items()}


def similarities(adapters: list[ZooAdapter], schema: SpaceSchema) -> Similarities:
    factors = [a.factors for a in adapters]
    t0 = time.perf_counter()
    stack = ModuleStack.of(factors, dense_modules(factors))
    exact = exact_matrices(stack, stack)
    t1 = time.perf_counter()
    sketch = module_sketches(factors, schema.module_names, sketch_width(len(schema.modules)))
    sketch_sim = sketch_module_cosines(sketch, sketch, len(schema.modules))
    t2 = time.perf_counter()
    raw = raw_factor_vectors(adapters, schema, max_rank(adapters))
    spec = spectra_vectors(adapters, schema, max_rank(adapters))
    raw_sim, spec_sim = (cosine(raw, raw) if raw is not None else None), cosine(spec, spec)
    t3 = time.perf_counter()
    bank = bank_matrices(stack, stack)
    seconds = {"dw_cosine": t1 - t0, "module_sketch": t2 - t1, "raw_and_spectra": t3 - t2, "channel_bank": time.perf_counter() - t3}
    return Similarities(exact, sketch_sim, raw_sim, spec_sim, seconds, stack, bank)


def stages(contrastive: bool) -> list[str]:
    """The stages of one split, in order (what `evaluate` reports to `on_stage` as each begins)."""
    return ["baselines", "w2t supervised", *(["w2t contrastive"] if contrastive else []), "invariance"]


def estimate_seconds(fit: list[ZooAdapter], schema: SpaceSchema, options: TrainOptions, splits: int, contrastive: bool) -> float:
    """Seconds the W2T trainings of `splits` splits should take here at most (every model running all its epochs; early
    stopping makes it less), from short timed trainings of one model on a split's training adapters: one of 1 epoch to
    warm up (the first training in a process pays for torch's start), then 1 and 3 epochs, whose difference is the
    cost of an epoch and whose rest the fixed cost of a training (tokens, the choices)."""
    timed = []
    for epochs in (1, 1, 3):
        t0 = time.perf_counter()
        train_w2t(fit, schema, replace(options, epochs=epochs, members=1), progress=False)
        timed.append(time.perf_counter() - t0)
    epoch = max((timed[2] - timed[1]) / 2, 0.0)
    fixed = max(timed[1] - epoch, 0.0)
    per_training = fixed + max(1, options.members) * options.epochs * epoch
    return splits * (2 if contrastive else 1) * per_training


def evaluate(
    adapters: list[ZooAdapter],
    schema: SpaceSchema,
    options: TrainOptions,
    test_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
    contrastive: bool = True,
    labelled_per_task: int | None = None,
    label_fraction: float | None = None,
    objective: str = "supervised",
    sims: Similarities | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Score every method on one seeded split; `contrastive=False` leaves W2T (contrastive) out (a row of nulls).
    `objective` is that of the W2T `zoo train` makes (its rows: w2t_supervised and default): "supervised", or
    "both" (also contrastive on every adapter, the unlabelled included).

    Full labels (default): a `test_fraction` of the adapters is held out, W2T trains on the rest. Label-scarce
    (`labelled_per_task` N or `label_fraction` F): per task, N adapters (or a fraction F, at least one) keep
    their labels and measurements; the others lose theirs and are the queries. W2T trains on every adapter
    (the unlabelled ones without targets), and kNN rows predict from the labelled adapters only.

    `sims`: the other methods' similarities, computed once for several splits (else here); `on_stage`: called
    with each of `stages(contrastive)` as it begins; `progress`: W2T's own progress bars."""
    stage = on_stage or (lambda _name: None)
    stage("baselines")
    train_pos, test_pos, fit = split_of(adapters, test_fraction, seed, labelled_per_task, label_fraction)
    methods: dict[str, Scores] = {}
    sims = sims or similarities(adapters, schema)
    timings: dict[str, float] = {k: v for k, v in sims.seconds.items() if k != "raw_and_spectra"}
    exact = sims.exact
    rows = {
        "dw_cosine": exact["dw"],
        "module_cosine": exact["module"],
        "input_gram_cosine": exact["input_gram"],
        "module_sketch": sims.sketch,
    }
    for name, sim in rows.items():
        methods[name] = _score(sim, adapters, test_pos, train_pos, predict=True)
    off = ~np.eye(len(adapters), dtype=bool)
    sketch_vs_exact = float(np.corrcoef(sims.sketch[off], exact["module"][off])[0, 1]) if len(adapters) > 2 else None
    methods["raw_cosine"] = _score(sims.raw, adapters, test_pos, train_pos, predict=True) if sims.raw is not None else _nothing()
    methods["spectra_knn"] = _score(sims.spectra, adapters, test_pos, train_pos, predict=True)

    embedders: dict[str, W2TEnsemble] = {}
    for kind, trained_as in (("supervised", objective), ("contrastive", "contrastive")) if contrastive else (("supervised", objective),):
        stage(f"w2t {kind}")
        t0 = time.perf_counter()
        emb = train_w2t(fit, schema, replace(options, objective=trained_as), progress=progress)
        timings[f"w2t_{kind}_train"] = time.perf_counter() - t0
        embedders[kind] = emb
        z = emb.embed(adapters)
        sim = z @ z.T
        name = f"w2t_{kind}"
        methods[name] = _score(sim, adapters, test_pos, train_pos, predict=kind == "contrastive")
        if kind == "supervised":
            methods[name].update(_head_scores(emb, adapters, test_pos))
            # centred on the reference W2T's choices fitted (on a sample of every adapter, no label read), or where it
            # made none the same fit
            free_exact = {**exact, **sims.centred(emb.gram_reference or sims.reference(reference_sample(list(range(len(adapters))))))}
            for s in REFERENCED:
                methods[f"{s}_cosine"] = (
                    _score(free_exact[s], adapters, test_pos, train_pos, predict=True) if s in free_exact else _nothing()
                )
            # the channel metrics this split's labels fitted
            served = with_fused({**free_exact, **sims.fitted(emb.channel_metrics)}, train_pos)
            methods["default"] = _default_scores(emb, served, sim, adapters, test_pos, train_pos)
            candidates = candidate_scores(served, sim, adapters, test_pos)
            free = copy.copy(emb)  # the same members, its choices made again without the metrics
            remember_and_choose(free, fit, replace(options, objective=trained_as, channel_metric=False))
            methods["default_without_metric"] = _default_scores(free, free_exact, sim, adapters, test_pos, train_pos)

    if not contrastive:
        methods["w2t_contrastive"] = _nothing()
    stage("invariance")
    sup = embedders["supervised"]
    probe = [adapters[p] for p in test_pos[:20]]
    z0 = sup.embed(probe)
    z1 = sup.embed([refactorized(a, seed=1000 + i) for i, a in enumerate(probe)])
    invariance = float((z0 * z1).sum(axis=1).min()) if len(probe) else None

    return {
        "space": schema.base_model,
        "seed": seed,
        "protocol": protocol(labelled_per_task, label_fraction),
        "objective": objective,
        "n_train": len(train_pos),
        "n_test": len(test_pos),
        "methods": {m: methods[m].means for m in METHODS if m in methods},
        "sketch_vs_exact_cosine_corr": sketch_vs_exact,
        "invariance_min_cosine": invariance,
        "search": sup.search.name,
        "w2t_predictor": {k: p.name for k, p in sup.predictors.items()},
        "choices": sup.choices,
        "search_candidates": {k: {name: float(v[k].mean()) for name, v in candidates.items() if len(v[k])} for k in REGRET_KEYS},
        "seconds": {k: round(v, 2) for k, v in timings.items()},
        "per_query": SplitQueries(
            [adapters[p].labels[TASK_KEY] for p in test_pos if adapters[p].labels.get(TASK_KEY)],
            {m: methods[m].per_query for m in METHODS if m in methods},
            candidates,
            sup.search.name,
        ),
    }


def candidate_scores(
    exact: dict[str, np.ndarray], w2t: np.ndarray, adapters: list[ZooAdapter], test_pos: list[int]
) -> dict[str, dict[str, np.ndarray]]:
    """Every search score the choice had (embed.selection.search_choice.search_candidates over `exact`'s scores: the search's channel
    metric too where it was fitted), by name: its REGRET_KEYS per query of the split (its held-out adapters with a
    task), for embed.training.eval_summary.cross_fitted_regret."""
    return {
        c.name: _score(_ranking(exact, w2t, c), adapters, test_pos, [], predict=False).per_query
        for c in search_candidates(scores_for(exact, "search"))
    }


def _similarity(exact: dict[str, np.ndarray], w2t: np.ndarray, score: SearchScore) -> np.ndarray:
    """A search score's similarity (its first stage) from the exact scores and the W2T cosine."""
    return score.similarity(exact[score.exact], w2t)


def _ranking(exact: dict[str, np.ndarray], w2t: np.ndarray, score: SearchScore) -> np.ndarray:
    """How a search score ranks every adapter for every other (SearchScore.ranking; none returns itself)."""
    return score.ranking(exact[score.exact], w2t, np.eye(len(w2t), dtype=bool), rerank_values(score, exact))


def _default_scores(
    emb: W2TEnsemble, exact: dict[str, np.ndarray], w2t: np.ndarray, adapters: list[ZooAdapter], test_pos: list[int], train_pos: list[int]
) -> Scores:
    """What `zoo search` and `zoo predict` do after `zoo train`: the chosen search score, and each target by its
    chosen predictor (a kNN among the labelled training adapters by the similarity and k chosen, the heads or a
    readout of the embedding, or the kNN in the embedding), the task's probabilities calibrated as served."""
    out = _score(_ranking(exact, w2t, emb.search), adapters, test_pos, train_pos, predict=False)
    out.update(_calibrated_task_scores(emb, exact, w2t, adapters, test_pos, train_pos))
    source = _head_scores(emb, adapters, test_pos)
    if isinstance(knn := emb.predictor(PERF_METRIC), KnnPredictor):
        sim = _similarity(exact, w2t, knn.similarity)
        slope = emb.trend_slopes.get(PERF_METRIC) if knn.trend else None
        served = functools.partial(emb.clip, PERF_METRIC)
        source = _score(sim, adapters, test_pos, train_pos, True, knn.k, knn.temperature, knn.width, slope, served)
    out.means.update({k: source.means.get(k) for k in ("perf_mae", "perf_spearman", "perf_kendall")})
    return out


def _calibrated_task_scores(
    emb: W2TEnsemble, exact: dict[str, np.ndarray], w2t: np.ndarray, adapters: list[ZooAdapter], test_pos: list[int], train_pos: list[int]
) -> Scores:
    """Accuracy (and whether each query's is right), macro F1, expected calibration error and wrong answers given at
    ≥ 99.5 % of the task as served: the chosen predictor's shares, calibrated."""
    classes = emb.config.categorical.get(TASK_KEY)
    test = [adapters[p] for p in test_pos]
    if classes is None or not test or not all(a.labels.get(TASK_KEY) in classes for a in test):
        return Scores({}, {})
    if isinstance(knn := emb.predictor(TASK_KEY), KnnPredictor):
        sim = _similarity(exact, w2t, knn.similarity)[np.ix_(test_pos, train_pos)]
        known = [adapters[p].labels.get(TASK_KEY, "") for p in train_pos]
        index = np.array([classes.index(label) if label in classes else -1 for label in known])
        shares = knn_vote_shares(sim, index, len(classes), knn.k, knn.temperature)
    else:
        shares = emb.predict(test)[0][TASK_KEY]
    probs = emb.calibrated(TASK_KEY, shares)
    truth = np.array([classes.index(a.labels[TASK_KEY]) for a in test])
    top = probs.argmax(axis=1)
    out = _task_scores([classes[i] for i in top], [a.labels[TASK_KEY] for a in test])
    out.means["attr_ece"] = expected_calibration_error(probs.max(axis=1), top == truth)
    out.per_query[CONFIDENCE] = probs.max(axis=1)
    out.means["attr_wrong_at_100"] = float(((probs.max(axis=1) >= 0.995) & (top != truth)).sum())
    return out


def _head_scores(emb: W2TEnsemble, adapters: list[ZooAdapter], test_pos: list[int]) -> Scores:
    test = [adapters[p] for p in test_pos]
    probs, values = emb.predict(test)
    out = Scores({}, {})
    classes = emb.config.categorical.get(TASK_KEY)
    if classes is not None and all(TASK_KEY in a.labels for a in test):
        out.update(_task_scores([classes[i] for i in probs[TASK_KEY].argmax(axis=1)], [a.labels[TASK_KEY] for a in test]))
    if PERF_METRIC in values and all(PERF_METRIC in a.measurements for a in test):
        out.means.update(regression(values[PERF_METRIC], np.array([a.measurements[PERF_METRIC] for a in test])))
    return out
