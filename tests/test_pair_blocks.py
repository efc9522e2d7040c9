"""Pair blocks kept past their updates (zoo/domain/pair_blocks.py): the relation step's stored adapters leave its cache
and come back, and the blocks of their modules' pairs are kept by adapter id, so that what the detectors find with
adapters read again is what they found the first time, and no pair's blocks are made twice; the store keeps at most
its budget, the least recently used pairs dropped first."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.lowrank import blocks
from zoo.domain.pair_blocks import PairBlocks
from zoo.domain.relations import Relations, find_relations
from zoo.domain.transforms import Update

SHAPES = {"q": (24, 20), "v": (24, 20), "fc": (32, 20)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def factors(seed: int, rank: int = 3) -> dict[str, CanonicalFactors]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: canonicalize(torch.randn(rank, i, generator=g) / i**0.5, 0.05 * torch.randn(o, rank, generator=g))
        for n, (o, i) in SHAPES.items()
    }


def merged(parents: list[dict[str, CanonicalFactors]], weights: list[float]) -> dict[str, CanonicalFactors]:
    """Σ w_i dW_i with the parents' factors concatenated (PEFT's `cat`)."""
    out = {}
    for n in SHAPES:
        fs = [p[n] for p in parents]
        V = torch.cat([w * f.S[:, None] * f.V.T for f, w in zip(fs, weights, strict=True)])
        out[n] = canonicalize(V, torch.cat([f.U for f in fs], dim=1))
    return out


def lineage() -> dict[int, dict[str, CanonicalFactors]]:
    """Stored adapters by id: three roots, a rescaled copy of one, a merge of two, a root trained further."""
    roots = {i: factors(i) for i in (1, 2, 3)}
    copy = {n: CanonicalFactors(f.U, 1.7 * f.S, f.V) for n, f in roots[1].items()}
    later = {n: CanonicalFactors(f.U, f.S * torch.linspace(1.4, 1.1, f.rank), f.V) for n, f in roots[3].items()}
    return {**roots, 4: copy, 5: merged([roots[1], roots[2]], [0.6, 0.8]), 6: later}


def scan(stored: dict[int, dict[str, CanonicalFactors]], pairs: PairBlocks | None) -> dict[int, Relations]:
    """Each adapter's relations to all the others, every adapter read anew (as after the step's cache dropped it)."""
    updates = {i: Update(f, None, i, pairs=pairs) for i, f in stored.items()}
    return {i: find_relations(u, [updates[j] for j in stored if j != i]) for i, u in updates.items()}


def test_relations_found_with_kept_blocks_are_those_found_the_first_time() -> None:
    """Found again from the store's blocks with every update read anew: the same relations, to the last bit, and no
    pair's blocks made again; the same relations, to rounding, as without a store."""
    stored, store = lineage(), PairBlocks(1 << 30)
    first = scan(stored, store)
    assert first[4].transforms and first[5].merge is not None  # there is something to find
    held, pairs = store.held, len(store.pairs)
    gc.collect()  # the first scan's updates are gone: their own kept blocks with them
    assert scan(stored, store) == first
    assert (store.held, len(store.pairs)) == (held, pairs)
    plain = scan(stored, None)
    for i, found in first.items():
        assert [(e.relation, e.parent, e.child) for e in plain[i].transforms] == [(e.relation, e.parent, e.child) for e in found.transforms]
        assert (plain[i].merge is None) == (found.merge is None)
        if found.merge is not None and plain[i].merge is not None:
            assert plain[i].merge.parents == found.merge.parents
            assert plain[i].merge.weights == pytest.approx(found.merge.weights, rel=1e-9)


def test_kept_blocks_are_the_products_either_way_round() -> None:
    """A module's blocks with another, read from the store after both updates went, are its products with it, and the
    other's with it their transposes; a module's own blocks likewise."""
    stored, store = lineage(), PairBlocks(1 << 30)
    x, y = (Update(stored[i], None, i, pairs=store).modules()["fc"] for i in (2, 5))
    want = (x.U.T @ y.U, x.V.T @ y.V)
    blocks(x, y), x.self_blocks  # noqa: B018 - made, and kept in the store
    del x, y
    gc.collect()
    x, y = (Update(stored[i], None, i, pairs=store).modules()["fc"] for i in (2, 5))
    held = store.held
    np.testing.assert_array_equal(blocks(x, y)[0], want[0])
    np.testing.assert_array_equal(blocks(y, x)[1], want[1].T)
    np.testing.assert_array_equal(x.self_blocks[0], x.U.T @ x.U)
    assert store.held == held


def test_the_store_keeps_its_budget_dropping_the_least_recently_used_pairs() -> None:
    stored = lineage()
    one_pair = 2 * 3 * 3 * 8 * len(SHAPES)  # U and V blocks of rank-3 modules, float64
    store = PairBlocks(3 * one_pair)
    updates = {i: Update(stored[i], None, i, pairs=store) for i in (1, 2, 3, 6)}

    def pair(i: int, j: int) -> None:
        for n in SHAPES:
            blocks(updates[i].modules()[n], updates[j].modules()[n])

    pair(1, 2), pair(1, 3), pair(2, 3)
    store.used([2, 1])  # read again by the step: (1, 3) is now the least recent
    pair(3, 6)
    assert store.held <= store.budget
    assert set(store.pairs) == {(1, 2), (2, 3), (3, 6)}
