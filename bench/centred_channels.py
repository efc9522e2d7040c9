"""Benchmark: do the first- and second-order channels retrieve better with the zoo's mean update removed?

Per module, the cosine matrix of every stored adapter's update (zoo.domain.channels.channel_group_sums, one group per
module) is centred as a kernel: K_ij - r_i - r_j + g (r the row means, g the grand mean; the mean of the unit-norm
updates removed), renormalised, then averaged over modules as module cosine is; dW cosine is centred on the whole
update's Gram. Every adapter with a task queries every other (relevant: same task), the plain and the centred score
alike; the difference is paired per query with a 95 % interval from a bootstrap over the tasks and, within each, the
queries.

    python -m bench.centred_channels --data-dir DIR
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from embed.data.dataset import base_models, load_adapters
from zoo.config import Settings
from zoo.domain.channels import channel_group_sums, factor_stack
from zoo.store.blob_backends import open_blob_store
from zoo.store.session import session_factory

RESAMPLES = 2000


def centred(K: np.ndarray) -> np.ndarray:
    """The kernel K centred (the mean of what it compares removed) and renormalised to cosines."""
    r = K.mean(axis=1)
    Kc = K - r[:, None] - r[None, :] + K.mean()
    d = np.sqrt(np.maximum(np.diag(Kc), 1e-30))
    return Kc / np.outer(d, d)


def per_query(S: np.ndarray, tasks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hit@1, reciprocal rank of the first same-task adapter) of each adapter querying the others."""
    S = S.copy()
    np.fill_diagonal(S, -np.inf)
    relevant = tasks[np.argsort(-S, axis=1)] == tasks[:, None]
    return relevant[:, 0].astype(float), 1.0 / (relevant.argmax(axis=1) + 1)


def paired(a: np.ndarray, b: np.ndarray, tasks: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean of a - b with its 95 % interval, the tasks and the queries within them resampled."""
    diff = a - b
    by_task = [np.flatnonzero(tasks == t) for t in np.unique(tasks)]
    means = []
    for _ in range(RESAMPLES):
        picked = [by_task[t] for t in rng.integers(0, len(by_task), len(by_task))]
        means.append(diff[np.concatenate([rng.choice(ids, len(ids)) for ids in picked])].mean())
    low, high = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--space", help="base model (default: the first)")
    args = p.parse_args()
    settings = Settings.load(data_dir=args.data_dir)
    with session_factory(settings.database_url)() as session:
        adapters = load_adapters(session, open_blob_store(settings), args.space or base_models(session)[0])
    adapters = [a for a in adapters if a.labels.get("task")]
    tasks = np.array([a.labels["task"] for a in adapters])
    stack = factor_stack([a.factors for a in adapters])
    sums, shared = channel_group_sums(stack, stack, lambda name: name, ("module", "input_gram"))
    count = np.maximum(sum(shared.values()), 1)  # modules each pair shares: the channels average over them

    def mean_over_modules(kernels: dict[str, np.ndarray], centre: bool) -> np.ndarray:
        return sum((centred(k) if centre else k) * shared[m] for m, k in kernels.items()) / count

    norms = {m: stack.norms[m].astype(np.float64) for m in sums["module"]}
    inner = sum(k * np.outer(norms[m], norms[m]) for m, k in sums["module"].items())
    whole = np.sqrt(np.diag(inner))
    scores = {"dw": (inner / np.outer(whole, whole), centred(inner))}
    scores |= {c: (mean_over_modules(sums[c], False), mean_over_modules(sums[c], True)) for c in ("module", "input_gram")}
    rng = np.random.default_rng(0)
    out = {}
    for name, (plain, centre) in scores.items():
        (h0, m0), (h1, m1) = per_query(plain, tasks), per_query(centre, tasks)
        out[name] = {"plain": {"hit@1": h0.mean(), "mrr": m0.mean()}, "centred": {"hit@1": h1.mean(), "mrr": m1.mean()},
                     "centred - plain": {"hit@1": paired(h1, h0, tasks, rng), "mrr": paired(m1, m0, tasks, rng)}}  # fmt: skip
        d = out[name]["centred - plain"]
        print(
            f"{name:10s} plain hit@1 {h0.mean():.3f} MRR {m0.mean():.3f}  centred {h1.mean():.3f} {m1.mean():.3f}  "
            f"centred - plain hit@1 {d['hit@1'][0]:+.3f} [{d['hit@1'][1]:+.3f}, {d['hit@1'][2]:+.3f}] "
            f"MRR {d['mrr'][0]:+.3f} [{d['mrr'][1]:+.3f}, {d['mrr'][2]:+.3f}]"
        )
    print(json.dumps({"adapters": len(adapters), "tasks": len(set(tasks)), "scores": out}))


if __name__ == "__main__":
    main()
