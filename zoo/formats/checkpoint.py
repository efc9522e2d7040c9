"""Full checkpoints: low-rank deltas against a base checkpoint, or spectra alone without one."""

from __future__ import annotations

from pathlib import Path

import torch

from zoo.errors import InputError
from zoo.formats.model import AdapterData, FullMatrix, LoraModule, check_finite
from zoo.formats.safe_load import load_tensors

#: Matrices whose smaller side is at most this get an exact SVD; larger ones a randomized one.
EXACT_SVD_MAX_DIM = 1024


def _low_rank(delta: torch.Tensor, energy: float, max_rank: int) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    """(A k×in, B out×k, captured energy fraction, method) with k the fewest components
    reaching `energy` of ||delta||_F², capped at max_rank."""
    total = float(delta.double().pow(2).sum())
    small = min(delta.shape)
    if small <= EXACT_SVD_MAX_DIM:
        U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
        method = "exact"
    else:
        U, S, V = torch.svd_lowrank(delta, q=min(max_rank + 10, small), niter=4)
        Vh, method = V.T, "randomized"
    cum = torch.cumsum(S.double() ** 2, 0) / total
    reached = torch.nonzero(cum >= energy)
    k = int(reached[0]) + 1 if reached.numel() else int(S.numel())
    k = max(1, min(k, max_rank))
    return Vh[:k].contiguous(), (U[:, :k] * S[:k]).contiguous(), float(cum[k - 1]), method


def read_checkpoint(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    base: Path | None,
    energy: float,
    max_rank: int,
) -> AdapterData:
    """A full state dict: per-matrix low-rank deltas against `base`, or full matrices if no base."""
    matrices = {k: t for k, t in tensors.items() if t.ndim >= 2 and t.is_floating_point()}
    if not matrices:
        raise InputError(path, "no LoRA factor pairs and no weight matrices: not an adapter or a checkpoint")
    for key, t in tensors.items():
        check_finite(path, key, t)
    others = {k: list(t.shape) for k, t in tensors.items() if k not in matrices}
    if base is None:
        return AdapterData(
            path=path,
            format="checkpoint",
            weight_files=[path],
            full_matrices=[FullMatrix(k, matrices[k].reshape(matrices[k].shape[0], -1)) for k in sorted(matrices)],
            extra_tensors=others,
            metadata=metadata,
            notes=["no --base given: only spectra of the full matrices are stored"],
        )
    base_tensors, _ = load_tensors(base)
    shared = sorted(set(matrices) & set(base_tensors))
    if not shared:
        raise InputError(path, f"no weight matrix matches a tensor of the base {base}: wrong base checkpoint?")
    modules: list[LoraModule] = []
    captured: list[float] = []
    methods: set[str] = set()
    unchanged: list[str] = []
    for key in shared:
        w, w0 = matrices[key], base_tensors[key]
        if w.shape != w0.shape:
            raise InputError(path, f"shape mismatch for {key}: {list(w.shape)} here, {list(w0.shape)} in the base {base}")
        check_finite(base, key, w0)
        delta = (w.to(torch.float32) - w0.to(torch.float32)).reshape(w.shape[0], -1)
        if not torch.any(delta):
            unchanged.append(key)
            continue
        A, B, frac, method = _low_rank(delta, energy, max_rank)
        methods.add(method)
        captured.append(frac)
        modules.append(LoraModule(key, A, B, alpha=float(A.shape[0]), scale=1.0, kind="conv" if w.ndim > 2 else "linear"))
    if not modules:
        raise InputError(path, f"identical to the base {base}: every weight matrix has a zero delta")
    notes = [
        f"low-rank deltas against {base}: rank per matrix chosen to keep {energy:.0%} of the delta's energy "
        f"(max rank {max_rank}, {'/'.join(sorted(methods))} SVD); captured energy min {min(captured):.3f}, "
        f"mean {sum(captured) / len(captured):.3f}",
    ]
    if unchanged:
        notes.append(f"{len(unchanged)} matrices unchanged from the base")
    missing = sorted(set(matrices) - set(base_tensors))
    if missing:
        notes.append(f"{len(missing)} matrices absent from the base were skipped: {', '.join(missing[:5])}")
    ranks = sorted({m.rank for m in modules})
    return AdapterData(
        path=path,
        format="checkpoint-delta",
        weight_files=[path],
        modules=modules,
        config={"ranks": ranks, "r": max(ranks), "energy": energy, "max_rank": max_rank, "base_checkpoint": str(base)},
        extra_tensors=others,
        metadata=metadata,
        notes=notes,
    )
