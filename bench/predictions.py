"""Predictions set beside what was given, over every labelled adapter of a zoo (the demo's, after `zoo quickstart`).

For each stored adapter with a given value of an attribute, its served prediction (embed.serving.resources.predict, what the
adapter page, `zoo predict` and the API show) is compared with that value:

- how many predictions disagree with the given value, how many of them are marked as disagreeing (`agrees` False),
  and how many of those are still shown as sure;
- the reliability of what is shown as sure: per equal-width confidence bin, the count, the mean probability and the
  accuracy against the given values, and whether accuracy ≥ mean − 0.05 (embed.selection.calibration.SURE_SLACK);
- for each metric, how often the measured value lies in the predicted 90 % interval.

    python -m bench.predictions [--data-dir DIR] [--space NAME]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

from embed.selection.calibration import ECE_BINS, SURE_SLACK
from embed.serving import resources
from embed.serving.engine import QueryEngine
from embed.serving.refs import StoredId
from zoo.config import Settings
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter
from zoo.store.session import session_factory


def measure(settings: Settings, space: str | None) -> dict[str, object]:
    sessions = session_factory(settings.database_url)
    engine = QueryEngine(sessions, BlobStore(settings.blob_dir), settings.data_dir)
    with sessions() as session:
        ids = [i for (i,) in session.query(Adapter.id).order_by(Adapter.id)]
        found = [resources.predict(engine, session, StoredId(i), space, lineage=False) for i in ids]
    sure: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    attributes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    metrics: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p in found:
        for key, c in p["confidence"].items():
            if c["given"] is None:
                continue
            right = p["attributes"][key][0]["value"] == c["given"]
            counts = attributes[key]
            counts["given"] += 1
            counts["disagree"] += not right
            counts["disagree_marked"] += (not right) and c["agrees"] is False
            counts["disagree_shown_sure"] += (not right) and c["sure"]
            if c["sure"]:
                sure[key].append((p["attributes"][key][0]["probability"], right))
        for key, m in p["metrics"].items():
            if m["measured"] is not None and m["within"] is not None:
                metrics[key]["measured"] += 1
                metrics[key]["within_interval"] += bool(m["within"])
    return {
        "adapters": len(ids),
        "attributes": {k: dict(v) for k, v in attributes.items()},
        "sure_bins": {k: reliability(v) for k, v in sure.items()},
        "metrics": {k: {**v, "coverage": round(v["within_interval"] / v["measured"], 3)} for k, v in metrics.items()},
    }


def reliability(items: list[tuple[float, bool]]) -> list[dict[str, object]]:
    """Per equal-width confidence bin holding items: its range, count, mean probability, accuracy, and whether it kept
    its promise (accuracy ≥ mean − SURE_SLACK)."""
    conf = np.array([c for c, _ in items])
    right = np.array([r for _, r in items], np.float64)
    which = np.minimum((conf * ECE_BINS).astype(np.int64), ECE_BINS - 1)
    out = []
    for b in range(ECE_BINS):
        inside = which == b
        if inside.any():
            mean, acc = float(conf[inside].mean()), float(right[inside].mean())
            out.append(
                {
                    "bin": f"{b / ECE_BINS:.1f}-{(b + 1) / ECE_BINS:.1f}",
                    "count": int(inside.sum()),
                    "mean_probability": round(mean, 3),
                    "accuracy": round(acc, 3),
                    "kept": acc >= mean - SURE_SLACK,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="the zoo's data dir (default: $ZOO_DATA_DIR, else ~/.local/share/zoo)")
    parser.add_argument("--db", help="its database URL (default: SQLite in the data dir)")
    parser.add_argument("--space", help="the embedding space (default: the zoo's only one)")
    args = parser.parse_args()
    result = measure(Settings.load(args.db, args.data_dir), args.space)
    for key, bins in result["sure_bins"].items():  # type: ignore[union-attr]
        for b in bins:
            print(f"{key} sure {b['bin']}: {b['count']} predictions, mean {b['mean_probability']}, right {b['accuracy']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
