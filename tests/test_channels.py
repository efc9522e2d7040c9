"""The similarity channels (zoo/domain/channels.py) against materialized dW, their invariances, and their sketches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.channels import CHANNELS, channel_group_sums, channel_matrices, channel_sketches, factor_stack, pair_channels
from zoo.domain.similarity import ModuleStack, sketch_module_cosines

# (out, in) per module name; "up" is wide and short, so a full-rank update spans its whole output space
SHAPES = {"q": (7, 5), "o": (9, 11), "up": (4, 13)}
SIGNED = {"module"}  # the channels in [-1, 1]; the others lie in [0, 1]
seeds = st.integers(0, 2**31 - 1)


def random_module(rng: np.random.Generator, name: str, like: CanonicalFactors | None = None) -> CanonicalFactors:
    """Random float64 canonical factors; with `like`, half the time sharing its input or output basis (overlaps of 1)."""
    out, inp = SHAPES[name]
    related = like is not None and rng.random() < 0.5
    r = like.rank if like is not None and related else int(rng.integers(1, min(out, inp, 5) + 1))
    U = np.linalg.qr(rng.standard_normal((out, r)))[0]
    V = np.linalg.qr(rng.standard_normal((inp, r)))[0]
    if like is not None and related:
        U, V = (like.U.numpy(), V) if rng.random() < 0.5 else (U, like.V.numpy())
    S = np.sort(rng.uniform(0.1, 3.0, r))[::-1].copy()
    return CanonicalFactors(torch.from_numpy(U), torch.from_numpy(S), torch.from_numpy(V))


def random_adapters(seed: int, n: int = 5) -> list[dict[str, CanonicalFactors]]:
    """n adapters on random subsets of SHAPES' modules (every one has at least one), some related to the first."""
    rng = np.random.default_rng(seed)
    adapters: list[dict[str, CanonicalFactors]] = []
    for _ in range(n):
        names = [m for m in SHAPES if rng.random() < 0.7] or [str(rng.choice(list(SHAPES)))]
        first = adapters[0] if adapters else {}
        adapters.append({m: random_module(rng, m, first.get(m)) for m in names})
    return adapters


def dense_channels(x: dict[str, CanonicalFactors], y: dict[str, CanonicalFactors]) -> dict[str, float]:
    """The reference: each channel from materialized dW (d_out × d_in), its Grams, the projectors onto its row and
    column spaces (pseudo-inverse) and its full SVD, averaged over shared modules."""

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b)))

    def projector_cos(p: np.ndarray, q: np.ndarray) -> float:
        return float((p * q).sum() / np.sqrt(np.trace(p) * np.trace(q)))

    values: dict[str, list[float]] = {c: [] for c in CHANNELS}
    for name in sorted(x.keys() & y.keys()):
        A, B = x[name].delta().double().numpy(), y[name].delta().double().numpy()
        values["module"].append(cos(A, B))
        values["input_gram"].append(cos(A.T @ A, B.T @ B))
        values["output_gram"].append(cos(A @ A.T, B @ B.T))
        values["input_subspace"].append(projector_cos(np.linalg.pinv(A) @ A, np.linalg.pinv(B) @ B))
        values["output_subspace"].append(projector_cos(A @ np.linalg.pinv(A), B @ np.linalg.pinv(B)))
        values["spectrum"].append(cos(np.linalg.svd(A, compute_uv=False), np.linalg.svd(B, compute_uv=False)))
    return {c: float(np.mean(v)) if v else 0.0 for c, v in values.items()}


def stacked(queries: list[dict], gallery: list[dict]) -> dict[str, np.ndarray]:
    return channel_matrices(factor_stack(gallery), factor_stack(queries))


def pairs(queries: list[dict], gallery: list[dict]) -> dict[str, np.ndarray]:
    table = [[pair_channels(q, g) for g in gallery] for q in queries]
    return {c: np.array([[p[c] for p in row] for row in table]) for c in CHANNELS}


@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_each_channel_equals_its_dense_computation(seed: int) -> None:
    adapters = random_adapters(seed)
    reference = pairs(adapters, adapters)
    dense = [[dense_channels(q, g) for g in adapters] for q in adapters]
    fast = stacked(adapters[:3], adapters)  # float32 stacks, padded to each module's largest rank
    for c in CHANNELS:
        want = np.array([[d[c] for d in row] for row in dense])
        assert np.allclose(reference[c], want, atol=1e-6), c
        assert np.allclose(fast[c], want[:3], atol=1e-5), c


@settings(max_examples=20, deadline=None)
@given(seed=seeds)
def test_a_refactorized_update_scores_the_same(seed: int) -> None:
    """B·G and G⁻¹·A (G well-conditioned) canonicalize to the same (U, S, V): every channel's value is the same."""
    gen = torch.Generator().manual_seed(seed)
    adapters, again = [], []
    for _ in range(4):
        a, b = {}, {}
        for name, (out, inp) in SHAPES.items():
            r = int(torch.randint(1, 5, (1,), generator=gen))
            A, B = torch.randn(r, inp, generator=gen, dtype=torch.float64), torch.randn(out, r, generator=gen, dtype=torch.float64)
            G = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=torch.float64))[0] * torch.linspace(0.5, 2.0, r, dtype=torch.float64)
            a[name] = canonicalize(A.float(), B.float())
            b[name] = canonicalize((torch.linalg.inv(G) @ A).float(), (B @ G).float())
        adapters.append(a)
        again.append(b)
    assert_same_scores(again, adapters, pairs_atol=1e-5, stacked_atol=1e-5)


def assert_same_scores(other: list, adapters: list, pairs_atol: float, stacked_atol: float) -> None:
    """`other` (another form of `adapters`) scores against `adapters` as they score against themselves, in every
    channel, per pair and stacked."""
    want, got = pairs(adapters, adapters), pairs(other, adapters)
    fast_want, fast_got = stacked(adapters, adapters), stacked(other, adapters)
    for c in CHANNELS:
        assert np.allclose(got[c], want[c], atol=pairs_atol), c
        assert np.allclose(fast_got[c], fast_want[c], atol=stacked_atol), c


@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_permuted_and_sign_flipped_components_score_the_same(seed: int) -> None:
    adapters = random_adapters(seed, 4)
    rng = np.random.default_rng(seed)
    shuffled = []
    for a in adapters:
        b = {}
        for name, f in a.items():
            perm, signs = torch.from_numpy(rng.permutation(f.rank)), torch.from_numpy(rng.choice([-1.0, 1.0], f.rank))
            b[name] = CanonicalFactors(f.U[:, perm] * signs, f.S[perm], f.V[:, perm] * signs)
        shuffled.append(b)
    assert_same_scores(shuffled, adapters, pairs_atol=1e-9, stacked_atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_channels_are_symmetric_bounded_and_one_on_the_diagonal(seed: int) -> None:
    adapters = random_adapters(seed, 6)
    got = stacked(adapters, adapters)
    reference = pairs(adapters, adapters)
    for c in CHANNELS:
        m = got[c]
        assert np.allclose(m, m.T, atol=1e-6), c
        assert np.allclose(reference[c], reference[c].T, atol=1e-12), c
        assert m.max() <= 1 + 1e-6 and m.min() >= (-1 if c in SIGNED else 0) - 1e-6, c
        assert np.allclose(np.diag(m), 1.0, atol=1e-5), c
    # von Neumann's trace inequality: the spectra's cosine bounds the module cosine's magnitude
    assert (reference["spectrum"] >= np.abs(reference["module"]) - 1e-12).all()


def rotated(adapters: list[dict[str, CanonicalFactors]], side: str, seed: int) -> list[dict[str, CanonicalFactors]]:
    """Each module's update turned by one orthogonal matrix per module name: dW → Q·dW ("output") or dW·Qᵀ ("input")."""
    rng = np.random.default_rng(seed)
    turns = {
        name: torch.from_numpy(np.linalg.qr(rng.standard_normal((d, d)))[0])
        for name, d in ((n, s[side == "input"]) for n, s in SHAPES.items())
    }
    if side == "output":
        return [{n: CanonicalFactors(turns[n] @ f.U, f.S, f.V) for n, f in a.items()} for a in adapters]
    return [{n: CanonicalFactors(f.U, f.S, turns[n] @ f.V) for n, f in a.items()} for a in adapters]


@settings(max_examples=30, deadline=None)
@given(seed=seeds, side=st.sampled_from(["input", "output"]))
def test_each_sides_channels_do_not_see_a_rotation_of_the_other_side(seed: int, side: str) -> None:
    """The input Gram and input subspace of dW and Q·dW agree (a changed head leaves what reads the inputs), and the
    output channels of dW and dW·Qᵀ; the spectrum sees neither."""
    adapters = random_adapters(seed, 4)
    other = "output" if side == "input" else "input"
    turned = rotated(adapters, other, seed)
    want, got = pairs(adapters[:2], adapters), pairs(turned[:2], adapters)
    fast_want, fast_got = stacked(adapters[:2], adapters), stacked(turned[:2], adapters)
    for c in (f"{side}_gram", f"{side}_subspace", "spectrum"):
        assert np.allclose(got[c], want[c], atol=1e-9), c
        assert np.allclose(fast_got[c], fast_want[c], atol=1e-5), c


def test_a_rotation_moves_the_first_order_and_the_rotated_sides_channels() -> None:
    """What the invariance test is about: the same rotation does change module cosine and the turned side's Gram."""
    adapters = random_adapters(7, 4)
    want, got = pairs(adapters, adapters), pairs(rotated(adapters, "output", 7), adapters)
    for c in ("module", "output_gram"):
        assert np.abs(got[c] - want[c]).max() > 0.05, c


def test_sketch_inner_products_approach_the_exact_channels() -> None:
    """Per channel, the mean over shared modules of the sketch blocks' inner products (sketch_module_cosines) nears the
    exact value as the probes grow: error about 1/√dim (fixed seeds: probes are seeded by module name and shape)."""
    adapters = random_adapters(11, 8)
    modules = sorted(SHAPES)
    exact = stacked(adapters, adapters)
    for c in CHANNELS:
        errors = []
        for dim in (16, 256, 4096):
            sketch = channel_sketches(adapters, modules, dim, c)
            estimate = sketch_module_cosines(sketch, sketch, len(modules))
            errors.append(float(np.abs(estimate - exact[c]).mean()))
        if c == "spectrum":  # the padded unit spectrum: its inner products are the channel itself
            assert max(errors) < 1e-6
        else:
            assert errors[2] < 0.05 and errors[2] < errors[0] / 4 and errors[1] < errors[0], (c, errors)


def test_a_dense_stack_scores_as_factors_and_refuses_unknown_names() -> None:
    """Every channel, the subspaces too (a dense module's round-off components are not counted), as from the factors."""
    adapters = random_adapters(3, 3)
    dense = ModuleStack.of(adapters, set(SHAPES))
    assert set(dense.dense) == set(SHAPES) and not dense.factors
    got, want = channel_matrices(dense, dense), stacked(adapters, adapters)
    for c in CHANNELS:
        assert np.allclose(got[c], want[c], atol=1e-5), c
    with pytest.raises(ValueError, match="different layouts"):
        channel_matrices(dense, factor_stack(adapters), ("input_gram",))
    with pytest.raises(ValueError, match="unknown"):
        channel_matrices(dense, dense, ("cosine",))


@settings(max_examples=20, deadline=None)
@given(seed=seeds, dense=st.booleans())
def test_group_inner_products_sum_to_the_whole_updates_inner_product(seed: int, dense: bool) -> None:
    """The groups' ⟨dW_q, dW_g⟩, made from the same module cosines as the channels, sum to the whole updates' inner
    product; they need the module channel."""
    adapters = random_adapters(seed, 5)
    stack = ModuleStack.of(adapters, set(SHAPES) if dense else set())
    sums, _ = channel_group_sums(stack, stack, lambda name: name[:1], CHANNELS, inner_products=True)
    np.testing.assert_allclose(sum(sums["dw"].values()), stack.inner_products(stack), atol=1e-9)
    with pytest.raises(ValueError, match="module"):
        channel_group_sums(stack, stack, lambda name: "", ("input_gram",), inner_products=True)
