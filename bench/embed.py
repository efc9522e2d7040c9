"""Benchmark: adapters embedded per second by a W2T embedder (an ensemble of `--members` models;
untrained weights: the cost is the same) and by the training-free module sketch, on a synthetic
digits-vit-shaped space (24 modules, rank ≤ 16).

Each figure is the median of --repeats timed runs after a warm-up. `tokenize_share` is the part of
the W2T time spent building token batches on the CPU (the rest is the models' forward passes).
Prints a line and, on the last line, one JSON object (adapters_per_s for each, and the ratios).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.timing import median_time
from embed.data.tokens import tokenize
from embed.data.types import ZooAdapter, schema_of
from embed.training.train_options import TrainOptions
from embed.w2t.ensemble import EMBED_BATCH, W2TEnsemble
from embed.w2t.model import W2T, W2TConfig
from zoo.domain.canonical import canonicalize
from zoo.domain.similarity import module_sketches, sketch_width


def synthetic(n: int, rank: int, seed: int = 0) -> list[ZooAdapter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (48, 48), "k_proj": (48, 48), "v_proj": (48, 48), "o_proj": (48, 48), "fc1": (96, 48), "fc2": (48, 96)}
    out = []
    for i in range(n):
        factors = {}
        for layer in range(4):
            for t, (o, d) in shapes.items():
                factors[f"blocks.{layer}.{t}"] = canonicalize(torch.randn(rank, d, generator=gen), torch.randn(o, rank, generator=gen))
        out.append(ZooAdapter(i + 1, f"s{i}", factors))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--members", type=int, default=TrainOptions().members)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    adapters = synthetic(args.adapters, args.rank)
    schema = schema_of("bench", adapters)
    dim = TrainOptions().dim
    config = W2TConfig(schema.type_shapes(), n_layers=4, n_modules=len(schema.modules), dim=dim, embed_dim=dim)
    emb = W2TEnsemble([W2T(config).to(args.device) for _ in range(args.members)], schema, args.rank, {}, "supervised")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    t_w2t = median_time(lambda: emb.embed(adapters), args.repeats, sync)
    starts = range(0, len(adapters), EMBED_BATCH)
    t_tokens = median_time(lambda: [tokenize(adapters[i : i + EMBED_BATCH], schema, args.rank) for i in starts], args.repeats, sync)
    t_sketch = median_time(
        lambda: module_sketches([a.factors for a in adapters], schema.module_names, sketch_width(len(schema.modules))), args.repeats, sync
    )
    result = {
        "adapters": args.adapters,
        "device": args.device,
        "members": args.members,
        "threads": torch.get_num_threads(),
        "w2t_adapters_per_s": round(args.adapters / t_w2t, 1),
        "sketch_adapters_per_s": round(args.adapters / t_sketch, 1),
        "w2t_vs_sketch": round(t_sketch / t_w2t, 2),
        "tokenize_share": round(t_tokens / t_w2t, 2),
    }
    w2t, sketch = result["w2t_adapters_per_s"], result["sketch_adapters_per_s"]
    print(f"{args.adapters} adapters on {args.device}: W2T ({args.members} models) {w2t}/s, module sketch {sketch}/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
