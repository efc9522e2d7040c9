"""bench/text_search.py on zoos it did not build: the -seeded recipes' descriptions, a built zoo given by --zoo, and the
summary's zero-shot rows (intervals where the base runs, "not applicable" where it does not)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.text_search import DESCRIPTIONS, chance, descriptions, ndcg10, summary, zoo_dir
from zoo.reference import digits, shapes, text

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("recipe", "tasks"),
    [
        ("digits-vit", digits.TASKS),
        ("digits-vit-seeded", digits.TASKS),
        ("shapes-cnn", shapes.TASKS),
        ("docs-minilm", text.TASKS),
        ("docs-minilm-seeded", text.TASKS),
    ],
)
def test_every_task_of_a_recipe_and_its_seeded_variant_has_a_description(recipe: str, tasks: tuple[str, ...]) -> None:
    assert set(descriptions(recipe)) == set(tasks)
    assert descriptions(recipe) == DESCRIPTIONS[recipe.removesuffix("-seeded")]


def test_a_recipe_without_descriptions_is_refused() -> None:
    with pytest.raises(SystemExit, match="no task descriptions for recipe 'shapes-lineage'"):
        descriptions("shapes-lineage")


def test_a_built_zoo_is_used_where_it_is_and_only_once_finished(tmp_path: Path) -> None:
    built = tmp_path / "dms-zoo"
    built.mkdir()
    with pytest.raises(SystemExit, match="no labels.csv"):  # a build still running writes labels.csv last
        zoo_dir("docs-minilm-seeded", tmp_path / "zoos", built)
    (built / "labels.csv").write_text("name,task\n")
    assert zoo_dir("docs-minilm-seeded", tmp_path / "zoos", built) == built
    assert zoo_dir("docs-minilm-seeded", tmp_path / "zoos", None) == tmp_path / "zoos" / "docs-minilm-seeded"


def test_zoo_takes_one_recipe(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.text_search",
            "--zoo",
            str(tmp_path),
            "--recipes",
            "digits-vit,docs-minilm",
            "--work",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--zoo is the zoo of one recipe" in run.stderr
    assert not (tmp_path / "w" / "results.jsonl").exists()


def _records(recipe: str, zero_shot: bool) -> list[dict[str, object]]:
    """Per-task records as bench.text_search.evaluate writes them, for 3 splits × 3 tasks; zero-shot's where it runs."""
    rng = np.random.default_rng(0)
    out: list[dict[str, object]] = []
    for split in range(3):
        for task in ("a", "b", "c"):
            r: dict[str, object] = {"recipe": recipe, "split": split, "task": task}
            r["chance.hit@1"], r["chance.ndcg@10"] = chance(11, 2)
            r["chance.all_ndcg@10"] = chance(22, 4)[1]
            for method in ("full_text", "dense", "expansion", "default", *(("zero_shot",) if zero_shot else ())):
                good = 0.0 if method == "full_text" else float(rng.uniform(0.2, 0.9))
                r.update({f"{method}.hit@1": float(good > 0.5), f"{method}.ndcg@10": good, f"{method}.all_ndcg@10": good})
            out.append(r)
    return out


def test_zero_shot_has_intervals_where_the_base_runs_and_is_not_applicable_elsewhere() -> None:
    runs = summary(_records("docs-minilm-seeded", zero_shot=True))
    shot = runs["zero_shot"]
    assert isinstance(shot, dict)
    for measure in ("hit@1", "ndcg@10", "all_ndcg@10"):
        mean, low, high = shot[measure]
        assert low <= mean <= high
    assert "gain_ndcg@10_zero_shot_vs_full_text" in runs
    bar = runs["chance"]
    assert isinstance(bar, dict)
    assert bar["ndcg@10"] == [round(chance(11, 2)[1], 3)] * 3  # the same on every query: no spread
    gain = runs["gain_ndcg@10_zero_shot_vs_chance"]
    assert isinstance(gain, list)
    assert gain[0] == pytest.approx(shot["ndcg@10"][0] - bar["ndcg@10"][0], abs=0.002)
    assert "gain_ndcg@10_default_vs_expansion" in runs
    image = summary(_records("digits-vit-seeded", zero_shot=False))
    assert image["zero_shot"] == "not applicable"
    assert "gain_ndcg@10_default_vs_expansion" not in image


@pytest.mark.parametrize(("ranked", "relevant"), [(6, 1), (6, 2), (7, 7), (12, 3)])
def test_chance_is_the_mean_over_every_ordering(ranked: int, relevant: int) -> None:
    """A random ordering's expected hit@1 and nDCG@10: the mean over every placement of the relevant items (12 items,
    more than the 10 nDCG@10 reads: the places past the 10th count nothing)."""
    places = list(itertools.combinations(range(ranked), relevant))
    hits = [float(0 in c) for c in places]
    scores = [ndcg10(list(range(ranked)), set(c)) for c in places]
    hit, ndcg = chance(ranked, relevant)
    assert hit == pytest.approx(np.mean(hits))
    assert ndcg == pytest.approx(np.mean(scores))
    assert chance(0, 0) == (0.0, 0.0)
