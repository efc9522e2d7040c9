"""The factorwise merge fit's screen (zoo/domain/factorwise.py): every candidate set is fitted on a few entries first,
and only the sets that come near there are fitted on all the screen's entries, without losing a merge's parents."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel

from tests.factories import peft_merge_model, peft_update
from zoo.domain.canonical import canonicalize
from zoo.domain.factorwise import SCREEN_ENTRIES, SCREEN_KEPT, RawModule, fit_factorwise, positions, sampled, screen
from zoo.domain.merges import detect_merge

OUT, IN, RANK = 512, 512, 8


def raw_module(A: torch.Tensor, B: torch.Tensor) -> RawModule:
    """The module as the fit reads a stored adapter's: canonical factors and their gauge, in float64."""
    f = canonicalize(A, B, 1.0)
    assert f.gauge is not None
    M, N = f.gauge
    return RawModule(*(t.double().numpy() for t in (f.U, f.S, f.V, M, N)))


def siblings(seed: int, count: int, jitter: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of `count` adapters that share half their rank, each copy jittered, rounded through bf16 as a
    half-precision file stores them (`bench.realsize`'s families)."""
    g = torch.Generator().manual_seed(seed)
    shared_a, shared_b = torch.randn(RANK // 2, IN, generator=g), torch.randn(OUT, RANK // 2, generator=g)
    out = []
    for _ in range(count):
        A, B = torch.randn(RANK, IN, generator=g), torch.randn(OUT, RANK, generator=g)
        A[: RANK // 2] = shared_a + jitter * torch.randn(RANK // 2, IN, generator=g)
        B[:, : RANK // 2] = shared_b + jitter * torch.randn(OUT, RANK // 2, generator=g)
        out.append((A.to(torch.bfloat16).float() / IN**0.5, B.to(torch.bfloat16).float() / OUT**0.5))
    return out


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), jitter=st.floats(0.02, 0.3))
def test_of_siblings_only_the_sets_near_on_a_few_entries_are_fitted_on_all(seed: int, jitter: float) -> None:
    """No pair of a query's siblings fits it (their own halves differ), which a few entries tell: at most SCREEN_KEPT
    pairs are fitted on all the screen's entries, and no merge is found."""
    family = siblings(seed, 8, jitter)
    where = positions({"m": (OUT, IN, RANK)})
    values = [sampled({"m": raw_module(A, B)}, where)[0] for A, B in family]
    y, X = values[0], np.stack(values[1:], axis=1)
    part = slice(0, None, len(y) // SCREEN_ENTRIES)
    assert len(screen(y[part], X[part], list(itertools.combinations(range(X.shape[1]), 2)))) <= SCREEN_KEPT
    assert fit_factorwise({"m": raw_module(*family[0])}, [{"m": raw_module(*f)} for f in family[1:]]) is None


@pytest.fixture(scope="module")
def peft_model() -> PeftModel:
    return peft_merge_model(64, 128, 96, 8)


@settings(max_examples=25, deadline=None)
@given(
    combination=st.sampled_from(["ties", "dare_linear", "dare_ties", "magnitude_prune"]),
    density=st.floats(0.3, 0.9),
    parents=st.lists(st.integers(0, 7), min_size=2, max_size=3, unique=True),
    data=st.data(),
)
def test_peft_factorwise_merges_keep_their_parents_through_the_screen(
    peft_model: PeftModel,
    combination: str,
    density: float,
    parents: list[int],
    data: st.DataObject,
) -> None:
    """PEFT's pruning merges of 2-3 of 8 adapters, at any density and weights: the parents and the combination found."""
    weights = [data.draw(st.floats(0.2, 1.0)) for _ in parents]
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))  # dare's draws
    peft_model.add_weighted_adapter([f"a{i}" for i in parents], weights, "merged", combination_type=combination, density=density)
    try:
        query = peft_update(peft_model, "merged", with_gauges=True)
        merge = detect_merge(query, [peft_update(peft_model, f"a{i}", i, with_gauges=True) for i in range(8)])
    finally:
        peft_model.delete_adapter("merged")
    assert merge is not None and set(merge.parents) == set(parents) and merge.combination == combination, merge
