"""Benchmark: batched canonicalization vs a per-module QR loop vs merely reading the file.

Writes a realistic PEFT adapter (default: 28 layers × q,k,v,o at rank 16, d = 3072, float32),
then times, in one run: reading it (safetensors, page cache warm), the per-module reference
path (`canonicalize` in a loop) and the batched path the ingest pipeline uses. Prints a table
and, on the last line, one JSON object: adapters_per_s, batched_vs_loop, canon_vs_read, ...
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.timing import median_time
from zoo.domain.canonical import canonicalize
from zoo.formats import read_adapter
from zoo.services.ingest import canonicalize_modules


def write_adapter(directory: Path, layers: int, dim: int, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, dim, generator=g) / dim**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(dim, rank, generator=g) * 1e-2
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_adapter(directory, args.layers, args.dim, args.rank, seed=0)
        data = read_adapter(directory)
        modules = data.modules
        if device.type == "cuda":
            for m in modules:
                m.A, m.B = m.A.to(device), m.B.to(device)

        t_read = median_time(lambda: read_adapter(directory), args.repeats, lambda: None)
        t_loop = median_time(lambda: [canonicalize(m.A, m.B, m.scale) for m in modules], args.repeats, sync)
        t_batch = median_time(lambda: canonicalize_modules(modules, device), args.repeats, sync)

        ref = [canonicalize(m.A, m.B, m.scale) for m in modules]
        got = canonicalize_modules(modules, device)
        s_err = max(float((g.S - r.S.cpu()).abs().max() / r.S[0]) for g, r in zip(got, ref, strict=True))
        orth = max(float((g.U.T @ g.U - torch.eye(g.rank)).abs().max()) for g in got)

    file_mb = sum(m.A.numel() + m.B.numel() for m in modules) * 4 / 2**20
    result = {
        "modules": len(modules),
        "shape": [args.dim, args.dim, args.rank],
        "file_mb": round(file_mb, 1),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "read_ms": round(t_read * 1e3, 2),
        "loop_ms": round(t_loop * 1e3, 2),
        "batched_ms": round(t_batch * 1e3, 2),
        "adapters_per_s": round(1.0 / (t_read + t_batch), 2),
        "batched_vs_loop": round(t_loop / t_batch, 2),
        "canon_vs_read": round(t_batch / t_read, 2),
        "max_rel_sigma_diff_vs_qr": s_err,
        "max_orthonormality_error": orth,
    }
    print(
        f"{len(modules)} modules of {args.dim}x{args.dim} at rank {args.rank} ({file_mb:.0f} MB), device {device}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"  read file          {t_read * 1e3:8.1f} ms")
    print(f"  per-module QR loop {t_loop * 1e3:8.1f} ms")
    print(f"  batched            {t_batch * 1e3:8.1f} ms   ({t_loop / t_batch:.2f}x the loop, {t_batch / t_read:.2f}x the read)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
