"""Property tests of the canonical form: invariance, orthonormality, reconstruction, batched = reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zoo.domain.canonical import CanonicalFactors, canonicalize, canonicalize_batched
from zoo.domain.fingerprint import FINGERPRINT_DIM, canonical_hash, fingerprint, hash_margin, relative_distance
from zoo.domain.probes import probes

# Tolerances (float32 inputs, float64 r×r parts): components agree to 1e-4 relative to S_max
# after a re-factorization with cond(G) <= ~100; reconstruction to 1e-5.
TOL = 1e-4


def random_lora(seed: int, out: int, inp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # distinct, well-separated singular values so components are well defined
    B = torch.linalg.qr(torch.randn(out, r, generator=g))[0] * torch.linspace(2.0, 0.5, r)
    A = torch.linalg.qr(torch.randn(inp, r, generator=g))[0].T
    mix = torch.linalg.qr(torch.randn(r, r, generator=g))[0]
    return (mix.T @ A), (B @ mix)  # B·A unchanged by the orthogonal mix


def well_conditioned(seed: int, r: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 10_000)
    q1 = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))[0]
    q2 = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))[0]
    s = torch.logspace(0, 1.5, r, dtype=torch.float64)  # cond(G) ~ 30
    return (q1 * s) @ q2


def assert_same(x: CanonicalFactors, y: CanonicalFactors, tol: float = TOL) -> None:
    assert x.rank == y.rank
    smax = float(x.S[0])
    assert torch.allclose(x.S, y.S, atol=tol * smax, rtol=0)
    assert torch.allclose(x.U, y.U, atol=tol * 10, rtol=0)
    assert torch.allclose(x.V, y.V, atol=tol * 10, rtol=0)


shapes = st.tuples(st.integers(8, 64), st.integers(8, 64), st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, scale=st.floats(0.1, 10.0))
def test_refactorization_gives_same_canonical_form(seed: int, shape: tuple[int, int, int], scale: float) -> None:
    out, inp, r = shape
    A, B = random_lora(seed, out, inp, r)
    G = well_conditioned(seed, r)
    B2 = (B.double() @ G).float()
    A2 = (torch.linalg.inv(G) @ A.double()).float()
    assert_same(canonicalize(A, B, scale), canonicalize(A2, B2, scale))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, data=st.data())
def test_permutations_and_sign_flips_give_same_canonical_form(seed: int, shape: tuple[int, int, int], data: st.DataObject) -> None:
    out, inp, r = shape
    A, B = random_lora(seed, out, inp, r)
    perm = torch.tensor(data.draw(st.permutations(list(range(r)))))
    signs = torch.tensor(data.draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=r, max_size=r)))
    A2 = (A * signs[:, None])[perm]
    B2 = (B * signs[None, :])[:, perm]
    assert_same(canonicalize(A, B), canonicalize(A2, B2))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes)
def test_orthonormal_sorted_signed_and_reconstructs(seed: int, shape: tuple[int, int, int]) -> None:
    out, inp, r = shape
    g = torch.Generator().manual_seed(seed)
    A, B = torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g)
    c = canonicalize(A, B, 0.5)
    k = c.rank
    assert k == min(r, out, inp)
    eye = torch.eye(k)
    assert torch.allclose(c.U.T @ c.U, eye, atol=1e-5)
    assert torch.allclose(c.V.T @ c.V, eye, atol=1e-5)
    assert torch.all(c.S[:-1] >= c.S[1:])
    idx = c.U.abs().argmax(dim=0)
    assert torch.all(c.U[idx, torch.arange(k)] > 0)
    dW = 0.5 * B.double() @ A.double()
    assert torch.linalg.norm(c.delta().double() - dW) <= 1e-5 * torch.linalg.norm(dW)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, n=st.integers(1, 6))
def test_batched_matches_reference(seed: int, shape: tuple[int, int, int], n: int) -> None:
    out, inp, r = shape
    pairs = [random_lora(seed + i, out, inp, r) for i in range(n)]
    A = torch.stack([a for a, _ in pairs])
    B = torch.stack([b for _, b in pairs])
    scale = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    for i, got in enumerate(canonicalize_batched(A, B, scale)):
        assert_same(got, canonicalize(A[i], B[i], float(scale[i])))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    r=st.integers(1, 6),
    sizes=st.lists(st.tuples(st.integers(6, 40), st.integers(6, 40)), min_size=1, max_size=6),
)
def test_batched_modules_of_several_shapes_match_reference(seed: int, r: int, sizes: list[tuple[int, int]]) -> None:
    """Modules of one rank and different shapes go through one batch (grouped by shape inside), in input order; an
    ill-conditioned one among them falls back on its own."""
    pairs = [random_lora(seed + i, out, inp, r) for i, (out, inp) in enumerate(sizes)]
    if r > 1:
        A, B = pairs[-1]
        B = B.clone()
        B[:, -1] = B[:, 0] * (1 + 1e-7)  # nearly dependent columns: cond(BᵀB) huge
        pairs[-1] = (A, B)
    scale = [0.5 + i for i in range(len(pairs))]
    got = canonicalize_batched([a for a, _ in pairs], [b for _, b in pairs], scale)
    for i, ((A, B), s, g) in enumerate(zip(pairs, scale, got, strict=True)):
        ref = canonicalize(A, B, s)
        if not (r > 1 and i == len(pairs) - 1):  # Gaussian factors: full rank (the planted one may lose a component)
            assert g.rank == ref.rank == r
            if ref.S[-1] > 1e-3 * ref.S[0]:  # (U, S, V) are compared where σ_min is not within rounding of a tie
                assert_same(g, ref)
        assert torch.allclose(g.delta(), s * B @ A, atol=1e-4 * max(1.0, float((s * B @ A).abs().max())))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.tuples(st.integers(4, 20), st.integers(4, 20), st.integers(1, 4)), min_size=1, max_size=8),
)
def test_fingerprint_is_the_sum_of_every_modules_probe_values(seed: int, sizes: list[tuple[int, int, int]]) -> None:
    """The fingerprint (modules of one shape batched together) equals Σ ωᵀ·dW·ψ module by module, on dense dW."""
    mods = []
    for i, (out, inp, r) in enumerate(sizes):
        A, B = random_lora(seed + i, out, inp, r)
        mods.append((f"layers.{i % 3}.m{i}", canonicalize(A, B)))
    z = torch.zeros(FINGERPRINT_DIM, dtype=torch.float64)
    for name, f in mods:
        omega, psi = probes(name, f.U.shape[0], f.V.shape[0], FINGERPRINT_DIM)
        z += ((omega.T @ f.delta().double()) * psi.T).sum(dim=1)
    values, norm = fingerprint(mods)
    assert norm == pytest.approx(math.sqrt(sum(float(f.delta().double().pow(2).sum()) for _, f in mods)), rel=1e-5)
    assert values == pytest.approx((z / norm).tolist(), abs=1e-5)


def test_batched_falls_back_for_ill_conditioned_factors() -> None:
    g = torch.Generator().manual_seed(1)
    r = 6
    A = torch.randn(3, r, 40, generator=g)
    B = torch.randn(3, 50, r, generator=g)
    B[1, :, -1] = B[1, :, 0] * (1 + 1e-7)  # nearly dependent columns: cond(BᵀB) huge
    got = canonicalize_batched(A, B)
    for i in range(3):
        ref = canonicalize(A[i], B[i])
        assert got[i].rank == ref.rank
        assert torch.allclose(got[i].delta(), B[i] @ A[i], atol=1e-4 * float((B[i] @ A[i]).abs().max()))


def test_zero_components_are_dropped() -> None:
    g = torch.Generator().manual_seed(2)
    A = torch.randn(4, 30, generator=g)
    B = torch.randn(20, 4, generator=g)
    B[:, 2:] = 0  # rank-2 update stored at rank 4
    assert canonicalize(A, B).rank == 2
    assert canonicalize_batched(A[None], B[None])[0].rank == 2
    assert canonicalize(A, torch.zeros(20, 4)).rank == 0


def test_half_precision_inputs_accumulate_in_float32() -> None:
    A, B = random_lora(3, 48, 40, 4)
    for dtype in (torch.float16, torch.bfloat16):
        Ah, Bh = A.to(dtype), B.to(dtype)
        c = canonicalize(Ah, Bh)
        assert c.U.dtype == torch.float32
        # the update the half-precision factors define, exactly: math done in half precision would be
        # off by ~1e-3 of it, float32 accumulation is within 1e-5
        exact = Bh.double() @ Ah.double()
        assert torch.linalg.norm(c.delta().double() - exact) <= 1e-5 * torch.linalg.norm(exact)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_modules=st.integers(1, 4))
def test_canonical_hash_is_factorization_invariant(seed: int, n_modules: int) -> None:
    mods, mods2 = [], []
    for m in range(n_modules):
        A, B = random_lora(seed + m, 24, 20, 4)
        G = well_conditioned(seed + m, 4)
        mods.append((f"layers.{m}.q_proj", canonicalize(A, B)))
        mods2.append((f"layers.{m}.q_proj", canonicalize((torch.linalg.inv(G) @ A.double()).float(), (B.double() @ G).float())))
    assert relative_distance(mods, mods2) < 1e-5
    # Rounding has boundaries: equality is promised when no hashed value lies within float noise of one; examples
    # that put one there are discarded (hypothesis fails the test if that leaves too few).
    assume(hash_margin(mods) > 1e-5)
    assert canonical_hash(mods) == canonical_hash(mods2)


def test_canonical_hash_separates_different_updates() -> None:
    hashes = set()
    for seed in range(50):
        A, B = random_lora(seed, 24, 20, 4)
        hashes.add(canonical_hash([("m", canonicalize(A, B))]))
    assert len(hashes) == 50
