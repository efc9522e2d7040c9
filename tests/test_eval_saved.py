"""`zoo eval --save DIR` and `--pool DIR...`: saved splits summarize exactly as the run that made them, a run goes on
from the splits already saved and refuses those run otherwise, and the search regret pools over runs query by query,
each run cross-fitted on its own splits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from embed.training.evaluate import REGRET_KEYS, SplitQueries
from embed.training.saved_splits import pooled_regret
from tests.conftest import CLI
from tests.factories import write_random_peft_adapters

ARGS = ("eval", "--epochs", "2", "--members", "1", "--test-fraction", "0.25", "--no-contrastive")


@pytest.mark.slow
def test_saved_splits_summarize_as_their_run_resume_and_pool(cli: CLI, tmp_path: Path) -> None:
    paths = write_random_peft_adapters(tmp_path / "zoo", 12)
    rows = [f"{p.name},{'ab'[i % 2]},{0.5 + i / 40}" for i, p in enumerate(paths)]
    (tmp_path / "labels.csv").write_text("\n".join(["name,task,test_accuracy", *rows]) + "\n")
    rc, _ = cli.json_lines("ingest", "--no-embed", str(tmp_path / "zoo"), "--labels", str(tmp_path / "labels.csv"), "--base-model", "tiny")
    assert rc == 0
    full, two = tmp_path / "full", tmp_path / "two"

    rc, (whole,) = cli.json_lines(*ARGS, "--splits", "2", "--save", str(full))
    assert rc == 0 and sorted(p.name for p in full.iterdir()) == ["split-0.json", "split-1.json"]
    saved = json.loads((full / "split-1.json").read_text())["result"]["per_query"]
    assert len(saved["tasks"]) == whole["n_test"] and saved["served"] == whole["search_regret"]["mrr"]["splits"][1]["served"]
    calibrated = whole["calibration"]  # the served task probabilities of every query, saved, pooled over the splits
    assert (calibrated["queries"], calibrated["splits"]) == (len(saved["methods"]["default"]["attr_confidence"]) * 2, 2)
    assert calibrated["splits_mean"] == pytest.approx(np.mean([r["methods"]["default"]["attr_ece"] for r in whole["splits"]]))
    rc, (pooled,) = cli.json_lines("eval", "--pool", str(full))
    assert rc == 0 and pooled == whole  # every mean, interval and regret as the run gave them
    two.mkdir()
    for p in full.iterdir():
        shutil.copy(p, two)

    rc, out, err = cli(*ARGS[:2], "3", *ARGS[3:], "--splits", "1", "--save", str(full))
    assert rc != 0 and "other options (epochs)" in err and not out
    rc, (more,) = cli.json_lines(*ARGS, "--seed", "1", "--splits", "2", "--save", str(full))  # split 1 read back, split 2 run
    assert rc == 0 and more["splits"][0] == whole["splits"][1] and len(list(full.glob("split-*.json"))) == 3

    rc, (three,) = cli.json_lines("eval", "--pool", str(full))
    rc, (both,) = cli.json_lines("eval", "--pool", str(full), str(two), "--json")
    assert rc == 0 and [r["dir"] for r in both["runs"]] == [str(full), str(two)] and three["seeds"] == [0, 1, 2]
    for key in REGRET_KEYS:
        runs = [three["search_regret"][key], whole["search_regret"][key]]
        assert [r["search_regret"][key]["mean"] for r in both["runs"]] == [r["mean"] for r in runs]
        pool = both["pooled_regret"][key]
        assert (pool["runs"], pool["splits"], pool["tasks"], pool["queries"]) == (2, 5, 2, 5 * whole["n_test"])
        assert pool["mean"] == pytest.approx((3 * runs[0]["mean"] + 2 * runs[1]["mean"]) / 5)


def _split(seed: int, space: str, candidates: dict[str, list[float]], served: str) -> dict:
    """A split's result as embed.training.evaluate.evaluate gives it, with what the regret reads: two queries of tasks x and y."""
    scores = {name: dict.fromkeys(REGRET_KEYS, np.array(v)) for name, v in candidates.items()}
    return {"seed": seed, "space": space, "per_query": SplitQueries(["x", "y"], {}, scores, served)}


def test_the_pooled_regret_is_each_runs_cross_fitted_loss_over_every_query() -> None:
    """Run one: `a` is best on splits 1 and 2, so split 0 fixes `a` against the served `b` (a loss of 0.5 a query on
    average), splits 1 and 2 fix `a` as served (0). Run two: `b` is best on the other split both times, and serves on
    both (0). A run of one split has nothing to cross-fit on and is left out."""
    one = [
        _split(0, "s", {"a": [1.0, 0.0], "b": [0.0, 0.0]}, "b"),
        _split(1, "s", {"a": [1.0, 1.0], "b": [0.0, 0.0]}, "a"),
        _split(2, "s", {"a": [1.0, 0.0], "b": [0.0, 0.0]}, "a"),
    ]
    two = [_split(0, "t", {"a": [0.0, 0.0], "b": [1.0, 1.0]}, "b"), _split(1, "t", {"a": [0.0, 0.0], "b": [1.0, 0.0]}, "b")]
    lonely = [_split(0, "u", {"a": [1.0, 1.0], "b": [0.0, 0.0]}, "b")]
    pooled = pooled_regret([one, two, lonely])
    assert set(pooled) == set(REGRET_KEYS)
    for key in REGRET_KEYS:
        p = pooled[key]
        assert (p["runs"], p["splits"], p["tasks"], p["queries"]) == (2, 5, 4, 10)  # tasks x and y of spaces s and t
        assert p["mean"] == pytest.approx(1.0 / 10) and p["low"] <= p["mean"] <= p["high"] and p["low"] >= 0
    assert pooled_regret([lonely]) == {}
