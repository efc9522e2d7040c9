"""bench.performance_ceiling: oracles told each adapter's task and hyperparameters, on `zoo eval`'s splits."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_the_oracles_rank_what_their_inputs_explain(tmp_path: Path) -> None:
    """Accuracy that is its task's level plus a rise with the log of the steps: the task's mean ranks only the tasks,
    the oracles that read the steps rank nearly every query, and every split is scored."""
    rng = np.random.default_rng(0)
    columns = ["name", "task", "rank", "alpha", "learning_rate", "steps", "n_train", "target_modules", "seed", "test_accuracy"]
    with (tmp_path / "labels.csv").open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        for i in range(120):
            task, steps = int(rng.integers(4)), int(rng.choice([10, 20, 40, 80, 160]))
            accuracy = 0.2 * task + 0.05 * np.log(steps) + 0.002 * rng.normal()
            out.writerow([f"a{i:03d}", f"t{task}", 4, 8.0, 0.001, steps, 64, str(rng.choice(["qv", "all"])), i, f"{accuracy:.6f}"])
    command = [sys.executable, "-m", "bench.performance_ceiling", str(tmp_path), "--splits", "3"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    oracles = json.loads(run.stdout.strip().splitlines()[-1])["oracles"]
    assert all(len(o["splits"]) == 3 for o in oracles.values())
    assert oracles["task + hyperparameters, linear"]["spearman"] > 0.97
    assert oracles["task mean"]["spearman"] < oracles["task + hyperparameters, linear"]["spearman"] - 0.03
