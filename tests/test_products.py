"""zoo/domain/products.py: a tall factors' product aᵀb is taken by the library faster at its size on this machine,
and is aᵀb whichever that is."""

from __future__ import annotations

import time

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from zoo.domain.products import cross, product_times
from zoo.services.threads import one_torch_thread


@pytest.mark.parametrize("shape", [(14336, 16), (4096, 16)])  # a Llama-3-8B MLP and attention module's factors, rank 16
def test_a_product_takes_about_the_time_of_the_faster_library(shape: tuple[int, int]) -> None:
    """On one thread, as the relation step runs: `cross` takes at most 1.5× the faster of torch's and numpy's product
    (MKL's float64 product was 2.3× OpenBLAS's on an AMD EPYC machine, where torch took them all), whatever library
    a product of the same size on the default threads took before."""
    rows, rank = shape
    a, b = np.random.default_rng(1).standard_normal((2, rows, rank))
    cross(a, b)
    with threadpool_limits(limits=1, user_api="blas"), one_torch_thread():
        np.testing.assert_allclose(cross(a, b), a.T @ b, rtol=1e-12, atol=1e-12 * rows)
        by_torch, by_numpy = product_times(rows, rank, 30)
        best = float("inf")
        for _ in range(30):
            start = time.perf_counter()
            cross(a, b)
            best = min(best, time.perf_counter() - start)
    assert best <= 1.5 * min(by_torch, by_numpy), (best, by_torch, by_numpy)


def test_a_small_product_is_numpys_and_exact() -> None:
    a, b = np.random.default_rng(2).standard_normal((2, 640, 8))
    assert np.array_equal(cross(a, b), a.T @ b)
