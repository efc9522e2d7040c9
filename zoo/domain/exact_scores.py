"""The exact scores that search and the out-of-fold choice weigh, in one pass over the modules (pure math, no I/O).

EXACT_SCORES are the training-free ones: the whole update's dW cosine, module cosine (the mean per-module cosine) and
the input Gram cosine (zoo/domain/channels.py), which ignores what a run's own head or seed does to dW's output side.
The centred input Gram (zoo/domain/centred_gram.py) and its mean with module cosine need a reference `zoo train`
fitted (REFERENCED).

All of them read the same per-module blocks of the two stacks' factors, U_qᵢU_gⱼᵀ and V_qᵢV_gⱼᵀ, a chunk of queries at
a time: dW and module cosine both sides' blocks, the input Grams (plain and centred) the squares of the V blocks.
`exact_matrices` makes each block once per module and chunk and derives every score asked for from it, so asking for
all four costs about what module cosine alone does. Each score equals its own computation (ModuleStack.cosines,
ModuleStack.dw_cosines, the "input_gram" channel) to the bit: the same products in the same chunks, summed in the
same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, REFERENCED, GramReference, centred_cosines
from zoo.domain.channels import ModuleFactors, module_factors, squared_overlaps, unit_weights, weighted_squares
from zoo.domain.similarity import ModuleStack, factor_cosines

#: the training-free exact scores: the whole update's cosine, the mean per-module cosine and the mean per-module
#: input Gram cosine
EXACT_SCORES = ("dw", "module", "input_gram")


def exact_cosines(gallery: ModuleStack, queries: ModuleStack, score: str, reference: GramReference | None = None) -> np.ndarray:
    """(queries.size, gallery.size) float64 one exact score (`exact_matrices`)."""
    return exact_matrices(gallery, queries, (score,), reference)[score]


def exact_matrices(
    gallery: ModuleStack,
    queries: ModuleStack,
    scores: Sequence[str] = EXACT_SCORES,
    reference: GramReference | None = None,
    chunk: int = 2048,
) -> dict[str, np.ndarray]:
    """Per score asked for (EXACT_SCORES, and those of REFERENCED with their `reference`): (queries.size,
    gallery.size) float64, on stacks of any layout (both built with the same dense modules). Per-module scores are the
    mean over the modules both adapters have (0 where none)."""
    unknown = sorted(set(scores) - {*EXACT_SCORES, *REFERENCED})
    if unknown:
        raise ValueError(f"unknown exact scores {unknown}; each one of {(*EXACT_SCORES, *REFERENCED)}")
    if set(REFERENCED) & set(scores) and reference is None:
        raise ValueError(f"{sorted(set(REFERENCED) & set(scores))} need the reference `zoo train` fitted")
    shape = (queries.size, gallery.size)
    made = set(scores) | ({"module", CENTRED_GRAM} if MODULE_CENTRED in scores else set())
    first_order, grams = {"dw", "module"} & made, {"input_gram", CENTRED_GRAM} & made
    means = {s: np.zeros(shape) for s in made - {"dw", MODULE_CENTRED}}
    count, inner = np.zeros(shape), np.zeros(shape)
    for name in sorted(queries.norms.keys() & gallery.norms.keys()):
        if (name in gallery.dense) != (name in queries.dense):
            raise ValueError(f"stacks of different layouts for module {name}: build both with the same `dense`")
        shared = (queries.norms[name] > 0)[:, None] & (gallery.norms[name] > 0)[None, :]
        factors = (module_factors(queries, name), module_factors(gallery, name)) if grams else None
        cos, plain = _module_blocks(gallery, queries, name, bool(first_order), factors, chunk)
        if cos is not None:
            if "module" in means:
                means["module"] += cos * shared
            if "dw" in scores:
                inner += cos * queries.norms[name].astype(np.float64)[:, None] * gallery.norms[name].astype(np.float64)[None, :]
        if plain is not None and factors is not None:
            if "input_gram" in means:
                means["input_gram"] += plain * shared
            if reference is not None and CENTRED_GRAM in means:
                means[CENTRED_GRAM] += centred_cosines(plain, name, *factors, reference) * shared
        count += shared
    out = {s: m / np.maximum(count, 1) for s, m in means.items()}
    if "dw" in scores:
        out["dw"] = inner / np.maximum(np.outer(queries.total_norms(), gallery.total_norms()), 1e-30)
    if MODULE_CENTRED in scores:
        out[MODULE_CENTRED] = module_centred(out["module"], out[CENTRED_GRAM])
    return {s: out[s] for s in scores}


def module_centred(module: np.ndarray, centred: np.ndarray) -> np.ndarray:
    """MODULE_CENTRED from module cosine and the centred input Gram cosine between the same adapters: their mean (both
    are means over the same shared modules)."""
    return (module + centred) / 2


def _module_blocks(
    gallery: ModuleStack,
    queries: ModuleStack,
    name: str,
    first_order: bool,
    factors: tuple[ModuleFactors, ModuleFactors] | None,
    chunk: int,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """One module's (module cosine or None, plain input Gram cosine or None): from the same blocks where the module
    is kept as factors; a dense module's cosine from its flat unit dW, its Gram from its factors (`module_factors`)."""
    if name in gallery.dense:
        cos = None
        if first_order:
            flat_q, flat_g = queries.dense[name].reshape(queries.size, -1), gallery.dense[name].reshape(gallery.size, -1)
            cos = (flat_q @ flat_g.T).astype(np.float64)
        if factors is None:
            return cos, None
        fq, fg = factors
        return cos, squared_overlaps(fq[1], fg[1], [(unit_weights(fq[2], "gram"), unit_weights(fg[2], "gram"))], chunk)[0]
    (Uq, Vq, wq), (Ug, Vg, wg) = queries.factors[name], gallery.factors[name]
    Ug2, Vg2 = Ug.reshape(-1, Ug.shape[2]), Vg.reshape(-1, Vg.shape[2])
    cos = np.zeros((queries.size, gallery.size)) if first_order else None
    plain = np.zeros((queries.size, gallery.size)) if factors is not None else None
    pq, pg = unit_weights(wq, "gram"), unit_weights(wg, "gram")
    step = max(1, chunk // max(Uq.shape[1], 1))
    for start in range(0, queries.size, step):
        sl = slice(start, start + step)
        PV = Vq[sl].reshape(-1, Vq.shape[2]) @ Vg2.T
        if cos is not None:
            cos[sl] = factor_cosines(Uq[sl].reshape(-1, Uq.shape[2]) @ Ug2.T, PV, wq[sl], wg)
        if plain is not None:
            plain[sl] = weighted_squares(PV, [(pq[sl], pg)])[0]
    return cos, plain
