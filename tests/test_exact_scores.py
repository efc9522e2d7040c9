"""The exact scores (zoo/domain/exact_scores.py) on stacks of any layout: the input Gram cosine against its
channel and materialized dW, its invariance to the output side, and the dense layout it needs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, fit_gram_reference
from zoo.domain.channels import channel_matrices, channel_similarity_matrix, factor_stack
from zoo.domain.exact_scores import EXACT_SCORES, exact_cosines, exact_matrices
from zoo.domain.similarity import ModuleStack, dense_modules

# (out, in): q and v (d = 8, rank 2 to 4) are stored dense, o always as factors
SHAPES = {"q": (8, 8), "v": (8, 8), "o": (24, 20)}
seeds = st.integers(0, 2**31 - 1)
Adapter = dict[str, CanonicalFactors]


def random_adapters(seed: int, n: int = 5) -> list[Adapter]:
    """n adapters on random non-empty subsets of SHAPES' modules, rank 2 to 4."""
    rng = np.random.default_rng(seed)
    adapters = []
    for _ in range(n):
        names = [m for m in SHAPES if rng.random() < 0.7] or [str(rng.choice(list(SHAPES)))]
        adapters.append({m: _module(rng, *SHAPES[m], int(rng.integers(2, 5))) for m in names})
    return adapters


def _module(rng: np.random.Generator, out: int, inp: int, r: int) -> CanonicalFactors:
    A, B = rng.standard_normal((r, inp)), rng.standard_normal((out, r)) * rng.uniform(0.1, 3.0)
    return canonicalize(torch.from_numpy(A), torch.from_numpy(B))


def stack_of(adapters: list[Adapter]) -> ModuleStack:
    return ModuleStack.of(adapters, dense_modules(adapters))


def dense_input_gram(x: Adapter, y: Adapter) -> float:
    """The reference: the cosine of the materialized input Grams dWᵀdW, averaged over shared modules."""
    values = []
    for name in sorted(x.keys() & y.keys()):
        A, B = x[name].delta().double().numpy(), y[name].delta().double().numpy()
        Ga, Gb = A.T @ A, B.T @ B
        values.append(float((Ga * Gb).sum() / (np.linalg.norm(Ga) * np.linalg.norm(Gb))))
    return float(np.mean(values)) if values else 0.0


def output_rotated(adapters: list[Adapter], seed: int) -> list[Adapter]:
    """Each module's dW → Q·dW for its own random orthogonal Q (a re-seeded head, say)."""
    rng = np.random.default_rng(seed)
    out = []
    for a in adapters:
        rotated = {}
        for name, f in a.items():
            Q = np.linalg.qr(rng.standard_normal((f.U.shape[0],) * 2))[0]
            rotated[name] = CanonicalFactors(torch.from_numpy(Q).to(f.U.dtype) @ f.U, f.S, f.V)
        out.append(rotated)
    return out


@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_input_gram_equals_its_channel_and_its_dense_computation(seed: int) -> None:
    adapters = random_adapters(seed)
    stack = stack_of(adapters)
    assert set(stack.dense) == {"q", "v"} & set(stack.norms) and "o" not in stack.dense
    got = exact_cosines(stack, stack, "input_gram")
    want = np.array([[dense_input_gram(q, g) for g in adapters] for q in adapters])
    assert np.allclose(got, want, atol=1e-5)
    channel = channel_similarity_matrix(adapters, adapters, "input_gram")
    assert np.allclose(exact_cosines(factor_stack(adapters), factor_stack(adapters), "input_gram"), channel, atol=1e-6)
    assert np.allclose(got, channel, atol=1e-5)
    # queries against a gallery: rows are the queries, in their order
    assert np.allclose(exact_cosines(stack, stack.take([3, 0]), "input_gram"), want[[3, 0]], atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, rotation=seeds)
def test_input_gram_is_symmetric_bounded_and_blind_to_output_rotations(seed: int, rotation: int) -> None:
    adapters = random_adapters(seed)
    got = exact_cosines(stack_of(adapters), stack_of(adapters), "input_gram")
    assert np.allclose(got, got.T, atol=1e-6)
    assert got.min() >= -1e-6 and got.max() <= 1 + 1e-6
    assert np.allclose(np.diag(got), 1.0, atol=1e-5)
    rotated = output_rotated(adapters, rotation)
    both = adapters + rotated
    again = exact_cosines(stack_of(both), stack_of(both), "input_gram")
    assert np.allclose(again[:5, 5:], got, atol=1e-5) and np.allclose(again[5:, 5:], got, atol=1e-5)
    first_order = exact_cosines(stack_of(both), stack_of(both), "module")
    assert not np.allclose(first_order[:5, 5:], first_order[:5, :5], atol=1e-3)  # which module cosine does see


@settings(max_examples=30, deadline=None)
@given(seed=seeds, n=st.integers(1, 5))
def test_one_pass_gives_each_score_as_its_own_computation_does_to_the_bit(seed: int, n: int) -> None:
    """dW, module, input Gram and centred input Gram cosines from one pass over the modules' blocks equal each score
    computed alone (ModuleStack's own cosines, the input Gram channel), dense and factored modules alike."""
    adapters = random_adapters(seed, 6)
    stack = stack_of(adapters)
    queries = stack.take(np.arange(n)[::-1])
    reference = fit_gram_reference(stack, range(4))
    together = exact_matrices(stack, queries, (*EXACT_SCORES, CENTRED_GRAM, MODULE_CENTRED), reference)
    np.testing.assert_array_equal(together["dw"], stack.dw_cosines(queries))
    np.testing.assert_array_equal(together["module"], stack.cosines(queries))
    np.testing.assert_array_equal(together["input_gram"], channel_matrices(stack, queries, ("input_gram",))["input_gram"])
    np.testing.assert_array_equal(together[CENTRED_GRAM], exact_matrices(stack, queries, (CENTRED_GRAM,), reference)[CENTRED_GRAM])
    np.testing.assert_array_equal(together[MODULE_CENTRED], (together["module"] + together[CENTRED_GRAM]) / 2)
    assert list(together) == [*EXACT_SCORES, CENTRED_GRAM, MODULE_CENTRED]
    with pytest.raises(ValueError, match="need the reference"):
        exact_matrices(stack, queries, (CENTRED_GRAM,))


def test_every_exact_score_is_served_and_no_other() -> None:
    adapters = random_adapters(1)
    stack = stack_of(adapters)
    scores = {s: exact_cosines(stack, stack, s) for s in EXACT_SCORES}
    assert EXACT_SCORES == ("dw", "module", "input_gram")
    assert all(v.shape == (5, 5) for v in scores.values())
    assert not np.allclose(scores["input_gram"], scores["module"], atol=1e-3)
    with pytest.raises(ValueError, match="unknown exact score"):
        exact_cosines(stack, stack, "output_gram")


def test_a_stack_whose_dense_modules_are_flattened_is_refused_and_its_module_store_absent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Dense modules keep their (out, in) shape, which the input Gram needs: a store written before, with them
    flattened, reads as absent (rebuilt by `zoo embed`)."""
    from embed.serving.module_store import read_module_store, write_module_store

    adapters = random_adapters(2, 3)
    stack = stack_of(adapters)
    assert all(v.shape[1:] == (8, 8) for v in stack.dense.values()) and stack.dense
    arrays = stack.arrays()
    assert ModuleStack.from_arrays(arrays, 3).dense.keys() == stack.dense.keys()
    flat = {k: v.reshape(len(v), -1) if k.startswith("dense/") else v for k, v in arrays.items()}
    with pytest.raises(ValueError, match="flattened"):
        ModuleStack.from_arrays(flat, 3)
    write_module_store(tmp_path / "new.safetensors", np.arange(3), stack, 1)
    old = ModuleStack(3, stack.norms, {k: v.reshape(3, -1) for k, v in stack.dense.items()}, stack.factors)
    write_module_store(tmp_path / "old.safetensors", np.arange(3), old, 1)
    assert read_module_store(tmp_path / "new.safetensors") is not None
    assert read_module_store(tmp_path / "old.safetensors") is None


@settings(max_examples=30, deadline=None)
@given(seed=seeds, scale=st.floats(0.01, 100.0))
def test_an_update_size_is_one_number_from_its_factors_and_from_a_stack(seed: int, scale: float) -> None:
    """The size a query is served with (from its factors) equals the one its stack row gives the training choices (to a
    sum's rounding); it is log Σ‖dWₘ‖²_F, so scaling every module by c adds 2 log c."""
    from embed.data.dataset import ExactScores
    from embed.data.types import ZooAdapter
    from zoo.domain.sizes import factors_size

    adapters = random_adapters(seed, 4)
    scores = ExactScores.of_factors([ZooAdapter(i, f"a{i}", a) for i, a in enumerate(adapters)], bank=False)
    given_sizes = scores.profiles_among([0, 1, 2, 3])[:, 0]
    np.testing.assert_allclose(given_sizes, [factors_size(f.S for f in a.values()) for a in adapters], rtol=1e-12)
    dense = [sum(float(((f.U * f.S) @ f.V.T).double().square().sum()) for f in a.values()) for a in adapters]
    np.testing.assert_allclose(given_sizes, np.log(dense), rtol=1e-6)
    scaled = [{m: CanonicalFactors(f.U, f.S * scale, f.V) for m, f in a.items()} for a in adapters]
    np.testing.assert_allclose([factors_size(f.S for f in a.values()) for a in scaled], given_sizes + 2 * np.log(scale), atol=1e-5)
