"""`zoo eval` as a newcomer reads it: an estimate before the splits run, tables whose columns stand apart, a line that
names the leading method with a 95 % paired interval, and a closing table of the default against dW cosine and of the
search choice's cross-fitted regret, with their intervals (the seeded zoo's 12 real PEFT adapters)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from embed.training.evaluate import KEYS, MAIN_METRIC, TRAINING_FREE_KNN, VERSUS_KEYS
from tests.conftest import CLI
from zoo.cli.render import interval_text

ARGS = ("eval", "--epochs", "2", "--members", "1", "--test-fraction", "0.25", "--splits", "2", "--no-contrastive")


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


@pytest.mark.slow
def test_zoo_eval_estimates_aligns_and_names_a_winner(cli: CLI, seed_sources: Path) -> None:
    labels = str(seed_sources / "labels.csv")
    rc, _ = cli.json_lines("ingest", "--no-embed", str(seed_sources / "zoo"), "--labels", labels, "--base-model", "tiny")
    assert rc == 0

    rc, (result,) = cli.json_lines(*ARGS)
    assert rc == 0 and {"seeds", "methods", "methods_std", "search_regret", "splits", "interval_scheme"} <= set(result)
    assert not any("per_query" in r for r in result["splits"])  # the per-query scores stay out of the JSON
    lead = result["comparison"]
    assert lead["metric"] == MAIN_METRIC == "mrr" and (lead["splits"], lead["resampled"]) == (2, "splits and query tasks")
    per_split = {m: [r["methods"][m][MAIN_METRIC] for r in result["splits"]] for m in result["methods"]}
    means = {m: np.mean(v) for m, v in per_split.items() if None not in v}
    assert means[lead["first"]] == max(means.values()) and means[lead["second"]] <= means[lead["first"]]
    diffs = np.array(per_split[lead["first"]]) - np.array(per_split[lead["second"]])
    assert lead["difference"] == pytest.approx(diffs.mean())  # the mean per query: as many queries in each split
    assert lead["clear"] == (not lead["low"] <= 0 <= lead["high"])
    versus = result["default_versus"]
    assert set(versus) == {"dw_cosine", "module_cosine", "input_gram_cosine", "centred_gram_cosine", "module_centred_cosine"}
    assert all(set(v) == set(VERSUS_KEYS) for v in versus.values())
    for row in ("centred_gram_cosine", "module_centred_cosine"):  # each split's own reference
        assert all(r["methods"][row]["mrr"] is not None for r in result["splits"])
    spearman = versus["dw_cosine"]["perf_spearman"]  # one value per split: the splits resampled
    per = [r["methods"]["default"]["perf_spearman"] - r["methods"]["dw_cosine"]["perf_spearman"] for r in result["splits"]]
    assert spearman["resampled"] == "splits" and spearman["difference"] == pytest.approx(np.mean(per))
    assert min(per) - 1e-12 <= spearman["low"] <= spearman["high"] <= max(per) + 1e-12
    assert result["spearman_versus_best_knn"]["second"] in TRAINING_FREE_KNN
    assert set(result["search_regret"]) == {"hit@1", "mrr", "ndcg@10"}

    rc, out, err = cli(*ARGS)
    assert rc == 0
    estimate = re.search(r"zoo eval: 2 splits of 12 adapters in tiny \(1 W2T model × up to 2 epochs, once a split\): about (\d+) s", err)
    assert estimate is not None and re.search(r"took \d+ s \(estimated: about \d+ s\)", err)
    lines = out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.strip().startswith("method ")]
    assert [columns(lines[i])[1:] for i in headers] == [list(KEYS[:4]), list(KEYS[4:7]), list(KEYS[7:])]
    for i in headers:  # every header stands over its cells, right-aligned: each row ends where the header ends
        rows = lines[i + 1 : i + 1 + len(result["methods"])]
        assert [columns(r)[0] for r in rows] == list(result["methods"])
        assert {len(r) for r in rows} == {len(lines[i])}
    table = next(i for i, line in enumerate(lines) if line.strip().startswith("measure "))
    assert columns(lines[table]) == ["measure", "default − dw_cosine", "search regret"]
    rows = [columns(line) for line in lines[table + 1 : table + 6]]
    assert [r[0] for r in rows] == ["hit@1", "mrr", "ndcg@10", "attr_acc", "perf_spearman"]
    for measure, shown, regret in rows:
        assert shown == interval_text(versus["dw_cosine"][measure]) and regret == interval_text(result["search_regret"].get(measure))
    assert re.fullmatch(r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", rows[0][1])
    assert lines[-2].startswith(f"perf_spearman, default − {result['spearman_versus_best_knn']['second']} (the best training-free kNN")
    c = result["calibration"]  # the served task probabilities' error: the splits' mean, its chance floor, all queries pooled
    assert lines[-1] == (
        f"attr_ece of the served task probabilities: {c['splits_mean']:.3f} the splits' mean (a calibrated predictor's, by chance "
        f"alone: {c['floor']:.3f}), {c['pooled']:.3f} over all {c['queries']} queries pooled"
    )
    assert c["splits"] == 2 and c["splits_mean"] == pytest.approx(np.mean([r["methods"]["default"]["attr_ece"] for r in result["splits"]]))
    closing = lines[table - 3]
    if lead["clear"]:
        assert closing.startswith(f"{lead['first']} wins on mrr over {lead['second']} by {lead['difference']:.3f}")
    else:
        assert closing.startswith(f"no clear winner on mrr: {lead['first']} leads {lead['second']} by {lead['difference']:.3f}")
        over = f"bootstrap over 2 splits × {lead['tasks']} query tasks, {lead['low']:+.3f}..{lead['high']:+.3f} includes 0"
        assert over in closing
