"""The sample of modules the relation detectors compare a large update on (zoo/domain/module_sample.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.domain.canonical import CanonicalFactors
from zoo.domain.module_sample import module_bytes, sample_modules
from zoo.domain.transforms import FactorSummary, Update, same_structure


def _factors(shapes: list[tuple[int, int, int]], seed: int) -> dict[str, CanonicalFactors]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, (rows, cols, rank) in enumerate(shapes):
        U = torch.linalg.qr(torch.randn(rows, max(rank, 1), generator=gen))[0][:, :rank]
        V = torch.linalg.qr(torch.randn(cols, max(rank, 1), generator=gen))[0][:, :rank]
        S = torch.sort(torch.rand(rank, generator=gen) + 0.1, descending=True).values
        out[f"layers.{k}.proj"] = CanonicalFactors(U, S, V)
    return out


SHAPES = st.lists(st.tuples(st.integers(2, 40), st.integers(2, 40), st.integers(0, 2)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shapes=SHAPES, budget=st.integers(0, 20_000), seeds=st.tuples(st.integers(0, 99), st.integers(0, 99)))
def test_the_sample_fits_the_budget_and_depends_on_the_structure_alone(
    shapes: list[tuple[int, int, int]], budget: int, seeds: tuple[int, int]
) -> None:
    """None where every non-zero module fits; else non-zero modules within the budget (or the first one alone), the
    same for two updates of one structure and ranks whatever their values."""
    one, other = _factors(shapes, seeds[0]), _factors(shapes, seeds[1])
    live = {n: module_bytes(f) for n, f in one.items() if f.rank}
    names = sample_modules(one, budget)
    assert names == sample_modules(other, budget)
    if sum(live.values()) <= budget:
        assert names is None
        return
    assert names and set(names) <= set(live) and list(names) == sorted(names)
    assert len(names) == 1 or sum(live[n] for n in names) <= budget
    left = [n for n in live if n not in names]
    assert all(sum(live[n] for n in names) + live[n] > budget for n in left)  # none left out that would still fit


def test_a_sample_keeps_the_whole_structure_and_scales_the_pruning_bound() -> None:
    """A sampled update compares as its whole's structure (a candidate of another structure is still told apart), and
    its summary's pruning bound is the whole's times the sample's share of Σ S²."""
    factors = _factors([(8, 6, 2), (8, 6, 2), (5, 4, 1)], 0)
    whole = Update(factors, FactorSummary(frozenset(), 10, 100, 4.0))
    names = ("layers.0.proj",)
    part = whole.sampled(names)
    assert list(part.factors) == list(names) and part.whole_modules == 3 and whole.whole_modules is None
    assert same_structure(part, whole) and same_structure(part, whole.sampled(("layers.1.proj",)))
    assert not same_structure(part, Update({n: factors[n] for n in names}))
    energy = {n: float((f.S.double() ** 2).sum()) for n, f in factors.items()}
    assert part.summary is not None
    assert part.summary.pruning_residual_sq == 4.0 * energy["layers.0.proj"] / sum(energy.values())
    given = whole.sampled(names, energy=2 * sum(energy.values()))  # the whole's energy as stored, where known
    assert given.summary is not None and given.summary.pruning_residual_sq == pytest.approx(part.summary.pruning_residual_sq / 2)
    assert (part.summary.zeros, part.summary.entries) == (10, 100)
