"""The merge test's stacked Grams as the relation step makes them (zoo/domain/lowrank.py): assembled from the blocks
each pair of updates keeps, batched over the modules of one rank, they give what the dense matrices give; the kept
blocks go with their updates; and the merge test, which works out the svd hypothesis's residual only where that
hypothesis can be chosen, still finds exact svd merges with their parents and weights."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.domain.canonical import canonicalize
from zoo.domain.lowrank import LowRank, Stacks, blocks, inner
from zoo.domain.merges import EXACT_RTOL, detect_merge
from zoo.domain.transforms import Update

#: (out, in) of the modules; small, so that the dense matrices are the reference
SHAPES = {"a": (12, 10), "b": (9, 14), "c": (16, 8)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def low_rank(rng: np.random.Generator, shape: tuple[int, int], rank: int) -> LowRank:
    U = np.linalg.qr(rng.normal(size=(shape[0], rank)))[0] if rank else np.zeros((shape[0], 0))
    V = np.linalg.qr(rng.normal(size=(shape[1], rank)))[0] if rank else np.zeros((shape[1], 0))
    return LowRank(U, np.sort(rng.uniform(0.1, 2.0, size=rank))[::-1], V)


def dense(x: LowRank) -> np.ndarray:
    return (x.U * x.S) @ x.V.T


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 6), st.booleans(), st.data())
def test_stacks_give_what_the_dense_matrices_give(seed: int, count: int, from_pairs: bool, data: st.DataObject) -> None:
    """Members of any ranks (0 for a module a candidate lacks, so that modules fall in several groups), whether the
    Grams come from the kept pair blocks or are made at once: inner products, the svd fit's projections and its
    truncated sums as the dense matrices have them."""
    rng = np.random.default_rng(seed)
    ranks = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=len(SHAPES), max_size=len(SHAPES)), min_size=count, max_size=count))
    ranks[0] = [max(r, 1) for r in ranks[0]]  # the query has every module
    members = [{n: low_rank(rng, shape, r) for (n, shape), r in zip(SHAPES.items(), rs, strict=True)} for rs in ranks]
    if data.draw(st.booleans()):  # some pairs' blocks made before, as the transform test leaves them
        inner(members[0]["a"], members[1]["a"])
    stacks = Stacks(members, list(SHAPES), from_pairs=from_pairs)
    truth = np.array([[sum(float((dense(x[n]) * dense(y[n])).sum()) for n in SHAPES) for y in members] for x in members])
    np.testing.assert_allclose(stacks.gram(list(range(count))), truth, rtol=1e-10, atol=1e-12)
    truth_by_module = {n: np.array([[float((dense(x[n]) * dense(y[n])).sum()) for y in members] for x in members]) for n in SHAPES}
    others = list(range(1, count))
    weights = rng.uniform(0.1, 1.0, size=len(others))
    mk = cross = 0.0
    names = iter(stacks.names)  # the groups' modules, in order
    for g in stacks.groups:
        projections = g.projections(0, others)
        for k in range(len(g.shapes)):
            name = next(names)
            q = members[0][name]
            np.testing.assert_allclose(g.module(k).gram(list(range(count))), truth_by_module[name], rtol=1e-10, atol=1e-12)
            expected = np.stack([q.U.T @ dense(members[i][name]) @ q.V for i in others], axis=-1)
            np.testing.assert_allclose(projections[k], expected, rtol=1e-10, atol=1e-12)
            M = sum(w * dense(members[i][name]) for w, i in zip(weights, others, strict=True))
            X, sigma, Yt = np.linalg.svd(M)
            top = (X[:, : q.rank] * sigma[: q.rank]) @ Yt[: q.rank]
            mk, cross = mk + float((top**2).sum()), cross + float((top * dense(q)).sum())
    sums = np.sum([g.truncated_sums(0, others, weights) for g in stacks.groups], axis=0)
    np.testing.assert_allclose(sums, [mk, cross], rtol=1e-9, atol=1e-12)


def test_kept_blocks_go_with_their_updates() -> None:
    """A pair's blocks are kept on both updates while both live, and dropped from the one left when the other goes (no
    growth over a step's thousands of pairs, and no blocks served for another update that takes the same id)."""
    rng = np.random.default_rng(0)
    x, y = low_rank(rng, (12, 10), 3), low_rank(rng, (12, 10), 2)
    first = blocks(x, y)
    assert blocks(x, y)[0] is first[0] and np.shares_memory(blocks(y, x)[0], first[0])
    Stacks([{"a": x}, {"a": y}], ["a"], from_pairs=True)
    assert x.kept_inners and x.kept_groups
    del y, first
    gc.collect()
    assert not x.kept_inners and not x.kept_groups
    z = low_rank(rng, (12, 10), 2)
    np.testing.assert_allclose(blocks(x, z)[0], x.U.T @ z.U)


def svd_merge(parents: list[Update], weights: list[float]) -> Update:
    """top-r(Σ w_i dW_i) per module, r the largest parent rank there (what PEFT's `svd` combination writes)."""
    out = {}
    for n in parents[0].factors:
        M = sum(w * (p.factors[n].U * p.factors[n].S) @ p.factors[n].V.T for p, w in zip(parents, weights, strict=True))
        r = max(p.factors[n].rank for p in parents)
        X, sigma, Yt = torch.linalg.svd(M.double())
        out[n] = canonicalize((sigma[:r, None] * Yt[:r]).float(), X[:, :r].float())
    return Update(out)


def random_update(seed: int, id: int) -> Update:
    g = torch.Generator().manual_seed(seed)
    ranks = {"a": 3, "b": 2, "c": 3}
    return Update(
        {n: canonicalize(torch.randn(ranks[n], i, generator=g), torch.randn(o, ranks[n], generator=g)) for n, (o, i) in SHAPES.items()},
        None,
        id,
    )


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.floats(0.3, 1.0), min_size=2, max_size=3), st.data())
def test_an_exact_svd_merge_is_found_with_its_residual(seed: int, weights: list[float], data: st.DataObject) -> None:
    """The svd hypothesis's residual is made only where it can be chosen: an exact svd merge of 2-3 of eight candidates
    is found as `svd`, exact, with its parents and weights."""
    candidates = [random_update(seed + i, 100 + i) for i in range(8)]
    chosen = data.draw(st.lists(st.integers(0, 7), min_size=len(weights), max_size=len(weights), unique=True))
    merge = detect_merge(svd_merge([candidates[i] for i in chosen], weights), candidates)
    assert merge is not None, "an exact svd merge was not found"
    assert merge.evidence["svd_residual"] <= EXACT_RTOL
    if merge.combination == "svd":  # a sum that holds as well is told first (the simplest)
        found = dict(zip(merge.parents, merge.weights, strict=True))
        assert set(found) == {100 + i for i in chosen}
        for i, w in zip(chosen, weights, strict=True):
            assert found[100 + i] == pytest.approx(w, rel=1e-3)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(64, 4), (4096, 16), (5000, 17), (2048, 32)]))
def test_pair_blocks_of_large_factors_are_their_products(seed: int, size: tuple[int, int]) -> None:
    """A pair's blocks are UᵀU and VᵀV to float64 rounding, and their inner product the dense matrices', whichever
    library takes the product (zoo/domain/products.py: from MEASURED_FROM entries a factor, all but the first size here,
    the faster here)."""
    rows, rank = size
    rng = np.random.default_rng(seed)
    x, y = (LowRank(rng.normal(size=(rows, rank)), rng.uniform(0.1, 2.0, size=rank), rng.normal(size=(40, rank))) for _ in range(2))
    UU, VV = blocks(x, y)
    np.testing.assert_allclose(UU, x.U.T @ y.U, rtol=1e-12, atol=1e-12 * np.abs(x.U).max() * np.abs(y.U).max() * rows)
    np.testing.assert_allclose(VV, x.V.T @ y.V, rtol=1e-12, atol=1e-9)
    expected = float(np.sum(dense(x) * dense(y)))
    assert inner(x, y) == pytest.approx(expected, rel=1e-10, abs=1e-10 * np.linalg.norm(dense(x)) * np.linalg.norm(dense(y)))
