"""Spectral descriptors against closed forms and a power-law fit against known exponents."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.domain.spectra import fit_power_law_tail, matrix_spectrum, singular_values, spectrum_from_singular_values


def test_descriptors_of_known_singular_values() -> None:
    s = spectrum_from_singular_values(np.array([1.0, 3.0, 2.0, 0.0]))
    assert s.singular_values == [3.0, 2.0, 1.0]
    assert s.spectral_norm == 3.0
    assert s.frobenius_norm == pytest.approx(math.sqrt(14))
    assert s.stable_rank == pytest.approx(14 / 9)
    p = np.array([3, 2, 1]) / 6
    assert s.effective_rank == pytest.approx(math.exp(-(p * np.log(p)).sum()))
    flat = spectrum_from_singular_values(np.ones(5))
    assert flat.effective_rank == pytest.approx(5.0)
    assert flat.stable_rank == pytest.approx(5.0)


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from([(7, 3), (3, 7), (40, 40), (5, 2, 3, 3), (3000, 9)]), seed=st.integers(0, 2**16), rank=st.integers(1, 9))
def test_singular_values_match_an_svd(shape: tuple[int, ...], seed: int, rank: int) -> None:
    """Tall, wide, square and conv-kernel matrices of any rank: the Gram route's values equal an SVD's (σ_max-relative)."""
    gen = torch.Generator().manual_seed(seed)
    left, right = torch.randn(shape[0], rank, generator=gen), torch.randn(rank, math.prod(shape[1:]), generator=gen)
    W = (left @ right).reshape(shape)
    ref = np.linalg.svd(W.reshape(shape[0], -1).double().numpy(), compute_uv=False)
    got = singular_values(W).numpy()
    assert got.shape == ref.shape and np.all(np.diff(got) <= 0)
    assert np.allclose(got, ref, atol=1e-6 * ref[0], rtol=0)


def test_matrix_spectrum_matches_numpy_svd() -> None:
    W = torch.randn(60, 80, generator=torch.Generator().manual_seed(0))
    spec = matrix_spectrum(W)
    ref = np.linalg.svd(W.double().numpy(), compute_uv=False)
    assert np.allclose(spec.singular_values, ref, rtol=1e-5)
    assert spec.frobenius_norm == pytest.approx(float(np.linalg.norm(W.double().numpy())), rel=1e-6)
    assert spec.power_law_alpha is not None


@pytest.mark.parametrize("alpha", [2.0, 3.0, 4.5])
def test_power_law_fit_recovers_exponent(alpha: float) -> None:
    rng = np.random.default_rng(int(alpha * 10))
    x = (1.0 - rng.random(4000)) ** (-1.0 / (alpha - 1.0))  # Pareto with x_min = 1, density ∝ x^-alpha
    fit = fit_power_law_tail(x)
    assert fit is not None
    got, xmin, ks = fit
    assert got == pytest.approx(alpha, abs=0.15)
    assert xmin < 3.0
    assert ks < 0.05


def test_power_law_fit_skips_a_lognormal_body() -> None:
    rng = np.random.default_rng(1)
    body = rng.lognormal(0.0, 0.3, 3000)
    tail = 5.0 * (1.0 - rng.random(600)) ** (-1.0 / 1.5)  # alpha 2.5 from x_min 5
    got, xmin, _ = fit_power_law_tail(np.concatenate([body, tail]))
    assert xmin > 2.0
    assert got == pytest.approx(2.5, abs=0.3)


def test_power_law_needs_enough_eigenvalues() -> None:
    assert fit_power_law_tail(np.arange(1.0, 6.0)) is None
