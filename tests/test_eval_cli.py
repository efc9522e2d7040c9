"""`zoo eval` as a newcomer reads it: an estimate before the splits run, tables whose columns stand apart, and a closing
line that names the leading method with a 95 % paired interval over the splits (the seeded zoo's 12 real PEFT adapters)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import t

from embed.evaluate import KEYS, MAIN_METRIC
from tests.conftest import CLI

ARGS = ("eval", "--epochs", "2", "--members", "1", "--test-fraction", "0.25", "--splits", "2", "--no-contrastive")


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


@pytest.mark.slow
def test_zoo_eval_estimates_aligns_and_names_a_winner(cli: CLI, seed_sources: Path) -> None:
    labels = str(seed_sources / "labels.csv")
    rc, _ = cli.json_lines("ingest", str(seed_sources / "zoo"), "--labels", labels, "--base-model", "tiny")
    assert rc == 0

    rc, (result,) = cli.json_lines(*ARGS)
    assert rc == 0 and {"seeds", "methods", "methods_std", "search_regret", "splits"} <= set(result)  # the shape as before
    lead = result["comparison"]
    assert lead["metric"] == MAIN_METRIC == "mrr" and lead["splits"] == 2
    per_split = {m: [r["methods"][m][MAIN_METRIC] for r in result["splits"]] for m in result["methods"]}
    means = {m: np.mean(v) for m, v in per_split.items() if None not in v}
    assert means[lead["first"]] == max(means.values()) and means[lead["second"]] <= means[lead["first"]]
    diffs = np.array(per_split[lead["first"]]) - np.array(per_split[lead["second"]])
    half = t.ppf(0.975, 1) * diffs.std(ddof=1) / np.sqrt(2)
    assert lead["difference"] == pytest.approx(diffs.mean()) and lead["low"] == pytest.approx(diffs.mean() - half)
    assert lead["clear"] == (not lead["low"] <= 0 <= lead["high"])
    versus = result["default_vs_dw_cosine"]
    assert (versus["first"], versus["second"]) == ("default", "dw_cosine")

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
    closing = lines[-2]
    if lead["clear"]:
        assert closing.startswith(f"{lead['first']} wins on mrr over {lead['second']} by {lead['difference']:.3f}")
    else:
        assert closing.startswith(f"no clear winner on mrr: {lead['first']} leads {lead['second']} by {lead['difference']:.3f}")
        assert f"95 % paired interval over 2 splits {lead['low']:+.3f}..{lead['high']:+.3f} includes 0" in closing
    assert "default" in lines[-1] and "dw_cosine" in lines[-1]
