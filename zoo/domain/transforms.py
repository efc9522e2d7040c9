"""Transforms of one update: how a query adapter's update derives from one stored candidate's.

Pure math on canonical factors (what the blob store keeps, zoo/domain/canonical.py) and a summary of the factors
as read from the file (`FactorSummary`: their precisions and exact zeros, kept at ingest). Plain dataclasses in and
out; every result carries its evidence (named numbers) and a confidence in [0, 1] that orders edges but is not yet
calibrated.

Transforms of one update (`detect_transform`): with c the least-squares scale over all modules, the
relative residual ρ = ‖dW_q - c·T(dW_p)‖ / ‖dW_q‖ (T the identity or the top-k truncation) says what
the rest is:

- ρ below the fp16 band (< 1.0e-4): the same update, `identical`, or `rescaled` when |c - 1| > ρ;
- ρ in a precision's band: `cast` to that precision and back (with `rescaled` before it if |c - 1| > ρ).
  Rounding A and B to p significant bits leaves each entry a relative error of RMS 0.425·2⁻ᵖ (round to
  nearest, mantissas log-uniform), and dW = BA the sum of two such errors: ρ ≈ √2·0.425·2⁻ᵖ, 2.3e-3 for
  bf16 (p = 8) and 2.9e-4 for fp16 (p = 11). The band is that value times or divided by √8 (up to the
  geometric mean of the two precisions' values), so the bands tile: fp16 [1.0e-4, 8.3e-4], bf16
  [8.3e-4, 6.6e-3]. Where the factors as read from the file are summarized (`FactorSummary`, kept at
  ingest), the precision must also hold every entry of them exactly;
- the query's rank lower than the candidate's in some module and ρ of the truncation within those bands:
  `truncated` to the kept rank;
- more exact zeros in the query's factors as read than in the candidate's (training leaves some too, which copies
  share) and ρ consistent with the entries removed: `pruned`, with the sparsity (the share of all zeros).
  Pruned entries lie within ±t (t the smallest kept magnitude), so the residual is predicted from the zeros'
  positions and t in the query's own gauge (see `_pruning_residual`), at ingest, into the summary. Without a
  summary (adapters stored before it was kept) a pruned copy is not recognized.

`relation` is the most structural step found (truncated or pruned, else rescaled, else cast, else
identical); `steps` lists all of them in the order they were applied.

The `identical` and fp16 bands lie below ingest's duplicate tolerance (zoo.domain.fingerprint.DUPLICATE_RTOL,
1e-3), so such a copy of a stored update is stored as that update's duplicate and never reaches this test;
bf16 casts lie above it.

Merges are in zoo/domain/merges.py, continuations in zoo/domain/continuation.py, and
zoo/domain/relations.py runs all three.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch

from zoo.domain.canonical import CanonicalFactors, LowRankModule, frobenius_norm_sq
from zoo.domain.factorwise import RawModule
from zoo.domain.lowrank import LowRank, float64, inner, sq_norm
from zoo.domain.pair_blocks import Origin, PairBlocks

T = TypeVar("T")

#: RMS relative rounding error of an entry rounded to p significant bits (log-uniform mantissas): 0.425·2⁻ᵖ
ROUNDING_RMS = 0.425
#: significant bits (implicit bit included) of the precisions a cast is recognized to
PRECISION_BITS = {"bf16": 8, "fp16": 11}
#: a precision's band is its expected residual times or divided by this (√8: the bands of bf16 and fp16 tile)
BAND_FACTOR = math.sqrt(8.0)
#: the least share of exact zeros in the raw factors (of modules with a non-zero update), beyond the candidate's, read
#: as pruning
MIN_PRUNED_SHARE = 0.005
#: the observed pruning residual over the predicted bound must lie within this band (see _pruning_residual)
PRUNE_RATIO_BAND = (0.15, 1.5)
#: the largest relative residual of a pruned copy (its module cosine with the source at least 0.8): pruning half the
#: entries of a lineage recipe's adapter left 0.42, and unrelated adapters of one task reach cosine 0.76 (ρ 0.65), which
#: a heavily pruned adapter's bound (near 1) would otherwise admit
PRUNED_MAX_RESIDUAL = 0.6


def expected_cast_residual(precision: str) -> float:
    """ρ expected of a cast of A and B to `precision` and back."""
    return math.sqrt(2.0) * ROUNDING_RMS * 2.0 ** -PRECISION_BITS[precision]


def residual_class(rho: float) -> str | None:
    """'identical', 'fp16' or 'bf16' when ρ lies in that band (the bands tile from 0 to bf16's upper edge), else None."""
    finest = max(PRECISION_BITS, key=PRECISION_BITS.__getitem__)
    if rho < expected_cast_residual(finest) / BAND_FACTOR:
        return "identical"
    for precision in sorted(PRECISION_BITS, key=PRECISION_BITS.__getitem__, reverse=True):  # finest first
        if rho <= expected_cast_residual(precision) * BAND_FACTOR:
            return precision
    return None


@dataclass(frozen=True)
class FactorSummary:
    """What the detectors need of an adapter's factors as read from its file (A and B in their own gauge), kept at
    ingest since A and B are not: the precisions that hold every entry exactly (a cast must fit one) and the exact zeros
    with the residual their pruning would leave (a pruned copy). Over the modules with a non-zero update."""

    precisions: frozenset[str]
    zeros: int
    entries: int
    pruning_residual_sq: float  # _pruning_residual summed over modules; 0 below MIN_PRUNED_SHARE zeros

    @classmethod
    def of(cls, raw: Mapping[str, LowRankModule], factors: Mapping[str, CanonicalFactors]) -> FactorSummary:
        """The summary of an adapter's raw modules; `factors` (its canonical ones) say which updates are non-zero."""
        live = [raw[n] for n, f in factors.items() if f.rank]
        zeros = sum(zero_count(t) for m in live for t in (m.A, m.B))
        entries = sum(m.A.numel() + m.B.numel() for m in live)
        pruning = 0.0
        if entries and zeros / entries >= MIN_PRUNED_SHARE:
            pruning = sum(_pruning_residual(m.A.double(), m.B.double(), float(m.scale)) for m in live)
        return cls(frozenset(raw_precisions(raw)), zeros, entries, pruning)

    @property
    def zero_share(self) -> float:
        return self.zeros / self.entries if self.entries else 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "precisions": sorted(self.precisions),
            "zeros": self.zeros,
            "entries": self.entries,
            "pruning_residual_sq": self.pruning_residual_sq,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FactorSummary:
        return cls(frozenset(data["precisions"]), int(data["zeros"]), int(data["entries"]), float(data["pruning_residual_sq"]))


@dataclass(frozen=True)
class Update:
    """What the detectors read of an adapter: its canonical factors per module (what is stored) and, where known, the
    summary of its factors as read from its file (`FactorSummary`), which pruning needs and a cast uses. `id` names a
    stored candidate (None for a query being ingested); `pairs`, with an id, keeps its modules' blocks with other stored
    adapters' past this update (zoo/domain/pair_blocks.py)."""

    factors: Mapping[str, CanonicalFactors]
    summary: FactorSummary | None = None
    id: int | None = None
    #: what the detectors computed of this update, kept for its other pairs (see `computed`)
    _computed: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    pairs: PairBlocks | None = field(default=None, compare=False, repr=False)
    #: where this is a sample of an update's modules (`sampled`): how many non-zero modules the whole has
    whole_modules: int | None = None

    def sampled(self, names: Sequence[str], energy: float | None = None) -> Update:
        """This update's modules of `names` alone (zoo/domain/module_sample.py), compared as the whole would be: its
        structure stays the whole's (only updates of one structure are compared) and its summary's pruning bound is
        scaled to the sample's share of the update's energy Σ S² (`energy`, the whole's, where known: else summed here,
        which reads every module's S), as the residual it bounds is the sample's."""
        kept = {n: self.factors[n] for n in names if n in self.factors}
        if energy is None:
            energy = sum(frobenius_norm_sq(f) for f in self.factors.values())
        share = min(1.0, sum(frobenius_norm_sq(f) for f in kept.values()) / energy) if energy > 0 else 1.0
        summary = self.summary
        if summary is not None:
            summary = FactorSummary(summary.precisions, summary.zeros, summary.entries, summary.pruning_residual_sq * share)
        out = Update(kept, summary, self.id, pairs=self.pairs, whole_modules=sum(1 for f in self.factors.values() if f.rank))
        out._computed["shapes"] = self.shapes()
        return out

    def modules(self) -> dict[str, LowRank]:
        """The non-zero modules in float64, made once (an adapter is compared with k others, both ways)."""

        def make() -> dict[str, LowRank]:
            store, i = self.pairs, self.id
            return {
                n: LowRank.of(f, Origin(store, i, n) if store is not None and i is not None else None)
                for n, f in self.factors.items()
                if f.rank
            }

        return dict(self.computed("modules", make))

    def raw_modules(self) -> dict[str, RawModule]:
        """The non-zero modules whose gauge is known, as PEFT's factorwise merges are fitted on them (float64, made once)."""

        def make() -> dict[str, RawModule]:
            out = {}
            for name, f in self.factors.items():
                if f.rank and f.gauge is not None:
                    M, N = f.gauge
                    low = self.modules()[name]
                    out[name] = RawModule(low.U, low.S, low.V, float64(M), float64(N))
            return out

        return dict(self.computed("raw_modules", make))

    def computed(self, key: str, compute: Callable[[], T]) -> T:
        """compute() the first time `key` is asked for, then the same value."""
        if key not in self._computed:
            self._computed[key] = compute()
        return cast(T, self._computed[key])

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) by module (made once: every pair compares them)."""
        return self.computed("shapes", lambda: {name: (int(f.U.shape[0]), int(f.V.shape[0])) for name, f in self.factors.items()})


@dataclass(frozen=True)
class TransformEdge:
    """`child` is `relation` of `parent`: dW_child = c·T(dW_parent) up to the rounding of `precision` (ids; None is the query)."""

    parent: int | None
    child: int | None
    relation: str  # identical | rescaled | cast | truncated | pruned
    steps: tuple[str, ...]
    scale: float
    precision: str | None = None  # bf16 | fp16, for a cast
    kept_rank: dict[str, int] | None = None  # per module, for a truncation
    sparsity: float | None = None  # share of zero entries in A and B, for pruning
    confidence: float = 0.0
    evidence: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ScaleFit:
    """dW_q ≈ c·T(dW_p): the scale, per-module residuals² and norms² of the query."""

    scale: float
    residual_sq: dict[str, float]
    query_sq: dict[str, float]
    module_scales: dict[str, float]

    @property
    def rho(self) -> float:
        total = sum(self.query_sq.values())
        return math.sqrt(sum(self.residual_sq.values()) / total) if total > 0 else math.inf

    def module_rhos(self) -> dict[str, float]:
        return {n: math.sqrt(r / self.query_sq[n]) if self.query_sq[n] > 0 else math.inf for n, r in self.residual_sq.items()}


def fit_scale(q: Mapping[str, LowRank], p: Mapping[str, LowRank]) -> ScaleFit:
    qq = {n: sq_norm(x) for n, x in q.items()}
    pp = {n: sq_norm(p[n]) for n in q}
    qp = {n: inner(q[n], p[n]) for n in q}
    c = sum(qp.values()) / sum(pp.values()) if sum(pp.values()) > 0 else 0.0
    residual = {n: max(qq[n] - 2 * c * qp[n] + c * c * pp[n], 0.0) for n in q}
    return ScaleFit(c, residual, qq, {n: qp[n] / pp[n] if pp[n] > 0 else 0.0 for n in q})


def same_structure(query: Update, candidate: Update) -> bool:
    """Same module names and shapes."""
    return query.shapes() == candidate.shapes()


def detect_transform(query: Update, candidate: Update) -> TransformEdge | None:
    """The transform that makes the query from the candidate, if any (see the module's docstring)."""
    if not same_structure(query, candidate):
        return None
    q, p = query.modules(), candidate.modules()
    if not q or q.keys() != p.keys():
        return None
    formats = query.summary.precisions if query.summary is not None else None
    fit = fit_scale(q, p)
    ids = (candidate.id, query.id)
    edge = _classify(fit, formats, ids, ())
    if edge is not None:
        return edge
    kept = {n: x.rank for n, x in q.items() if x.rank < p[n].rank}
    if kept:
        truncated = {n: p[n].top(kept[n]) if n in kept else p[n] for n in p}
        edge = _classify(fit_scale(q, truncated), formats, ids, ("truncated",), kept_rank={n: q[n].rank for n in q})
        if edge is not None:
            tail = sum(sq_norm(p[n]) - sq_norm(truncated[n]) for n in kept) / sum(sq_norm(x) for x in p.values())
            return _with_evidence(edge, discarded_energy=tail)
    if query.summary is not None:
        return _pruned(fit, query.summary, candidate.summary, ids)
    return None


def _classify(
    fit: ScaleFit,
    formats: frozenset[str] | None,
    ids: tuple[int | None, int | None],
    structural: tuple[str, ...],
    kept_rank: dict[str, int] | None = None,
) -> TransformEdge | None:
    rho = fit.rho
    kind = residual_class(rho)
    if kind is None or (kind != "identical" and formats is not None and kind not in formats):
        return None
    rescaled = abs(fit.scale - 1.0) > max(rho, expected_cast_residual("fp16") / BAND_FACTOR)
    steps = (*(("rescaled",) if rescaled else ()), *structural, *(("cast",) if kind != "identical" else ()))
    relation = structural[0] if structural else "rescaled" if rescaled else "cast" if kind != "identical" else "identical"
    in_band = [residual_class(r) == kind for r in fit.module_rhos().values()]
    return TransformEdge(
        parent=ids[0],
        child=ids[1],
        relation=relation,
        steps=steps or ("identical",),
        scale=fit.scale,
        precision=None if kind == "identical" else kind,
        kept_rank=kept_rank,
        confidence=float(np.mean(in_band)),
        evidence=_fit_evidence(fit),
    )


def _fit_evidence(fit: ScaleFit) -> dict[str, float]:
    rhos = list(fit.module_rhos().values())
    scales = np.array(list(fit.module_scales.values()))
    return {
        "relative_residual": fit.rho,
        "module_residual_median": float(np.median(rhos)),
        "module_residual_max": float(np.max(rhos)),
        "scale": fit.scale,
        "scale_spread": float(scales.std() / abs(fit.scale)) if fit.scale else math.inf,
    }


def _with_evidence(edge: TransformEdge, **more: float) -> TransformEdge:
    return TransformEdge(**{**edge.__dict__, "evidence": {**edge.evidence, **more}})


def raw_precisions(raw: Mapping[str, LowRankModule]) -> set[str]:
    """The precisions (of PRECISION_BITS) that hold every entry of the raw A and B exactly."""
    formats = {"bf16": torch.bfloat16, "fp16": torch.float16}
    found = set()
    for name, dtype in formats.items():  # a tensor of that dtype holds its entries in it (they are finite: check_pair refuses others)
        if all(t.dtype == dtype or torch.equal(t.float(), t.to(dtype).float()) for m in raw.values() for t in (m.A, m.B)):
            found.add(name)
    return found


def zero_count(t: torch.Tensor) -> int:
    """Entries equal to zero (either sign). A half-precision tensor's are counted on its bits, as integers: torch
    compares float16 and bfloat16 on the CPU through float32, 30 ms of an SDXL file's 60 ms summary."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return int(np.count_nonzero((t.view(torch.int16).numpy() & 0x7FFF) == 0))
    return int((t == 0).sum())


def _pruned(
    fit: ScaleFit, summary: FactorSummary, candidate: FactorSummary | None, ids: tuple[int | None, int | None]
) -> TransformEdge | None:
    """A pruned copy of the candidate: more zeros than it has (training leaves exact zeros too, a few percent of the
    entries of every trained adapter of the lineage recipe, and its copies share them), and ρ within the bound
    the query's zeros predict."""
    share, predicted_sq = summary.zero_share, summary.pruning_residual_sq
    new = share - (candidate.zero_share if candidate is not None else 0.0)
    if new < MIN_PRUNED_SHARE or predicted_sq <= 0:
        return None
    if fit.rho > PRUNED_MAX_RESIDUAL:
        return None
    rho_bound = math.sqrt(predicted_sq / sum(fit.query_sq.values()))
    ratio = fit.rho / rho_bound
    if not PRUNE_RATIO_BAND[0] <= ratio <= PRUNE_RATIO_BAND[1]:
        return None
    lo, hi = PRUNE_RATIO_BAND
    middle = math.sqrt(lo * hi)
    return TransformEdge(
        parent=ids[0],
        child=ids[1],
        relation="pruned",
        steps=(*(("rescaled",) if abs(fit.scale - 1.0) > fit.rho else ()), "pruned"),
        scale=fit.scale,
        sparsity=share,
        confidence=1.0 - abs(math.log(ratio / middle)) / math.log(hi / middle),
        evidence={
            **_fit_evidence(fit),
            "predicted_residual_bound": rho_bound,
            "residual_over_bound": ratio,
            "zero_share": share,
            "new_zero_share": new,
        },
    )


def _pruning_residual(A: torch.Tensor, B: torch.Tensor, scale: float) -> float:
    """Expected ‖dW_parent - dW_pruned‖² if every zero of A and B held an entry of magnitude t (its tensor's
    smallest kept one), of random sign: Σ_zeros(B_ik) t_B²‖A_k‖² + Σ_zeros(A_kj) t_A²‖B_:k‖² (times scale²). Entries
    spread evenly within ±t give a third of it; a Gaussian's smallest half about 0.3. (The zeros training left,
    a few percent of the entries, count too: well inside PRUNE_RATIO_BAND.)"""
    total = 0.0
    for X, other, axis in ((B, A, 1), (A, B, 0)):  # zeros of B pair with the rows of A, zeros of A with the columns of B
        zero = X == 0
        if not bool(zero.any()) or bool(zero.all()):
            continue
        t = float(X.abs()[~zero].min())
        weights = (other**2).sum(dim=axis)  # ‖A_k‖² per rank component k (or ‖B_:k‖²)
        counts = zero.sum(dim=0) if axis == 1 else zero.sum(dim=1)  # zeros per component
        total += t * t * float((counts.double() * weights).sum())
    return total * scale * scale
