"""The few-label channel metric served (embed/selection/fitted.py): a space whose out-of-fold choice picks it searches by it,
its checkpoint carries it, and a choice where it cannot help keeps the training-free reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from embed.selection.choice import Fold
from embed.selection.fitted import Purpose, out_of_fold
from embed.selection.search_choice import choose_search
from embed.w2t.ensemble import W2TEnsemble
from tests.conftest import CLI
from tests.factories import TinyLM
from tests.test_channel_metric import random_adapters
from tests.test_engine import stored_factors
from zoo.domain.channel_metric import ChannelMetric, bank_matrices
from zoo.domain.channels import factor_stack
from zoo.domain.exact_scores import EXACT_SCORES, exact_cosines
from zoo.domain.methods import SearchScore, fitted_score

#: the module whose update says the task; every other one is mostly the run's "style", which has nothing to do with it
TASK_MODULE = "layers.0.q_proj"
TARGETS = ("q_proj", "v_proj")
TASKS, STYLES, COUNT = 4, 3, 24


def write_task_in_one_module(root: Path) -> Path:
    """COUNT PEFT adapters of TinyLM (q_proj and v_proj of both layers, r 4) written by PEFT's save_pretrained with
    designed factors: TASK_MODULE's is its task's (small, a little noise), the three others' its style's (large), so
    the whole update, module cosine and the input Gram find the style and only a metric that weighs TASK_MODULE finds
    the task. Returns root (root/zoo/aNN, root/labels.csv)."""
    model = get_peft_model(TinyLM(seed=0), LoraConfig(target_modules=list(TARGETS), r=4, lora_alpha=4))
    gen = torch.Generator().manual_seed(0)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    task_basis = [{n: torch.randn(p.shape, generator=gen) for n, p in lora.items()} for _ in range(TASKS)]
    style_basis = [{n: torch.randn(p.shape, generator=gen) for n, p in lora.items()} for _ in range(STYLES)]
    rows = ["name,task,test_accuracy"]
    for i in range(COUNT):
        task, style = i % TASKS, (i // TASKS) % STYLES
        with torch.no_grad():
            for name, p in lora.items():
                own = f".{TASK_MODULE}." in name
                basis, scale = (task_basis[task], 0.1) if own else (style_basis[style], 1.0)
                p.copy_(scale * (basis[name] + 0.1 * torch.randn(p.shape, generator=gen)))
        model.save_pretrained(str(root / "zoo" / f"a{i:02d}"))
        rows.append(f"a{i:02d},t{task},{0.5 + 0.1 * task + 0.01 * (i % 5)}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


def test_a_space_whose_choice_picks_the_metric_searches_by_it(cli: CLI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_task_in_one_module(tmp_path)
    rc, ingested = cli.json_lines("ingest", "--no-embed", str(src / "zoo"), "--labels", str(src / "labels.csv"), "--base-model", "tiny")
    assert rc == 0
    by_name = {r["name"]: r["adapter_id"] for r in ingested}
    rc, (info,) = cli.json_lines("train", "--epochs", "2", "--members", "2")
    assert rc == 0
    scores = info["choices"]["search"]["scores"]
    # the metric, its top re-ordered by its fusion with dW: the reference over a metric pick (choice.hedged)
    assert info["search"] == "metric:search then top 5 by fused:search", info["choices"]["search"]["reason"]
    assert scores["metric:search"] > max(scores[s] for s in EXACT_SCORES)
    emb = W2TEnsemble.load(Path(info["checkpoint"]))
    metric = emb.channel_metrics["metric:search"]
    assert {fitted_score(p) for p in ("search", "task", "test_accuracy")} <= set(emb.channel_metrics)
    # the checkpoint holds it whole: the same metric read back from its JSON
    again = ChannelMetric.from_dict(json.loads(json.dumps(metric.as_dict())))
    assert again.as_dict() == metric.as_dict() and again.groups == metric.groups and math.isinf(again.shrink) == math.isinf(metric.shrink)
    shares = metric.channel_shares()
    assert sum(w for (c, g), w in zip(metric.atoms, metric.weights, strict=True) if g == "q_proj@0") > 0.5 * sum(metric.weights), shares

    # zoo search serves it: the metric's top 10, computed here from the stored factors in r×r blocks, each result
    # shown with its metric score (the fused order itself: test_search_cli's served_fusion)
    query, others = by_name["a00"], sorted(i for name, i in by_name.items() if name != "a00")
    rc, (found,) = cli.json_lines("search", str(query), "-k", "6")
    assert rc == 0 and found["method"] == "hybrid" and found["module_stage"] == "exact (module store)"
    want = metric.between(factor_stack(stored_factors(cli, others)), factor_stack(stored_factors(cli, [query])))[0]
    ids = [r["adapter_id"] for r in found["results"]]
    assert set(ids) <= {others[j] for j in np.argsort(-want, kind="stable")[:10]}
    assert [r["score"] for r in found["results"]] == pytest.approx([want[others.index(i)] for i in ids], abs=1e-5)
    assert {r["labels"]["task"] for r in found["results"][:5]} == {"t0"}  # a00's task: the metric finds it

    # a space without a module store (past ZOO_MODULE_STORE_BYTES) does not weigh it, and says so
    monkeypatch.setenv("ZOO_MODULE_STORE_BYTES", "1")
    rc, (without,) = cli.json_lines("train", "--epochs", "2", "--members", "2")
    assert rc == 0 and "metric:search" not in without["choices"]["search"]["scores"]
    assert "no channel metric: the exact scores come from module sketches" in without["choices"]["search"]["reason"]


def test_the_metric_loses_where_the_labels_say_nothing_of_the_weights() -> None:
    """Tasks drawn independently of the adapters: the metric fitted inside each fold is weighed and the guard keeps
    the training-free reference, the whole update's cosine."""
    adapters = random_adapters(7, 40)
    stack = factor_stack(adapters)
    rng = np.random.default_rng(0)
    tasks = [f"t{t}" for t in rng.integers(0, 4, len(adapters))]
    perm = rng.permutation(len(adapters))
    held = [sorted(perm[k::4].tolist()) for k in range(4)]  # each adapter held out by one of four members
    folds = [Fold(val, sorted(set(range(len(adapters))) - set(val)), rng.normal(size=(len(adapters), 8))) for val in held]
    for f in folds:
        f.z[:] /= np.linalg.norm(f.z, axis=1, keepdims=True)
    exact = {s: exact_cosines(stack, stack, s) for s in EXACT_SCORES}
    oof = out_of_fold(bank_matrices(stack, stack), {"search": Purpose("search", tasks)}, folds)
    assert set(oof) == {"metric:search"} and not np.isnan(oof["metric:search"]).any()  # every adapter held out once
    choice = choose_search({**exact, **oof}, tasks, folds)
    assert "metric:search" in {s.name for s in choice.scores}
    assert choice.chosen == SearchScore() and "the training-free dw stays" in choice.reason
