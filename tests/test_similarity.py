"""Module cosine (zoo/domain/similarity.py) against materialized dW, and its invariance."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embed.training.evaluate import refactorized
from tests.test_embed import synthetic_zoo
from zoo.domain.canonical import canonicalize
from zoo.domain.methods import SearchScore
from zoo.domain.similarity import ModuleStack, dense_modules, module_cosine_matrix, module_presence

# small modules are compared as dense dW, large ones (o, always) through their factors
SHAPES = {"q": (12, 10), "v": (12, 10), "fc": (16, 12), "o": (40, 30)}


def random_adapter(gen: torch.Generator, modules: tuple[str, ...]) -> dict:
    out = {}
    for name in modules:
        o, i = SHAPES[name]
        r = int(torch.randint(1, 5, (1,), generator=gen))
        scale = float(torch.rand(1, generator=gen) * 3)
        out[name] = canonicalize(torch.randn(r, i, generator=gen), torch.randn(o, r, generator=gen) * scale)
    return out


def dense_module_cosine(x: dict, y: dict) -> float:
    """The reference: per-module cosine of materialized dW, averaged over shared modules."""
    shared = sorted(set(x) & set(y))
    if not shared:
        return 0.0
    cos = []
    for name in shared:
        a = ((x[name].U * x[name].S) @ x[name].V.T).double().flatten()
        b = ((y[name].U * y[name].S) @ y[name].V.T).double().flatten()
        cos.append(float(a @ b / (a.norm() * b.norm())))
    return float(np.mean(cos))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_module_cosine_matches_dense_dw(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sets = [("q", "v", "o"), ("fc",), ("q", "v", "fc", "o"), ("v",)]
    adapters = [random_adapter(gen, sets[int(torch.randint(0, 4, (1,), generator=gen))]) for _ in range(5)]
    got = module_cosine_matrix(adapters[:2], adapters)
    want = np.array([[dense_module_cosine(q, g) for g in adapters] for q in adapters[:2]])
    assert np.allclose(got, want, atol=1e-5)
    dense = dense_modules(adapters)
    stack = ModuleStack.of(adapters, dense)
    assert stack.dense.keys() | stack.factors.keys() == stack.norms.keys() and "o" not in stack.dense
    assert np.allclose(stack.cosines(ModuleStack.of(adapters[1::-1], dense)), want[::-1], atol=1e-5)
    # rows taken, and stacks concatenated (padded to a common rank), score as the adapters themselves
    parts = ModuleStack.concat([stack.take([4, 2]), ModuleStack.of(adapters[:2], dense)])
    assert np.allclose(parts.cosines(stack.take([0, 1])), want[:, [4, 2, 0, 1]], atol=1e-5)
    assert np.allclose(np.diag(got), [1.0 if q else 0.0 for q in adapters[:2]], atol=1e-5)


def test_module_cosine_is_factorization_invariant() -> None:
    zoo = synthetic_zoo(n_per_task=3, tasks=2)
    again = [refactorized(a, seed=i) for i, a in enumerate(zoo)]
    first = module_cosine_matrix([a.factors for a in zoo], [a.factors for a in zoo])
    second = module_cosine_matrix([a.factors for a in again], [a.factors for a in zoo])
    assert np.abs(first - second).max() < 1e-4


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 6), modules=st.integers(1, 12), width=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_module_presence_marks_exactly_the_blocks_not_all_zero(n: int, modules: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, modules, width)).astype(np.float32)
    absent = rng.random((n, modules)) < 0.4
    x[absent] = 0.0
    one = rng.integers(0, width)
    x[~absent, one] = np.where(rng.random(int((~absent).sum())) < 0.5, -1e-30, 1e-30)  # a block with one tiny value is present
    x[~absent] = np.where(np.arange(width) == one, x[~absent], 0.0)
    assert np.array_equal(module_presence(x.reshape(n, -1), modules), (~absent).astype(np.float32))


def test_a_module_store_written_before_the_derived_file_format_is_read_and_a_damaged_one_is_not(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A module store from the previous version (version and dense modules as plain metadata, no checksum) keeps
    exact re-ranking after an upgrade; one written now is checked, and a flipped byte makes it absent (rebuilt)."""
    import json

    from safetensors.numpy import save_file

    from embed.serving.module_store import read_module_store, write_module_store

    gen = torch.Generator().manual_seed(3)
    adapters = [random_adapter(gen, ("q", "o")) for _ in range(3)]
    stack = ModuleStack.of(adapters, dense_modules(adapters))
    ids = np.array([5, 7, 9], np.int64)
    old = tmp_path / "old.safetensors"
    tensors = {**{k: np.ascontiguousarray(v) for k, v in stack.arrays().items()}, "ids": ids}
    save_file(tensors, str(old), metadata={"version": "4", "dense": json.dumps(sorted(stack.dense))})
    got = read_module_store(old)
    assert got is not None and got[0].tolist() == [5, 7, 9] and got[2] == set(stack.dense) and got[3] == 4
    assert np.allclose(got[1].cosines(stack.take([0])), stack.cosines(stack.take([0])))
    new = tmp_path / "new.safetensors"
    write_module_store(new, ids, stack, 6)
    assert read_module_store(new) is not None and read_module_store(new)[3] == 6  # type: ignore[index]
    raw = bytearray(new.read_bytes())
    raw[-5] ^= 0xFF
    new.write_bytes(bytes(raw))
    assert read_module_store(new) is None


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 30),
    top=st.integers(2, 12),
    exclude=st.floats(0, 0.5),
    weights=st.tuples(st.sampled_from((0.5, 0.7, 0.9)), st.sampled_from((0.0, 0.1, 0.3))),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_second_stage_reorders_exactly_the_first_stages_top(
    rows: int, cols: int, top: int, exclude: float, weights: tuple[float, float], seed: int
) -> None:
    """SearchScore.ranking with a second stage: per row, the `top` best by the first mix (never an excluded item) come
    first in the order of the second mix, then every other allowed item in the first mix's order; excluded items
    are never ranked among the allowed."""
    rng = np.random.default_rng(seed)
    exact, w2t = rng.uniform(-1, 1, (rows, cols)), rng.uniform(-1, 1, (rows, cols))
    excluded = rng.random((rows, cols)) < exclude
    score = SearchScore("module", weights[0], weights[1], top)
    keys = score.ranking(exact, w2t, excluded)
    first, second = (1 - weights[0]) * exact + weights[0] * w2t, (1 - weights[1]) * exact + weights[1] * w2t
    for r in range(rows):
        allowed = [c for c in range(cols) if not excluded[r, c]]
        by_first = sorted(allowed, key=lambda c: -first[r, c])
        expected = sorted(by_first[:top], key=lambda c: -second[r, c]) + by_first[top:]
        assert np.argsort(-keys[r], kind="stable")[: len(allowed)].tolist() == expected
        assert np.isneginf(keys[r][excluded[r]]).all()
    # without a second stage the keys are the first mix itself
    assert np.allclose(SearchScore("module", weights[0]).ranking(exact, w2t), first)
