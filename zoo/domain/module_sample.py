"""Which modules of a large update the relation detectors compare: a fixed sample of its modules, as many as fit a
budget of bytes.

Every relation the detectors find holds in every module at once: a copy, a cast or a rescale is one in each module,
a merge is one combination with weights shared by all modules, and a continuation keeps A's rows in each. So a
sample of the modules tells what the whole would, to the statistics' spread over modules, and costs what it reads:
at Llama-3-8B's full size an adapter's modules in the detectors' float64 take 340 MB, and comparing one with 20
neighbours whole read and multiplied 7 GB. The sample is a fixed order of the module names (a hash of each name, so
that every module kind and layer is drawn, not every 7th module's kind) cut where the budget is spent; updates of one
structure and ranks are sampled alike, and a candidate is compared on the query's sample.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from zoo.domain.canonical import CanonicalFactors

#: bytes a float64 entry of the detectors' modules takes, twice: `zoo.services.relations.detector_bytes` counts the
#: modules and what the detectors make of them
ENTRY_BYTES = 16


def module_bytes(f: CanonicalFactors) -> int:
    """One module's bytes in the detectors' float64 (U, S and V, counted twice as `detector_bytes` counts them)."""
    return ENTRY_BYTES * (int(f.U.shape[0]) + int(f.V.shape[0]) + 1) * f.rank


def sample_modules(factors: Mapping[str, CanonicalFactors], budget: int) -> tuple[str, ...] | None:
    """The names of the non-zero modules compared, in name order: None where all of them fit `budget` bytes (the
    update is compared whole); else those first in the names' hash order that fit it (at least one)."""
    cost = {n: module_bytes(f) for n, f in factors.items() if f.rank}
    if sum(cost.values()) <= budget:
        return None
    chosen: list[str] = []
    held = 0
    for name in sorted(cost, key=_order):
        if not chosen or held + cost[name] <= budget:
            chosen.append(name)
            held += cost[name]
    return tuple(sorted(chosen))


def _order(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=8).digest()
