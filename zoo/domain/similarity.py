"""Similarity of adapters from their canonical forms (pure math; no I/O, no database).

The one implementation of ⟨dW_x, dW_y⟩ in the project is `ModuleStack`: many adapters' modules,
padded per module name, compared in r×r blocks without materializing dW (or as flattened dW
where that is smaller). From its per-module cosines come:

- module cosine: the mean, over the modules two adapters share, of the cosine of their
  per-module updates. Unlike the cosine of the whole update, every shared module counts
  equally, so a large update of one module cannot drown the others, and adapters that target
  different module sets are compared on what they share;
- whole-update (dW) cosine: Σ_m ⟨dW_x,m, dW_y,m⟩ / (‖dW_x‖ ‖dW_y‖), the training-free bar.

The exact scores that search and the out-of-fold choice weigh, these two and the input Gram cosine, are
`exact_cosines` in zoo/domain/channels.py, beside the other channels.

`module_sketches` is the compact stand-in: per module `sketch_width` seeded bilinear probes
(zoo/domain/probes.py) divided by the module's ‖dW‖_F, whose inner products estimate that module's cosine
without bias; the probes per module shrink as modules grow in number, so that a whole vector never
passes MAX_SEARCH_DIM (a space of more than MAX_SEARCH_DIM modules keeps one probe per module).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zoo.domain.module_work import for_each_module, module_threads

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors

Factors = Mapping[str, "CanonicalFactors"]

#: probe pairs per module in a module sketch (at most)
MODULE_SKETCH_DIM = 64
#: the most dimensions a search vector of any space has (see sketch_width)
MAX_SEARCH_DIM = 2048
_SKETCH_SALT = "module-sketch"


def dense_modules(adapters: Sequence[Factors]) -> set[str]:
    """Modules whose flattened dW is no bigger than twice their largest factors: compared dense."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for a in adapters:
        for name, f in a.items():
            if f.rank:
                _, _, r = shapes.get(name, (0, 0, 0))
                shapes[name] = (f.U.shape[0], f.V.shape[0], max(r, f.rank))
    return {n for n, (out, inp, r) in shapes.items() if out * inp <= 2 * r * (out + inp)}


class ModuleStack:
    """N adapters' modules, one block of float32 arrays per module name, row j = adapter j.

    Per module: `norms` (N,) = ‖dW‖_F (0 where the adapter lacks the module) and either
    `dense` (N, out, in), the unit-norm dW, or `factors` = (U (N, R, out), V (N, R, in),
    w (N, R)) with w = S/‖S‖, zero-padded to the module's largest rank R. Stacks compared with
    each other must agree on which modules are dense. Plain numpy, so a query needs no torch.

    `svd`, optional: per dense module, the SVD of its rows (zoo.domain.channels.dense_svd) computed beforehand, which
    the channels that need a dense module's factors read instead of factoring it again (the engine keeps them per
    module store: embed/serving/dense_svd.py). Row j holds the leading components of the SVD of `dense[name][j]`, at least
    every one that `module_factors` keeps.
    """

    def __init__(
        self,
        size: int,
        norms: dict[str, np.ndarray],
        dense: dict[str, np.ndarray],
        factors: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        svd: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        self.size = size
        self.norms = norms
        self.dense = dense
        self.factors = factors
        self.svd = svd if svd is not None else {}

    @classmethod
    def of(cls, adapters: Sequence[Factors], dense: set[str]) -> ModuleStack:
        stack = cls.allocate(len(adapters), layout_of(adapters), dense)
        stack.fill(0, adapters)
        return stack

    @classmethod
    def allocate(cls, size: int, layout: Mapping[str, tuple[int, int, int]], dense: set[str]) -> ModuleStack:
        """A stack of `size` empty rows: per module name (out, in, largest rank); names of rank 0 are left out."""
        return cls.from_arrays({k: np.zeros(shape, np.float32) for k, shape in cls.shapes(size, layout, dense).items()}, size)

    @staticmethod
    def shapes(size: int, layout: Mapping[str, tuple[int, int, int]], dense: set[str]) -> dict[str, tuple[int, ...]]:
        """The shapes of the float32 arrays (`arrays`' names) of a stack of `size` rows of this layout."""
        out: dict[str, tuple[int, ...]] = {}
        for name, (rows, cols, r) in sorted(layout.items()):
            if not r:
                continue
            out[f"norms/{name}"] = (size,)
            if name in dense:
                out[f"dense/{name}"] = (size, rows, cols)
            else:
                out.update({f"U/{name}": (size, r, rows), f"V/{name}": (size, r, cols), f"w/{name}": (size, r)})
        return out

    def fill(self, start: int, adapters: Sequence[Factors]) -> None:
        """Write the adapters into rows start, start + 1, ... (modules the stack does not hold must have rank 0)."""
        for j, a in enumerate(adapters, start):
            for name, f in a.items():
                if not f.rank:
                    continue
                U, S, V = _numpy(f)
                norm = np.linalg.norm(S.astype(np.float64))
                self.norms[name][j] = norm
                if name in self.dense:
                    self.dense[name][j] = (U * (S / norm)) @ V.T
                    continue
                U_, V_, w_ = self.factors[name]
                k = S.shape[0]
                U_[j, :k], V_[j, :k], w_[j, :k] = U.T, V.T, S / norm

    def copy_into(self, other: ModuleStack, start: int = 0) -> None:
        """Write this stack's rows into `other`'s rows start, ... (a layout at least as wide, the same dense modules)."""
        rows = slice(start, start + self.size)
        for name, v in self.norms.items():
            other.norms[name][rows] = v
        for name, v in self.dense.items():
            other.dense[name][rows] = v
        for name, (U, V, w) in self.factors.items():
            U_, V_, w_ = other.factors[name]
            k = U.shape[1]
            U_[rows, :k], V_[rows, :k], w_[rows, :k] = U, V, w

    def take(self, rows: Sequence[int] | np.ndarray) -> ModuleStack:
        """The stack of the given rows, in that order (with their `svd` where it has one)."""
        idx = np.asarray(rows, dtype=np.int64)
        return ModuleStack(
            len(idx),
            {k: v[idx] for k, v in self.norms.items()},
            {k: v[idx] for k, v in self.dense.items()},
            {k: (U[idx], V[idx], w[idx]) for k, (U, V, w) in self.factors.items()},
            {k: (U[idx], V[idx], S[idx]) for k, (U, V, S) in self.svd.items()},
        )

    @staticmethod
    def concat(stacks: Sequence[ModuleStack]) -> ModuleStack:
        """Rows of several stacks one after the other (factor blocks padded to the largest rank)."""
        sizes = [s.size for s in stacks]
        names = sorted({k for s in stacks for k in s.norms})
        norms = {k: np.concatenate([s.norms.get(k, np.zeros(s.size, np.float32)) for s in stacks]) for k in names}
        dense: dict[str, np.ndarray] = {}
        factors: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for k in names:
            owner = next(s for s in stacks if k in s.norms)
            if k in owner.dense:
                shape = owner.dense[k].shape[1:]
                dense[k] = np.concatenate([s.dense.get(k, np.zeros((s.size, *shape), np.float32)) for s in stacks])
                continue
            r = max(s.factors[k][0].shape[1] for s in stacks if k in s.factors)
            out, inp = owner.factors[k][0].shape[2], owner.factors[k][1].shape[2]
            parts = []
            for s, n in zip(stacks, sizes, strict=True):
                empty = (np.zeros((n, 0, out), np.float32), np.zeros((n, 0, inp), np.float32), np.zeros((n, 0), np.float32))
                U, V, w = s.factors.get(k, empty)
                pad = r - U.shape[1]
                parts.append((np.pad(U, ((0, 0), (0, pad), (0, 0))), np.pad(V, ((0, 0), (0, pad), (0, 0))), np.pad(w, ((0, 0), (0, pad)))))
            U_all, V_all, w_all = (np.concatenate([p[i] for p in parts]) for i in range(3))
            factors[k] = (U_all, V_all, w_all)
        return ModuleStack(sum(sizes), norms, dense, factors)

    def module_cosines(self, queries: ModuleStack, chunk: int = 2048) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """Per shared module name: (name, cos (queries.size, self.size) float64, both-present mask)."""
        for name in sorted(queries.norms.keys() & self.norms.keys()):
            if (name in self.dense) != (name in queries.dense):
                raise ValueError(f"stacks of different layouts for module {name}: build both with the same `dense`")
            shared = (queries.norms[name] > 0)[:, None] & (self.norms[name] > 0)[None, :]
            if name in self.dense:
                flat_q, flat_g = queries.dense[name].reshape(queries.size, -1), self.dense[name].reshape(self.size, -1)
                yield name, (flat_q @ flat_g.T).astype(np.float64), shared
                continue
            Ug, Vg, wg = self.factors[name]
            Uq, Vq, wq = queries.factors[name]
            rq = Uq.shape[1]
            Ug2, Vg2 = Ug.reshape(-1, Ug.shape[2]), Vg.reshape(-1, Vg.shape[2])
            cos = np.zeros((queries.size, self.size))
            step = max(1, chunk // max(rq, 1))
            for start in range(0, queries.size, step):
                sl = slice(start, start + step)
                cos[sl] = factor_cosines(Uq[sl].reshape(-1, Uq.shape[2]) @ Ug2.T, Vq[sl].reshape(-1, Vq.shape[2]) @ Vg2.T, wq[sl], wg)
            yield name, cos, shared

    def cosines(self, queries: ModuleStack) -> np.ndarray:
        """(queries.size, self.size) module cosine: mean per-module cosine over shared modules; 0 where none is shared."""
        total = np.zeros((queries.size, self.size))
        count = np.zeros((queries.size, self.size))
        for _, cos, shared in self.module_cosines(queries):
            total += cos * shared
            count += shared
        return total / np.maximum(count, 1)

    def inner_products(self, queries: ModuleStack) -> np.ndarray:
        """(queries.size, self.size) ⟨dW_q, dW_g⟩ of the whole updates (summed over modules)."""
        total = np.zeros((queries.size, self.size))
        for name, cos, _ in self.module_cosines(queries):
            total += cos * queries.norms[name].astype(np.float64)[:, None] * self.norms[name].astype(np.float64)[None, :]
        return total

    def dw_cosines(self, queries: ModuleStack) -> np.ndarray:
        """(queries.size, self.size) cosine of the whole updates, ⟨dW_q, dW_g⟩ / (‖dW_q‖ ‖dW_g‖)."""
        return self.inner_products(queries) / np.maximum(np.outer(queries.total_norms(), self.total_norms()), 1e-30)

    def total_norms(self) -> np.ndarray:
        """(size,) ‖dW‖_F of each whole update."""
        return np.sqrt(sum((v.astype(np.float64) ** 2 for v in self.norms.values()), np.zeros(self.size)))

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat name → array map for persistence (see `from_arrays`)."""
        out = {f"norms/{k}": v for k, v in self.norms.items()}
        out.update({f"dense/{k}": v for k, v in self.dense.items()})
        for k, (U, V, w) in self.factors.items():
            out.update({f"U/{k}": U, f"V/{k}": V, f"w/{k}": w})
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], size: int) -> ModuleStack:
        """The stack `arrays` wrote; ValueError for dense modules stored flattened (N, out·in), as before they kept
        their shape: the input Gram needs it."""

        def part(prefix: str) -> dict[str, np.ndarray]:
            return {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(prefix + "/")}

        U, V, w, dense = part("U"), part("V"), part("w"), part("dense")
        flat = sorted(k for k, v in dense.items() if v.ndim != 3)
        if flat:
            raise ValueError(f"dense modules {flat} stored flattened: an older stack, to be rebuilt")
        return cls(size, part("norms"), dense, {k: (U[k], V[k], w[k]) for k in U})


def factor_cosines(PU: np.ndarray, PV: np.ndarray, wq: np.ndarray, wg: np.ndarray) -> np.ndarray:
    """(q, g) one module's cosines of q queries against g gallery rows, from their factors' blocks PU = [U_qᵢ U_gⱼᵀ]
    and PV = [V_qᵢ V_gⱼᵀ] (each (q·rq, g·rg)) and unit spectra wq (q, rq), wg (g, rg): Σ_ab s_a (C_U)_ab (C_V)_ab t_b."""
    (q, rq), (g, rg) = wq.shape, wg.shape
    terms = (PU * PV).reshape(q, rq, g, rg) * wq[:, :, None, None]
    return (terms.sum(axis=1) * wg[None, :, :]).sum(axis=2)


def layout_of(adapters: Sequence[Factors]) -> dict[str, tuple[int, int, int]]:
    """Per module name: (out, in, largest rank) over the adapters, the layout `ModuleStack.allocate` takes."""
    layout: dict[str, tuple[int, int, int]] = {}
    for a in adapters:
        for name, f in a.items():
            _, _, r = layout.get(name, (0, 0, 0))
            layout[name] = (int(f.U.shape[0]), int(f.V.shape[0]), max(r, f.rank))
    return layout


def _numpy(f: CanonicalFactors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return f.U.detach().cpu().float().numpy(), f.S.detach().cpu().float().numpy(), f.V.detach().cpu().float().numpy()


def module_cosine_matrix(queries: Sequence[Factors], gallery: Sequence[Factors]) -> np.ndarray:
    """(len(queries), len(gallery)) mean per-module dW cosines over shared modules; 0 where none is shared."""
    dense = dense_modules([*queries, *gallery])
    return ModuleStack.of(gallery, dense).cosines(ModuleStack.of(queries, dense))


def dw_cosine_matrix(queries: Sequence[Factors], gallery: Sequence[Factors]) -> np.ndarray:
    """(len(queries), len(gallery)) cosine of the whole updates, ⟨dW_q, dW_g⟩ / (‖dW_q‖ ‖dW_g‖)."""
    dense = dense_modules([*queries, *gallery])
    return ModuleStack.of(gallery, dense).dw_cosines(ModuleStack.of(queries, dense))


def sketch_width(n_modules: int) -> int:
    """Probe pairs per module for a space of `n_modules`: MODULE_SKETCH_DIM, fewer where the whole vector would pass
    MAX_SEARCH_DIM (at least one). The module cosine's estimate averages over modules, so its error stays near
    1/√(n_modules · width) ≥ 1/√MAX_SEARCH_DIM however the dimensions are shared out."""
    return max(1, min(MODULE_SKETCH_DIM, MAX_SEARCH_DIM // max(n_modules, 1)))


def module_sketches(adapters: Sequence[Factors], modules: Sequence[str], dim: int) -> np.ndarray:
    """(N, len(modules)·dim) float32: per module its `dim` seeded probe values ω_jᵀ·dW·ψ_j divided by √dim·‖dW‖_F
    (zeros where the adapter lacks the module), so that a block's inner product with another adapter's is an
    unbiased estimate of that module's cosine. Module by module, each module's probes taken once for all the
    adapters; float32 products on one torch thread each (each is small: waking a thread pool for it costs more than
    the product, tens of times more on a busy machine), whole modules shared out over as many threads as torch had
    where they are large (`module_threads`, `for_each_module`)."""
    import torch

    from zoo.domain.probes import sketch_probes  # torch: only when sketching

    out = np.zeros((len(adapters), len(modules), dim), dtype=np.float32)

    def sketch(m: int, name: str) -> None:
        present = [(i, a[name]) for i, a in enumerate(adapters) if name in a and a[name].rank]
        if not present:
            return
        first = present[0][1]
        omega, psi = sketch_probes(name, first.U.shape[0], first.V.shape[0], dim, _SKETCH_SALT)
        for i, f in present:
            z = ((omega @ f.U.float()) * (psi @ f.V.float())) @ f.S.float()
            out[i, m] = (z / (torch.linalg.vector_norm(f.S.double()) * dim**0.5).clamp_min(1e-300)).numpy()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for_each_module(modules, sketch, module_threads(adapters, threads), initializer=lambda: torch.set_num_threads(1))
    finally:
        torch.set_num_threads(threads)
    return out.reshape(len(adapters), -1)


def sketch_module_cosines(queries: np.ndarray, gallery: np.ndarray, n_modules: int) -> np.ndarray:
    """Module cosine estimated from module sketches (any overall scaling, e.g. the index's unit vectors): the
    vectors' cosine times √(modules of the query · modules of the other) over the modules both have. A present
    module's block has expected squared norm 1, so a vector's squared norm is about its module count; 0 where none
    is shared."""

    def unit_and_presence(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x, dtype=np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30), module_presence(x, n_modules)

    q, q_present = unit_and_presence(queries)
    g, g_present = unit_and_presence(gallery)
    shared = q_present @ g_present.T
    scale = np.sqrt(np.outer(q_present.sum(axis=1), g_present.sum(axis=1)))
    return (q @ g.T).astype(np.float64) * scale / np.maximum(shared, 1.0)


def module_presence(sketches: np.ndarray, n_modules: int) -> np.ndarray:
    """(n, n_modules) float32: 1 where a sketch's module block is not all zero. The blocks' peaks are taken a probe
    column at a time (numpy reduces a short last axis slowly: 400 Llama-3-8B sketches in 0.5 ms, not 4)."""
    blocks = np.abs(np.asarray(sketches, dtype=np.float32)).reshape(len(sketches), n_modules, -1)
    peak = blocks[:, :, 0].copy()
    for j in range(1, blocks.shape[2]):
        np.maximum(peak, blocks[:, :, j], out=peak)
    return (peak > 0).astype(np.float32)


def hybrid_score(exact: np.ndarray | float, w2t_cosine: np.ndarray, weight: float) -> np.ndarray:
    """(1 - weight) × an exact score + weight × the supervised W2T embedding's cosine (`exact` may be 0.0 where
    `weight` is 1: nothing to compute)."""
    return (1.0 - weight) * exact + weight * w2t_cosine


def rerank_keys(first: np.ndarray, second: np.ndarray, top: int) -> np.ndarray:
    """Ranking keys of a two-stage search, row by row (1-D: one row): the `top` best by `first` come first, in the
    order of `second`, then the rest in the order of `first`. Entries of `first` that are -inf (what a row may not
    return) stay -inf and are never among the top."""
    first = np.asarray(first, np.float64)
    rows = np.atleast_2d(first)
    second_rows = np.broadcast_to(np.atleast_2d(np.asarray(second, np.float64)), rows.shape)
    keys = rows.copy()
    top = min(top, rows.shape[1])
    if top:
        best = np.argpartition(-rows, top - 1, axis=1)[:, :top]
        finite = np.isfinite(np.take_along_axis(rows, best, axis=1))
        # above every first-stage key: mixes of cosines lie in [-1, 1]
        lifted = np.where(finite, 4.0 + np.take_along_axis(second_rows, best, axis=1), -np.inf)
        np.put_along_axis(keys, best, lifted, axis=1)
    return keys if first.ndim == 2 else keys[0]
