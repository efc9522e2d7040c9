"""A bank of exact similarity channels between adapters, per module, from the canonical factors (pure math, no I/O).

Every channel compares two updates dW_x = U_x S_x V_xᵀ and dW_y of one module in r×r blocks (C_U = U_xᵀU_y,
C_V = V_xᵀV_y), never materializing a d_out × d_in or d × d matrix, and an adapter pair's value is the mean over the
modules both have (0 where they share none), as for module cosine. With s = S/‖S‖ and t = S_y/‖S_y‖:

- "module": ⟨dW_x, dW_y⟩ / (‖dW_x‖ ‖dW_y‖) = Σ_ab s_a (C_U)_ab (C_V)_ab t_b, today's module cosine, in [-1, 1];
- "input_gram": the cosine of the input Grams dWᵀdW = V S² Vᵀ, ‖S_x C_V S_y‖²_F / (‖S_x²‖ ‖S_y²‖), in [0, 1] (both
  are positive semi-definite); blind to anything done to the output side (dW → Q·dW for orthogonal Q: a re-seeded
  or re-initialized head, say);
- "output_gram": the same for the output Grams dW dWᵀ = U S² Uᵀ, blind to the input side;
- "input_subspace": ‖C_V‖²_F / √(r_x r_y), in [0, 1], unweighted: which input directions are used, not how much.
  It is the cosine of the two orthogonal projectors V Vᵀ (‖V Vᵀ‖_F = √r), so it is the Gram channel with a flat
  spectrum, is 1 exactly when the subspaces are equal, and a rank-1 update inside a rank-8 one scores √(1/8), not 1
  (dividing by min(r_x, r_y) instead would give every update inside a larger one a perfect score, rewarding rank).
  A component counts fully however small its singular value (down to the canonical form's cut-off);
- "output_subspace": ‖C_U‖²_F / √(r_x r_y), the same for the column spaces;
- "spectrum": the cosine of the singular value profiles, s·t with both sorted descending and zero-padded to a common
  length, in (0, 1]: zero padding is what a lower rank means (a rank-r update is a rank-R one with R - r zero
  singular values), so it needs no rule for unequal ranks, where log spectra would be undefined at the padding and
  dominated by the tiniest kept components. By von Neumann's trace inequality it bounds |module cosine| from above:
  the first-order cosine the two updates would have if their singular vectors were aligned.

`channel_matrices` computes them for many adapters at once over `ModuleStack`s, one GEMM per side and chunk shared by
each side's Gram and subspace channels; module cosine is `ModuleStack.cosines` itself. A module the stack keeps dense
(its unit-norm dW) is factored there by one batched SVD and compared as factors, each row keeping the components whose
singular value passes DENSE_CUTOFF (float32 round-off of the unit-norm dW): the subspace channels, which count every
component, then count those (a component the canonical form kept below 1e-5 of ‖dW‖ counts only from the factors).
`pair_channels` is the per-pair float64 reference.
`channel_group_sums` gives the same per-module values summed per module group (by type and depth, say) with each
group's count of shared modules, from which the mean and any weighting of the groups follow (zoo/domain/channel_metric.py).

The exact scores that search and the out-of-fold choice weigh (dW, module and input Gram cosine) are made from the
same blocks in one pass by zoo/domain/exact_scores.py.

Every channel has a bounded-dimension sketch (`channel_sketches`) whose blocks' inner products give it per module,
to be averaged with `sketch_module_cosines`: module cosine's is the module sketch; the Gram and subspace channels'
are seeded bilinear probes ωᵀ·M·ψ of the symmetric matrix M = X diag(c) Xᵀ (X = V or U, c = S²/‖S²‖ or 1/√r),
unbiased estimates of the cosine; the spectrum's is the padded unit spectrum itself, exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zoo.domain.module_work import for_each_module, module_threads
from zoo.domain.similarity import Factors, ModuleStack, module_sketches

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors

#: the channels, in the order reported
CHANNELS = ("module", "input_gram", "output_gram", "input_subspace", "output_subspace", "spectrum")
#: per channel: (factor side, weighting) of the channels that compare one side's squared overlaps C²
_OVERLAPS = {
    "input_gram": ("input", "gram"),
    "output_gram": ("output", "gram"),
    "input_subspace": ("input", "subspace"),
    "output_subspace": ("output", "subspace"),
}
_SIDE_INDEX = {"output": 0, "input": 1}  # U, V in ModuleStack.factors
#: singular values (of unit-norm dW) below this are dropped when a dense module is factored: float32 round-off
DENSE_CUTOFF = 1e-5


def factor_stack(adapters: Sequence[Factors]) -> ModuleStack:
    """The adapters' ModuleStack with every module kept as factors (what the subspace channels need)."""
    return ModuleStack.of(adapters, set())


def channel_similarity_matrix(queries: Sequence[Factors], gallery: Sequence[Factors], channel: str) -> np.ndarray:
    """(len(queries), len(gallery)) one channel's mean per-module similarity over shared modules; 0 where none is
    shared."""
    return channel_matrices(factor_stack(gallery), factor_stack(queries), (channel,))[channel]


def channel_matrices(
    gallery: ModuleStack, queries: ModuleStack, channels: Sequence[str] = CHANNELS, chunk: int = 2048
) -> dict[str, np.ndarray]:
    """Per channel asked for: (queries.size, gallery.size) float64, the mean per-module value over the modules both
    adapters have (0 where none). One V-block product per module and chunk serves both input channels, one U-block
    product both output channels."""
    sums, counts = channel_group_sums(gallery, queries, lambda _: "", channels, chunk)
    return {c: sums[c].get("", np.zeros((queries.size, gallery.size))) / np.maximum(counts.get("", 0), 1) for c in channels}


def channel_group_sums(
    gallery: ModuleStack,
    queries: ModuleStack,
    group_of: Callable[[str], str],
    channels: Sequence[str] = CHANNELS,
    chunk: int = 2048,
    inner_products: bool = False,
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Per channel asked for and module group (`group_of(module name)`, e.g. its type and depth): (queries.size,
    gallery.size) float64, the sum of the channel's per-module values over the group's modules both adapters have; and
    per group how many such modules each pair shares. Σ_g sums[c][g] / Σ_g counts[g] is `channel_matrices`' mean.
    With `inner_products` (and "module" asked for), also per group `sums["dw"]`: the sum of its modules' ⟨dW_q, dW_g⟩,
    from the same module cosines (dW cosine's part of the group, once divided by the whole updates' norms)."""
    unknown = sorted(set(channels) - set(CHANNELS))
    if unknown:
        raise ValueError(f"unknown channels {unknown}; each one of {CHANNELS}")
    names = sorted(queries.norms.keys() & gallery.norms.keys())
    mixed = [n for n in names if (n in gallery.dense) != (n in queries.dense)]
    if mixed:
        raise ValueError(f"stacks of different layouts for modules {mixed}: build both with the same `dense`")
    if inner_products and "module" not in channels:
        raise ValueError("the modules' inner products are made from module cosine: ask for the 'module' channel")
    sums: dict[str, dict[str, np.ndarray]] = {c: {} for c in (*channels, *(("dw",) if inner_products else ()))}
    counts: dict[str, np.ndarray] = {}
    for name in names:
        group = group_of(name)
        shared = (queries.norms[name] > 0)[:, None] & (gallery.norms[name] > 0)[None, :]
        values = _module_values(gallery, queries, channels, chunk, name)
        for c, v in values.items():
            sums[c][group] = sums[c].get(group, 0) + v * shared
        if inner_products:  # ⟨dW_q, dW_g⟩ of the module: its cosine times both norms
            norms = np.outer(queries.norms[name].astype(np.float64), gallery.norms[name].astype(np.float64))
            sums["dw"][group] = sums["dw"].get(group, 0) + values["module"] * norms
        counts[group] = counts.get(group, 0) + shared
    return sums, counts


def _module_values(gallery: ModuleStack, queries: ModuleStack, channels: Sequence[str], chunk: int, name: str) -> dict[str, np.ndarray]:
    """One module's (queries.size, gallery.size) value of each channel asked for (a dense module factored once)."""
    out: dict[str, np.ndarray] = {}
    if "module" in channels:
        out["module"] = next(_one_module(gallery, name).module_cosines(_one_module(queries, name), chunk))[1]
    if not set(channels) - {"module"}:
        return out
    fq, fg = module_factors(queries, name), module_factors(gallery, name)
    for side in _SIDE_INDEX:
        wanted = [c for c in channels if _OVERLAPS.get(c, ("", ""))[0] == side]
        if wanted:
            out.update(_overlaps(fq, fg, side, wanted, chunk))
    if "spectrum" in channels:
        out["spectrum"] = _spectrum_cosines(fq[2], fg[2])
    return out


def _one_module(stack: ModuleStack, name: str) -> ModuleStack:
    """A view of the stack holding only the named module."""
    dense = {name: stack.dense[name]} if name in stack.dense else {}
    factors = {name: stack.factors[name]} if name in stack.factors else {}
    svd = {name: stack.svd[name]} if name in stack.svd else {}
    return ModuleStack(stack.size, {name: stack.norms[name]}, dense, factors, svd)


def _spectrum_cosines(wq: np.ndarray, wg: np.ndarray) -> np.ndarray:
    """One module's (queries, gallery) cosine of the unit spectra, sorted descending and zero-padded to a common
    length (sorted: factors given in another order than the canonical one score the same)."""
    wq, wg = -np.sort(-wq, axis=1), -np.sort(-wg, axis=1)
    width = max(wq.shape[1], wg.shape[1])
    wq, wg = np.pad(wq, ((0, 0), (0, width - wq.shape[1]))), np.pad(wg, ((0, 0), (0, width - wg.shape[1])))
    return (wq @ wg.T).astype(np.float64)


#: one module's (U (N, R, out), V (N, R, in), w (N, R)) over a stack's rows
ModuleFactors = tuple[np.ndarray, np.ndarray, np.ndarray]


def _overlaps(fq: ModuleFactors, fg: ModuleFactors, side: str, channels: list[str], chunk: int) -> dict[str, np.ndarray]:
    """One module's value of each channel of one side, from both stacks' (U, V, w) of it: Σ_ab p_a (C²)_ab q_b with
    C = X_xᵀX_y and the channel's weights p, q."""
    k = _SIDE_INDEX[side]
    weights = [(unit_weights(fq[2], _OVERLAPS[c][1]), unit_weights(fg[2], _OVERLAPS[c][1])) for c in channels]
    values = squared_overlaps(fq[k], fg[k], weights, chunk)
    return dict(zip(channels, values, strict=True))


def module_factors(stack: ModuleStack, name: str) -> ModuleFactors:
    """One module's (U (N, R, out), V (N, R, in), w (N, R)) as ModuleStack.factors holds them; a dense module's from
    the batched SVD of its unit-norm dW (`dense_svd`; the stack's `svd` where it holds it) with w = S, as ‖dW‖ = 1, a
    row's components at or below DENSE_CUTOFF zeroed (round-off, as a padded component is) and those below it in
    every row dropped."""
    if name not in stack.dense:
        return stack.factors[name]
    U, V, S = stack.svd[name] if name in stack.svd else dense_svd(stack.dense[name])
    keep = max(1, int((S > DENSE_CUTOFF).any(axis=0).sum()))  # S is sorted descending per row: a prefix
    return U[:, :keep], V[:, :keep], np.where(S[:, :keep] > DENSE_CUTOFF, S[:, :keep], 0.0).astype(S.dtype)


def dense_svd(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The SVD of each of a dense module's rows dense (N, out, in): (U (N, m, out), V (N, m, in), S (N, m)) with m =
    min(out, in), every component, C-contiguous. Each matrix is factored on its own (numpy's batched SVD), so a row's
    factors do not depend on the other rows: factored once, they can be served for any subset of rows."""
    from threadpoolctl import threadpool_limits

    # one BLAS thread: each matrix is small, and a second OpenBLAS thread spinning against a busy core made 51 SVDs of
    # 48 × 48 take 7.6 s instead of 0.13 on the shared 2-core machine
    with threadpool_limits(limits=1, user_api="blas"):
        U, S, Vt = np.linalg.svd(dense, full_matrices=False)
    return np.ascontiguousarray(U.transpose(0, 2, 1)), Vt, S


def unit_weights(w: np.ndarray, weighting: str) -> np.ndarray:
    """(n, R) float32 per-component weights of unit norm per row (zero rows stay zero) from unit spectra w (zero
    padded): "gram", w² (the Gram's eigenvalues S²/‖S‖²), or "subspace", 1 on every component."""
    p = w.astype(np.float64) ** 2 if weighting == "gram" else (w > 0).astype(np.float64)
    return (p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-300)).astype(np.float32)


def squared_overlaps(Xq: np.ndarray, Xg: np.ndarray, weights: list[tuple[np.ndarray, np.ndarray]], chunk: int) -> list[np.ndarray]:
    """For stacks of bases Xq (nq, Rq, d), Xg (ng, Rg, d) and each (pq (nq, Rq), pg (ng, Rg)): the (nq, ng) matrix
    Σ_ab pq_a (X_qᵀX_g)²_ab pg_b, in chunks of about `chunk` query components: one GEMM per chunk for all weights."""
    nq, rq, d = Xq.shape
    ng, rg, _ = Xg.shape
    Xg2 = Xg.reshape(-1, d)
    out = [np.zeros((nq, ng)) for _ in weights]
    step = max(1, chunk // max(rq, 1))
    for start in range(0, nq, step):
        sl = slice(start, start + step)
        C = Xq[sl].reshape(-1, d) @ Xg2.T  # (q·Rq, ng·Rg)
        for o, value in zip(out, weighted_squares(C, [(pq[sl], pg) for pq, pg in weights]), strict=True):
            o[sl] = value
    return out


def weighted_squares(C: np.ndarray, weights: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """For the blocks C = [X_qᵢ X_gⱼᵀ] (q·Rq, ng·Rg) of q queries and ng gallery rows, squared in place, and each (pq
    (q, Rq), pg (ng, Rg)): the (q, ng) matrix Σ_ab pq_a (C_ij)²_ab pg_b."""
    np.square(C, out=C)
    out = []
    for pq, pg in weights:
        (q, rq), (ng, rg) = pq.shape, pg.shape
        left = np.matmul(pq[:, None, :], C.reshape(q, rq, ng * rg))[:, 0].reshape(q, ng, rg)  # summed over the query's components
        out.append(np.einsum("qnb,nb->qn", left, pg))
    return out


# -- the per-pair reference -------------------------------------------------------------------------------------------


def pair_channels(x: Factors, y: Factors) -> dict[str, float]:
    """Every channel for one pair of adapters in float64, module by module in r×r blocks: the reference that the
    stacked implementation is tested against. Components with S = 0 are dropped."""
    values: dict[str, list[float]] = {c: [] for c in CHANNELS}
    for name in sorted(x.keys() & y.keys()):
        fx, fy = _float64(x[name]), _float64(y[name])
        if fx[1].size and fy[1].size:
            for c, v in module_channels(fx, fy).items():
                values[c].append(v)
    return {c: float(np.mean(v)) if v else 0.0 for c, v in values.items()}


def module_channels(x: tuple[np.ndarray, np.ndarray, np.ndarray], y: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[str, float]:
    """Every channel for one module's (U, S, V) pair (float64, S > 0, U and V with orthonormal columns)."""
    (Ux, Sx, Vx), (Uy, Sy, Vy) = x, y
    Cu, Cv = Ux.T @ Uy, Vx.T @ Vy
    sx, sy = Sx / np.linalg.norm(Sx), Sy / np.linalg.norm(Sy)
    gx, gy = sx**2 / np.linalg.norm(sx**2), sy**2 / np.linalg.norm(sy**2)
    flat = 1.0 / np.sqrt(len(Sx) * len(Sy))
    width = max(len(Sx), len(Sy))
    px, py = (np.pad(np.sort(s)[::-1], (0, width - len(s))) for s in (sx, sy))
    return {
        "module": float(sx @ (Cu * Cv) @ sy),
        "input_gram": float(gx @ Cv**2 @ gy),
        "output_gram": float(gx @ Cu**2 @ gy),
        "input_subspace": float((Cv**2).sum() * flat),
        "output_subspace": float((Cu**2).sum() * flat),
        "spectrum": float(px @ py),
    }


def _float64(f: CanonicalFactors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    U, S, V = (t.detach().cpu().double().numpy() for t in (f.U, f.S, f.V))
    keep = S > 0
    return U[:, keep], S[keep], V[:, keep]


# -- sketches ---------------------------------------------------------------------------------------------------------


def channel_sketches(adapters: Sequence[Factors], modules: Sequence[str], dim: int, channel: str) -> np.ndarray:
    """(N, len(modules)·dim) float32: per module a block whose inner product with another adapter's block is that
    module's channel value (an unbiased estimate; exact for "spectrum", whose blocks are the unit spectra sorted and
    zero-padded to `dim`, at least the largest rank); zeros where the adapter lacks the module. Mean over shared
    modules: `sketch_module_cosines`."""
    if channel == "module":
        return module_sketches(adapters, modules, dim)
    if channel == "spectrum":
        return _spectrum_sketches(adapters, modules, dim)
    if channel not in _OVERLAPS:
        raise ValueError(f"unknown channel {channel!r}; one of {CHANNELS}")
    return _gram_sketches(adapters, modules, dim, *_OVERLAPS[channel])


def _spectrum_sketches(adapters: Sequence[Factors], modules: Sequence[str], dim: int) -> np.ndarray:
    out = np.zeros((len(adapters), len(modules), dim), dtype=np.float32)
    for i, a in enumerate(adapters):
        for m, name in enumerate(modules):
            if name in a and a[name].rank:
                S = np.sort(_float64(a[name])[1])[::-1]
                if len(S) > dim:
                    raise ValueError(f"a spectrum sketch of {dim} values cannot hold module {name} of rank {len(S)}")
                out[i, m, : len(S)] = S / np.linalg.norm(S)
    return out.reshape(len(adapters), -1)


def _gram_sketches(adapters: Sequence[Factors], modules: Sequence[str], dim: int, side: str, weighting: str) -> np.ndarray:
    """Per module `dim` seeded probe values ω_jᵀ·X diag(c) Xᵀ·ψ_j / √dim with X = V (input) or U (output) and c the
    channel's unit-norm weights (`unit_weights`), so that E[block·block'] = ⟨M, M'⟩_F, the channel's value. ω, ψ are
    independent standard Gaussians in the side's dimension, drawn once per module name, shape and channel. Float32
    products, one adapter's module at a time (as the module sketches: no float64 copy of the factors), whole modules
    shared out over as many threads as torch has where they are large (`module_threads`, `for_each_module`)."""
    import torch

    from zoo.domain.probes import sketch_probes  # torch: only when sketching

    out = np.zeros((len(adapters), len(modules), dim), dtype=np.float32)

    def sketch(m: int, name: str) -> None:
        present = [(i, a[name]) for i, a in enumerate(adapters) if name in a and a[name].rank]
        if not present:
            return
        width = int((present[0][1].V if side == "input" else present[0][1].U).shape[0])
        probes = torch.cat(sketch_probes(name, width, width, dim, f"{side}-{weighting}-sketch"))
        for i, f in present:
            S = f.S.detach().cpu().double().numpy()
            keep = S > 0
            X = (f.V if side == "input" else f.U).detach().cpu().float()
            # ω and ψ in one pass over X, torch's product: numpy's OpenBLAS, called from two threads at once, took 30 ms
            # an adapter where one thread took 19 and torch's 16-18 (Llama-3-8B); the columns kept after the product
            values = (probes @ X).numpy()[:, keep]
            c = unit_weights((S[keep] / np.linalg.norm(S[keep]))[None, :], weighting)[0]
            out[i, m] = (values[:dim] * values[dim:]) @ c / np.sqrt(dim)

    threads = module_threads(adapters, torch.get_num_threads())
    for_each_module(modules, sketch, threads, initializer=lambda: torch.set_num_threads(1))
    return out.reshape(len(adapters), -1)
