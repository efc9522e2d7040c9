"""The input Gram cosine with a reference removed: the centred input Gram (pure math, no I/O).

Every LoRA's A leans on the base model's dominant input directions, so any two adapters' input Grams share a positive
part that says nothing of their tasks. Per module, with Ĝ = V diag(ĝ) Vᵀ the unit input Gram (ĝ = S²/‖S²‖, so
‖Ĝ‖_F = 1) and M the module's reference (a fixed positive semi-definite matrix), the centred input Gram cosine of two
adapters is the cosine of Ĝ_x − M and Ĝ_y − M:

    (K_xy − r_x − r_y + g) / √((K_xx − 2 r_x + g)(K_yy − 2 r_y + g)),   K_xy = ⟨Ĝ_x, Ĝ_y⟩, r = ⟨Ĝ, M⟩, g = ‖M‖²_F,

in [-1, 1], every term from r×r or r×k blocks (never a d × d matrix), averaged over the modules both adapters have as
the other channels are (zoo/domain/channels.py). A pair whose centred Gram vanishes (Ĝ = M) scores 0; a module that no
reference adapter has has M = 0 there, and scores the plain input Gram cosine.

A module's reference is the mean unit input Gram of the reference adapters (`fit_gram_reference`: a seeded sample of
the space's adapters, labelled or not, `reference_sample`: no label shapes it, and the more adapters it is the mean
of, the less it holds of any one task's), kept as its top REFERENCE_RANK eigenpairs Q diag(λ) Qᵀ: what the adapters share lies in
its leading directions, and any truncation is still a fixed matrix, so the score stays an exact cosine of the two
centred Grams, the same in training, `zoo eval` and serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zoo.domain.channels import ModuleFactors, module_factors, squared_overlaps, unit_weights
from zoo.domain.similarity import ModuleStack

#: the exact score's name (a search score's `exact`, zoo.domain.methods.SearchScore): training-free, but served only
#: with the reference `zoo train` fitted
CENTRED_GRAM = "centred_gram"
#: module cosine and the centred input Gram cosine averaged (per module, so over the modules a pair shares): the cosine
#: of the two updates' first-order (dW) and centred second-order (Ĝ − M) views, each of unit norm, side by side. The
#: first order carries what an update writes, which a run's own head and seeds turn; the centred Gram what it reads
#: beyond what every adapter reads, which they leave alone
MODULE_CENTRED = "module_centred"
#: the exact scores that need the reference: served only with the reference `zoo train` fitted
REFERENCED = (CENTRED_GRAM, MODULE_CENTRED)
#: eigenpairs kept of each module's mean unit input Gram: 1 MB of float32 a 4,096-wide module, about 310 MB for
#: Llama-3-8B's 224 modules (its 32 down_proj are 14,336 wide), held by a serving process that loads the checkpoint
REFERENCE_RANK = 64
#: the most adapters a module's reference is the mean of (a seeded sample of those that have the module past it): at 14,336
#: inputs and rank 16, a float32 matrix of 117 MB to factor
REFERENCE_ADAPTERS = 128
#: the most adapters of a space, labelled or not, the reference is fitted from (reference_sample): enough that a module
#: most adapters share finds REFERENCE_ADAPTERS among them
REFERENCE_POOL = 4 * REFERENCE_ADAPTERS
#: the most values (d × reference components) a module's mean is factored exactly at, in float64; past it, by a seeded
#: randomized SVD in float32
EXACT_SVD_VALUES = 4_000_000
#: centred norms² (of unit Grams: at most 1 + g) below this are a vanished Gram (Ĝ = M to float32 round-off): its
#: cosines are 0
VANISHED = 1e-5


@dataclass(frozen=True)
class GramReference:
    """Per module name: (Q (k, d) float32 with orthonormal rows, λ (k,) float32 ≥ 0), the reference M = Qᵀ diag(λ) Q."""

    modules: Mapping[str, tuple[np.ndarray, np.ndarray]]

    def arrays(self) -> dict[str, np.ndarray]:
        """Named arrays (`Q/<module>`, `lam/<module>`) that `from_arrays` reads back, e.g. through np.savez."""
        out: dict[str, np.ndarray] = {}
        for name, (Q, lam) in self.modules.items():
            out[f"Q/{name}"], out[f"lam/{name}"] = Q, lam
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> GramReference:
        names = [k.removeprefix("Q/") for k in arrays if k.startswith("Q/")]
        return cls({n: (np.asarray(arrays[f"Q/{n}"], np.float32), np.asarray(arrays[f"lam/{n}"], np.float32)) for n in names})

    def projections(self, name: str, factors: ModuleFactors) -> np.ndarray:
        """(N,) float64 r = ⟨Ĝ, M⟩ of each row of a module's factors (U, V, w) (0 where the row lacks it or M is
        absent)."""
        _, V, w = factors
        if name not in self.modules:
            return np.zeros(len(w))
        Q, lam = self.modules[name]
        weights = [(_float64(unit_weights(w, "gram")), lam[None].astype(np.float64))]
        return squared_overlaps(_float64(V), Q[None].astype(np.float64), weights, 2048)[0][:, 0]

    def energy(self, name: str) -> float:
        """g = ‖M‖²_F of a module (0 where absent)."""
        return float(np.sum(self.modules[name][1].astype(np.float64) ** 2)) if name in self.modules else 0.0


def reference_sample(ids: Sequence[int]) -> list[int]:
    """The adapters (of `ids`, a space's) the centred input Gram's reference is fitted on: all of them up to
    REFERENCE_POOL, past it a seeded sample of that many, in the order of `ids` (fit_gram_reference then takes at most
    REFERENCE_ADAPTERS of those that have a module). On docs-minilm-seeded, fitted on the whole zoo rather than on its 72
    labelled adapters, the averaged score's size-weighted, trended 10-NN ranked held-out accuracy +0.03 better and its
    hit@1 rose +0.02; fitted on a sample of 128 of its 200 adapters, a module's mean of about 85 of them, its hit@1 moved
    by ±0.02 with the sample (docs/history/results-2026.md, "Performance: the trend over the update's profile")."""
    if len(ids) <= REFERENCE_POOL:
        return list(ids)
    picked = np.sort(np.random.default_rng(0).choice(len(ids), REFERENCE_POOL, replace=False))
    return [ids[i] for i in picked.tolist()]


def fit_gram_reference(stack: ModuleStack, rows: Sequence[int] | np.ndarray, rank: int = REFERENCE_RANK) -> GramReference:
    """Each module's mean unit input Gram over the stack's `rows` that have it (at most REFERENCE_ADAPTERS of them),
    kept as its top `rank` eigenpairs: the mean is W Wᵀ with W the rows' V diag(√ĝ) side by side over √n, whose left
    singular vectors and squared singular values are its eigenpairs (a randomized SVD, seeded, past EXACT_SVD_VALUES)."""
    from sklearn.utils.extmath import randomized_svd

    picked = np.asarray(rows, dtype=np.int64)
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in sorted(stack.norms):
        have = picked[stack.norms[name][picked] > 0]
        if not len(have):
            continue
        if len(have) > REFERENCE_ADAPTERS:  # a seeded sample: the mean's leading directions, at a bounded cost
            have = np.sort(np.random.default_rng(0).choice(have, REFERENCE_ADAPTERS, replace=False))
        _, V, w = module_factors(stack, name)
        scale = np.sqrt(unit_weights(w[have], "gram") / np.float32(len(have)))  # (n, R)
        k = min(rank, V.shape[2], V.shape[1] * len(have))
        if V.shape[1] * V.shape[2] * len(have) <= EXACT_SVD_VALUES:
            W = (V[have].astype(np.float64) * scale[:, :, None]).reshape(-1, V.shape[2]).T  # (d, n·R)
            Q, sigma, _ = np.linalg.svd(W, full_matrices=False)
        else:
            W32 = (V[have] * scale[:, :, None]).reshape(-1, V.shape[2]).T
            Q, sigma, _ = randomized_svd(W32, k, random_state=0)
        modules[name] = (np.ascontiguousarray(Q[:, :k].T, dtype=np.float32), (sigma[:k] ** 2).astype(np.float32))
    return GramReference(modules)


def _float64(x: np.ndarray) -> np.ndarray:
    """x in float64, for the small products (r × r, r × k a row) of the terms centring subtracts from the pair's
    float32 Gram cosine: a Gram near its reference leaves a small difference, which their round-off would swamp."""
    return x.astype(np.float64, copy=False)


def _self_grams(factors: ModuleFactors) -> np.ndarray:
    """(N,) ‖Ĝ‖²_F of each row from its stored factors (1 to float32 round-off, which the centred norm² of a Gram near
    its reference would otherwise amplify: a row's cosine with itself is then exactly 1)."""
    _, V, w = factors
    g, X = _float64(unit_weights(w, "gram")), _float64(V)
    C = np.matmul(X, X.transpose(0, 2, 1)) ** 2  # (N, R, R)
    return np.einsum("na,nab,nb->n", g, C, g)


def centred_cosines(plain: np.ndarray, name: str, fq: ModuleFactors, fg: ModuleFactors, reference: GramReference) -> np.ndarray:
    """One module's (queries, gallery) centred input Gram cosines from its plain ones (K = ⟨Ĝ_q, Ĝ_g⟩) and both
    sides' factors of it."""
    rq, rg, g = reference.projections(name, fq), reference.projections(name, fg), reference.energy(name)
    nq, ng = _self_grams(fq) - 2 * rq + g, _self_grams(fg) - 2 * rg + g
    scale = np.sqrt(np.outer(np.maximum(nq, VANISHED), np.maximum(ng, VANISHED)))
    # clipped: the float32 products of K and the float64 self terms may round a cosine past ±1
    return np.where(np.outer(nq > VANISHED, ng > VANISHED), np.clip((plain - rq[:, None] - rg[None, :] + g) / scale, -1, 1), 0.0)
