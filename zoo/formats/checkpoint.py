"""Full checkpoints: low-rank deltas against a base checkpoint, or spectra alone without one.

The deltas are computed matrix by matrix: one tensor of each checkpoint is read (a large safetensors
checkpoint is streamed, see zoo.formats.safe_load, and a safetensors base always is), their difference
is taken in float32, factored, and dropped; only the low-rank factors are kept. Memory is then the
largest matrix's delta (for TinyLlama-1.1B the 32000×2048 lm_head, 262 MB) and the factors, not the
two checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from zoo.domain.spectra import matrix_spectrum
from zoo.errors import InputError
from zoo.formats.records import AdapterData, FullMatrix, LoraModule, check_finite
from zoo.formats.safe_load import SAFETENSORS_SUFFIX, StreamedTensors, load_tensors, open_streamed

#: Matrices whose smaller side is at most this get an exact SVD; larger ones a randomized one.
EXACT_SVD_MAX_DIM = 1024
#: Power iterations of the randomized SVD: 2 (torch's default) finds the same ranks and captured energies as 4
#: (to 1e-6) on fine-tune-like deltas, at 0.6× the time (32000×2048: 2.7 s, not 4.5 s, on one core).
POWER_ITERATIONS = 2
#: The randomized SVD's sketch is seeded, so that the same pair gives the same factors every time.
SKETCH_SEED = 0
#: Elements converted to float32 (or float64) at once when a delta is formed or its energy summed.
BLOCK_ELEMENTS = 1 << 22

Layout = dict[str, tuple[list[int], torch.dtype]]


def _low_rank(delta: torch.Tensor, total: float, energy: float, max_rank: int) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    """(A k×in, B out×k, captured energy fraction, method) with k the fewest components
    reaching `energy` of ||delta||_F² (`total`, not 0), capped at max_rank."""
    small = min(delta.shape)
    if small <= EXACT_SVD_MAX_DIM:
        U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
        method = "exact"
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SKETCH_SEED)
            U, S, V = torch.svd_lowrank(delta, q=min(max_rank + 10, small), niter=POWER_ITERATIONS)
        Vh, method = V.T, "randomized"
    cum = torch.cumsum(S.double() ** 2, 0) / total
    reached = torch.nonzero(cum >= energy)
    k = int(reached[0]) + 1 if reached.numel() else int(S.numel())
    k = max(1, min(k, max_rank))
    return Vh[:k].contiguous(), (U[:, :k] * S[:k]).contiguous(), float(cum[k - 1]), method


def _energy(delta: torch.Tensor) -> float:
    """||delta||_F² summed in float64, a block at a time (no float64 copy of the whole matrix)."""
    return sum(float(block.double().pow_(2).sum()) for block in delta.reshape(-1).split(BLOCK_ELEMENTS))


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A weight as out × rest (conv kernels flattened), empty ones included."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _delta(w: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """w - w0 in float32 as out × rest, the base converted a block of rows at a time."""
    delta = _as_matrix(w).to(torch.float32, copy=True)
    base = _as_matrix(w0)
    step = max(1, BLOCK_ELEMENTS // max(1, delta.shape[1]))
    for d, b in zip(delta.split(step), base.split(step), strict=True):
        d.sub_(b.to(torch.float32))
    return delta


def _layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Name → (shape, dtype) of every tensor, in the file's order, without reading a streamed file's tensors."""
    if isinstance(tensors, StreamedTensors):
        return {k: (tensors.shape(k), tensors.dtype(k)) for k in tensors}
    return {k: (list(t.shape), t.dtype) for k, t in tensors.items()}


def _open_base(base: Path) -> Mapping[str, torch.Tensor]:
    """A base checkpoint's tensors: a safetensors file streamed (read per tensor), a weights-only pickle whole."""
    return open_streamed(base) if base.suffix == SAFETENSORS_SUFFIX else load_tensors(base)[0]


def read_checkpoint(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str],
    base: Path | None,
    energy: float,
    max_rank: int,
) -> AdapterData:
    """A full state dict: per-matrix low-rank deltas against `base`, or full matrices if no base.

    `tensors` may be a StreamedTensors: each tensor is then read once, in the file's order, and the bytes read
    are checked against the file's recorded SHA-256 at the end."""
    layout = _layout(tensors)
    matrices = [k for k, (shape, dtype) in layout.items() if len(shape) >= 2 and dtype.is_floating_point]
    if not matrices:
        raise InputError(path, "no LoRA factor pairs and no weight matrices: not an adapter or a checkpoint")
    others = {k: shape for k, (shape, _) in layout.items() if k not in set(matrices)}
    if base is None:
        data = _full_matrices(path, tensors, set(matrices), others, metadata)
    else:
        data = _deltas(path, tensors, layout, matrices, base, energy, max_rank)
        data.extra_tensors, data.metadata = others, metadata
    if isinstance(tensors, StreamedTensors):
        tensors.verify()
    return data


def _full_matrices(
    path: Path, tensors: Mapping[str, torch.Tensor], matrices: set[str], others: dict[str, list[int]], metadata: dict[str, str]
) -> AdapterData:
    """The spectrum of every weight matrix (out × rest), one matrix at a time as it is read: memory is one matrix."""
    kept: dict[str, FullMatrix] = {}
    for key in tensors:
        t = tensors[key]
        check_finite(path, key, t)
        if key in matrices:
            W = _as_matrix(t)
            kept[key] = FullMatrix(key, (int(W.shape[0]), int(W.shape[1])), matrix_spectrum(W))
    return AdapterData(
        path=path,
        format="checkpoint",
        weight_files=[path],
        full_matrices=[kept[k] for k in sorted(kept)],
        extra_tensors=others,
        metadata=metadata,
        notes=["no --base given: only spectra of the full matrices are stored"],
    )


def _deltas(
    path: Path, tensors: Mapping[str, torch.Tensor], layout: Layout, matrices: list[str], base: Path, energy: float, max_rank: int
) -> AdapterData:
    """Low-rank factors of each weight matrix's delta against the base, one matrix in memory at a time."""
    base_tensors = _open_base(base)
    base_layout = _layout(base_tensors)
    shared = set(matrices) & set(base_layout)
    if not shared:
        raise InputError(path, f"no weight matrix matches a tensor of the base {base}: wrong base checkpoint?")
    for key in sorted(shared):
        if layout[key][0] != base_layout[key][0]:
            raise InputError(path, f"shape mismatch for {key}: {layout[key][0]} here, {base_layout[key][0]} in the base {base}")
    modules: dict[str, LoraModule] = {}
    captured: list[float] = []
    methods: set[str] = set()
    unchanged: list[str] = []
    for key in tensors:  # the file's order: a streamed file is read straight through
        w = tensors[key]
        check_finite(path, key, w)
        if key not in shared:
            continue
        w0 = base_tensors[key]
        check_finite(base, key, w0)
        delta = _delta(w, w0)
        del w, w0
        total = _energy(delta)
        if total == 0:
            unchanged.append(key)
            continue
        A, B, frac, method = _low_rank(delta, total, energy, max_rank)
        del delta
        methods.add(method)
        captured.append(frac)
        modules[key] = LoraModule(key, A, B, alpha=float(A.shape[0]), scale=1.0, kind="conv" if len(layout[key][0]) > 2 else "linear")
    if not modules:
        raise InputError(path, f"identical to the base {base}: every weight matrix has a zero delta")
    notes = [
        f"low-rank deltas against {base}: rank per matrix chosen to keep {energy:.0%} of the delta's energy "
        f"(max rank {max_rank}, {'/'.join(sorted(methods))} SVD); captured energy min {min(captured):.3f}, "
        f"mean {sum(captured) / len(captured):.3f}",
    ]
    if unchanged:
        notes.append(f"{len(unchanged)} matrices unchanged from the base")
    missing = sorted(set(matrices) - set(base_layout))
    if missing:
        notes.append(f"{len(missing)} matrices absent from the base were skipped: {', '.join(missing[:5])}")
    ranks = sorted({m.rank for m in modules.values()})
    return AdapterData(
        path=path,
        format="checkpoint-delta",
        weight_files=[path],
        modules=[modules[k] for k in sorted(modules)],
        config={"ranks": ranks, "r": max(ranks), "energy": energy, "max_rank": max_rank, "base_checkpoint": str(base)},
        notes=notes,
    )
