"""The centred input Gram (zoo/domain/centred_gram.py) against materialized Grams, its truncated reference, and its
invariances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_channels import SHAPES, random_adapters
from zoo.domain.canonical import CanonicalFactors
from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, VANISHED, GramReference, fit_gram_reference
from zoo.domain.channels import channel_matrices, factor_stack
from zoo.domain.exact_scores import exact_cosines
from zoo.domain.similarity import ModuleStack, dense_modules

seeds = st.integers(0, 2**31 - 1)


def unit_gram(f: CanonicalFactors) -> np.ndarray:
    """Ĝ = dWᵀdW / ‖dWᵀdW‖_F, materialized."""
    A = f.delta().double().numpy()
    G = A.T @ A
    return G / np.linalg.norm(G)


def dense_reference(adapters: list[dict[str, CanonicalFactors]], rows: list[int], rank: int) -> dict[str, np.ndarray]:
    """Per module the mean unit Gram of `rows` that have it, truncated to its top `rank` eigenpairs, materialized."""
    out = {}
    for name in SHAPES:
        grams = [unit_gram(adapters[i][name]) for i in rows if name in adapters[i]]
        if grams:
            lam, Q = np.linalg.eigh(np.mean(grams, axis=0))
            top = np.argsort(lam)[::-1][:rank]
            out[name] = (Q[:, top] * lam[top]) @ Q[:, top].T
    return out


def dense_centred(x: dict, y: dict, M: dict[str, np.ndarray]) -> tuple[float, float]:
    """The mean over shared modules of cos(Ĝ_x − M, Ĝ_y − M), materialized (M = 0 where the reference lacks a module;
    0 where a centred Gram vanishes), and its tolerance: float32 factors err by about 1e-7 / the centred norm² of a
    Gram near its reference."""
    values, tolerances = [], []
    for name in sorted(x.keys() & y.keys()):
        ref = M.get(name, 0.0)
        a, b = unit_gram(x[name]) - ref, unit_gram(y[name]) - ref
        smaller = min((a * a).sum(), (b * b).sum())
        values.append(0.0 if smaller < VANISHED else float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b))))
        tolerances.append(2.0 if smaller < 10 * VANISHED else 1e-5 + 1e-6 / smaller)
    return (float(np.mean(values)), float(np.mean(tolerances))) if values else (0.0, 1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, rank=st.sampled_from([1, 2, 64]), dense=st.booleans())
def test_centred_gram_equals_the_cosine_of_materialized_centred_grams(seed: int, rank: int, dense: bool) -> None:
    adapters = random_adapters(seed, 7)
    rows = [0, 2, 3, 5]
    stack = ModuleStack.of(adapters, dense_modules(adapters) if dense else set())
    reference = fit_gram_reference(stack, rows, rank)
    M = dense_reference(adapters, rows, rank)
    expected = np.array([[dense_centred(q, g, M) for g in adapters] for q in adapters])
    error = np.abs(exact_cosines(stack, stack, CENTRED_GRAM, reference) - expected[..., 0])
    assert np.all(error <= expected[..., 1]), (error.max(), expected[..., 1][error > expected[..., 1]])


def dense_module_centred(x: dict, y: dict, M: dict[str, np.ndarray]) -> float:
    """The mean over shared modules of the cosine of each update's two views side by side, materialized: its unit dW
    and its unit centred Gram (Ĝ − M), or zeros where that vanishes."""
    values = []
    for name in sorted(x.keys() & y.keys()):
        views = []
        for f in (x[name], y[name]):
            dw, centred = f.delta().double().numpy(), unit_gram(f) - M.get(name, 0.0)
            norm = np.linalg.norm(centred)
            views.append(
                np.concatenate([(dw / np.linalg.norm(dw)).ravel(), (centred / norm if norm**2 >= VANISHED else 0 * centred).ravel()])
            )
        values.append(float(views[0] @ views[1] / 2))  # each view of unit norm: the concatenation's norm is √2
    return float(np.mean(values)) if values else 0.0


@settings(max_examples=20, deadline=None)
@given(seed=seeds, dense=st.booleans())
def test_module_centred_is_the_cosine_of_both_views_side_by_side(seed: int, dense: bool) -> None:
    adapters = random_adapters(seed, 6)
    stack = ModuleStack.of(adapters, dense_modules(adapters) if dense else set())
    reference = fit_gram_reference(stack, [0, 1, 4], 2)
    M = dense_reference(adapters, [0, 1, 4], 2)
    expected = np.array([[dense_module_centred(q, g, M) for g in adapters] for q in adapters])
    tolerance = np.array([[dense_centred(q, g, M)[1] / 2 + 1e-6 for g in adapters] for q in adapters])
    got = exact_cosines(stack, stack, MODULE_CENTRED, reference)
    assert np.all(np.abs(got - expected) <= tolerance), np.abs(got - expected).max()
    assert np.all(np.abs(got - got.T) <= tolerance + tolerance.T)  # float32 products
    with pytest.raises(ValueError, match="need the reference"):
        exact_cosines(stack, stack, MODULE_CENTRED)


@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_an_empty_reference_gives_the_input_gram_cosine(seed: int) -> None:
    adapters = random_adapters(seed)
    stack = factor_stack(adapters)
    plain = channel_matrices(stack, stack, ("input_gram",))["input_gram"]
    np.testing.assert_allclose(exact_cosines(stack, stack, CENTRED_GRAM, GramReference({})), plain, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_centred_gram_is_blind_to_the_output_side_and_symmetric(seed: int) -> None:
    adapters = random_adapters(seed, 6)
    rng = np.random.default_rng(seed)
    turned = []
    for a in adapters:  # dW -> Q dW, Q orthogonal: a re-seeded head, say
        moved = {}
        for name, f in a.items():
            Q = torch.from_numpy(np.linalg.qr(rng.standard_normal((SHAPES[name][0],) * 2))[0])
            moved[name] = CanonicalFactors(Q @ f.U, f.S, f.V)
        turned.append(moved)
    reference = fit_gram_reference(factor_stack(adapters), range(6))
    before = exact_cosines(factor_stack(adapters), factor_stack(adapters), CENTRED_GRAM, reference)
    after = exact_cosines(factor_stack(turned), factor_stack(turned), CENTRED_GRAM, reference)
    # float32 products, and the centring subtracts nearly equal terms: a few units in the fifth decimal
    np.testing.assert_allclose(after, before, atol=5e-5)
    np.testing.assert_allclose(before, before.T, atol=5e-5)
    assert np.all(np.abs(before) <= 1 + 1e-6)


def test_a_reference_reads_back_the_same_scores() -> None:
    adapters = random_adapters(3, 6)
    stack = factor_stack(adapters)
    reference = fit_gram_reference(stack, [0, 1, 2])
    again = GramReference.from_arrays(dict(reference.arrays()))
    np.testing.assert_array_equal(exact_cosines(stack, stack, CENTRED_GRAM, again), exact_cosines(stack, stack, CENTRED_GRAM, reference))


def test_the_shared_part_is_removed() -> None:
    """Two unrelated adapters that both lean on one common input direction: plain Gram cosine sees it, centring on a
    reference that holds it does not."""
    rng = np.random.default_rng(0)
    d, n = 12, 40
    common = np.linalg.qr(rng.standard_normal((d, 1)))[0]
    adapters = []
    for _ in range(n):
        V = np.linalg.qr(np.hstack([common, rng.standard_normal((d, 2))]))[0]
        U = np.linalg.qr(rng.standard_normal((6, 3)))[0]
        S = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)
        adapters.append({"q": CanonicalFactors(torch.from_numpy(U), S, torch.from_numpy(V))})
    stack = factor_stack(adapters)
    plain = channel_matrices(stack, stack, ("input_gram",))["input_gram"]
    centred = exact_cosines(stack, stack, CENTRED_GRAM, fit_gram_reference(stack, range(n)))
    off = ~np.eye(n, dtype=bool)
    assert plain[off].mean() > 0.3
    assert abs(centred[off].mean()) < 0.1


def test_a_large_reference_is_a_sample_factored_by_a_randomized_svd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past REFERENCE_ADAPTERS the mean is a seeded sample's, past EXACT_SVD_VALUES factored by a randomized SVD: its
    leading eigenpairs are the exact factorization's."""
    import zoo.domain.centred_gram as centred_gram

    adapters = random_adapters(5, 12)
    stack = factor_stack(adapters)
    exact = fit_gram_reference(stack, range(12), rank=2)
    monkeypatch.setattr(centred_gram, "EXACT_SVD_VALUES", 0)
    randomized = fit_gram_reference(stack, range(12), rank=2)
    for name, (Q, lam) in exact.modules.items():
        R, mu = randomized.modules[name]
        np.testing.assert_allclose(mu, lam, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose((R.T * mu) @ R, (Q.T * lam) @ Q, atol=1e-3)
    whole = fit_gram_reference(stack, range(12), rank=64)
    monkeypatch.setattr(centred_gram, "REFERENCE_ADAPTERS", 4)
    sampled = fit_gram_reference(stack, range(12), rank=64)
    assert sampled.modules.keys() == whole.modules.keys()
    assert any(sampled.energy(m) != pytest.approx(whole.energy(m)) for m in whole.modules)  # the mean of 4, not of all
    again = fit_gram_reference(stack, range(12), rank=64)  # seeded: the same sample every time
    assert all(np.array_equal(a, b) for a, b in zip(sampled.arrays().values(), again.arrays().values(), strict=True))


def test_the_reference_is_fitted_on_a_sample_of_the_space_labelled_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """ExactScores among the labelled adapters keep the reference of the space's reference_sample: every adapter up to
    REFERENCE_POOL (the unlabelled ones too), past it a seeded sample of that many, the same every time."""
    import zoo.domain.centred_gram as centred_gram
    from embed.data.dataset import ExactScores
    from embed.data.types import ZooAdapter
    from zoo.domain.centred_gram import reference_sample

    space = [ZooAdapter(i, f"a{i}", a) for i, a in enumerate(random_adapters(7, 12))]
    labelled = space[:4]
    given = ExactScores.of_factors(labelled, bank=False, space=space).gram_reference
    everyone = fit_gram_reference(factor_stack([a.factors for a in space]), range(12))
    alone = fit_gram_reference(factor_stack([a.factors for a in labelled]), range(4))
    assert given is not None and given.modules.keys() == everyone.modules.keys()
    assert all(given.energy(m) == pytest.approx(everyone.energy(m), rel=1e-5) for m in everyone.modules)
    assert any(alone.energy(m) != pytest.approx(everyone.energy(m), rel=1e-3) for m in alone.modules)
    monkeypatch.setattr(centred_gram, "REFERENCE_POOL", 5)
    picked = reference_sample(list(range(100, 112)))
    assert len(picked) == 5 and picked == sorted(picked) and picked == reference_sample(list(range(100, 112)))
