"""Provenance from the weights: transforms, merges and continuations found from adapters' factors.

Random low-rank adapters of a few small modules; each relation is made the way it is made in the wild (alpha
changed, A and B cast, the SVD truncated, A and B magnitude-pruned, PEFT's add_weighted_adapter) and must be
found with its parameter, while unrelated adapters give no edge.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from peft import PeftModel

from tests.factories import peft_merge_model, peft_update
from zoo.domain import transforms
from zoo.domain.canonical import CanonicalFactors, canonicalize, canonicalize_batched
from zoo.domain.continuation import MIN_SHARED_ROWS, detect_continuation, origin_score, shared_rows
from zoo.domain.factorwise import RawModule
from zoo.domain.merges import detect_merge
from zoo.domain.raw_sketch import raw_sketches, raw_width
from zoo.domain.relations import Relations, find_merge, find_relations
from zoo.domain.transforms import FactorSummary, Update, detect_transform, expected_cast_residual, residual_class
from zoo.formats import LoraModule

SHAPES = {"layers.0.q_proj": (24, 20), "layers.0.v_proj": (24, 20), "layers.1.q_proj": (20, 24), "layers.1.fc": (32, 20)}
Raw = dict[str, LoraModule]
seeds = st.integers(0, 2**31 - 1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_adapter(seed: int, rank: int = 3, alpha: float = 6.0) -> Raw:
    """A and B as a trained LoRA has them: A near its Kaiming-like init, B of a smaller scale."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: LoraModule(
            name, torch.randn(rank, fan_in, generator=g) / fan_in**0.5, 0.05 * torch.randn(fan_out, rank, generator=g), alpha, alpha / rank
        )
        for name, (fan_out, fan_in) in SHAPES.items()
    }


def update(raw: Raw, id: int | None = None, keep_raw: bool = True) -> Update:
    """The adapter as the relation step reads it: canonical factors and (keep_raw) the summary ingest keeps of A and B."""
    factors = {n: canonicalize(m.A, m.B, m.scale) for n, m in raw.items()}
    return Update(factors, FactorSummary.of(raw, factors) if keep_raw else None, id)


def remake(raw: Raw, A=lambda m: m.A, B=lambda m: m.B, scale=lambda m: m.scale) -> Raw:  # noqa: ANN001
    return {n: LoraModule(n, A(m), B(m), m.alpha, scale(m)) for n, m in raw.items()}


def cast(raw: Raw, dtype: torch.dtype) -> Raw:
    return remake(raw, A=lambda m: m.A.to(dtype).float(), B=lambda m: m.B.to(dtype).float())


def prune(t: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The smallest-magnitude share `sparsity` of a tensor's entries set to zero."""
    k = int(round(sparsity * t.numel()))
    if k == 0:
        return t
    threshold = t.abs().flatten().kthvalue(k).values
    return torch.where(t.abs() <= threshold, torch.zeros_like(t), t)


def assert_confidences(relations: Relations) -> None:
    edges = [*relations.transforms, *relations.continuations, *([relations.merge] if relations.merge else [])]
    for e in edges:
        assert 0.0 <= e.confidence <= 1.0


def assert_no_edge(query: Update, candidates: list[Update]) -> None:
    relations = find_relations(query, candidates)
    assert relations == Relations(), relations


# --- transforms -------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seeds, st.floats(0.05, 20.0), st.booleans())
def test_a_rescaled_copy_is_found_with_its_factor(seed: int, factor: float, keep_raw: bool) -> None:
    assume(abs(factor - 1.0) > 1e-3)
    parent = random_adapter(seed)
    child = remake(parent, scale=lambda m: m.scale * factor)  # alpha changed: the same A and B
    edge = detect_transform(update(child, keep_raw=keep_raw), update(parent, 7))
    assert edge is not None and edge.relation == "rescaled" and edge.steps == ("rescaled",)
    assert edge.parent == 7 and edge.child is None
    assert edge.scale == pytest.approx(factor, rel=1e-5)
    assert edge.confidence == 1.0


@settings(max_examples=25, deadline=None)
@given(seeds, st.sampled_from(["bf16", "fp16"]), st.booleans(), st.sampled_from([1.0, 0.25, 3.0]))
def test_a_cast_is_found_with_its_precision(seed: int, precision: str, keep_raw: bool, factor: float) -> None:
    parent = random_adapter(seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    child = cast(remake(parent, scale=lambda m: m.scale * factor), dtype)
    edge = detect_transform(update(child, keep_raw=keep_raw), update(parent, 1))
    assert edge is not None and edge.precision == precision
    assert edge.steps == (("rescaled", "cast") if factor != 1.0 else ("cast",))
    assert edge.relation == ("rescaled" if factor != 1.0 else "cast")
    assert edge.scale == pytest.approx(factor, rel=1e-2)
    # the residual is the rounding's, within a factor 2 of what the precision predicts
    assert 0.5 < edge.evidence["relative_residual"] / expected_cast_residual(precision) < 2.0


def test_cast_bands_tile_and_unrelated_residuals_fall_outside() -> None:
    assert residual_class(0.0) == "identical"
    assert residual_class(expected_cast_residual("fp16")) == "fp16"
    assert residual_class(expected_cast_residual("bf16")) == "bf16"
    assert residual_class(0.05) is None


def test_raw_factors_that_no_precision_holds_rule_out_a_cast() -> None:
    """Noise of a bf16 cast's size, but float32 entries: not a cast (the raw factors are checked)."""
    parent = random_adapter(3)
    g = torch.Generator().manual_seed(4)
    noisy = remake(parent, B=lambda m: m.B * (1 + 2.3e-3 * torch.randn(m.B.shape, generator=g)))
    edge = detect_transform(update(noisy), update(parent, 1))
    assert edge is None
    assert detect_transform(update(noisy, keep_raw=False), update(parent, 1)) is not None  # canonical only: looks like one


def truncate(raw: Raw, k: int) -> Raw:
    """Top-k of each module's SVD, written back as rank-k factors (B = U_k S_k, A = V_kᵀ)."""
    out = {}
    for n, m in raw.items():
        U, S, Vh = torch.linalg.svd(m.scale * (m.B.double() @ m.A.double()), full_matrices=False)
        out[n] = LoraModule(n, Vh[:k].float(), (U[:, :k] * S[:k]).float(), float(k), 1.0)
    return out


@settings(max_examples=25, deadline=None)
@given(seeds, st.integers(3, 6), st.data())
def test_a_truncation_is_found_with_its_kept_rank(seed: int, rank: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, rank - 1))
    parent = random_adapter(seed, rank=rank)
    for m in parent.values():  # the top-k subspace must be defined: no (near) tie at the cut
        S = torch.linalg.svdvals(m.B.double() @ m.A.double())
        assume(float(S[k - 1] - S[k]) > 1e-3 * float(S[0]))
    edge = detect_transform(update(truncate(parent, k)), update(parent, 2))
    assert edge is not None and edge.relation == "truncated"
    assert edge.kept_rank == {n: k for n in SHAPES}
    assert edge.scale == pytest.approx(1.0, rel=1e-4)
    assert edge.evidence["discarded_energy"] > 0


@settings(max_examples=25, deadline=None)
@given(seeds, st.floats(0.03, 0.6))
def test_a_magnitude_pruned_copy_is_found_with_its_sparsity(seed: int, sparsity: float) -> None:
    parent = random_adapter(seed)
    child = remake(parent, A=lambda m: prune(m.A, sparsity), B=lambda m: prune(m.B, sparsity))
    edge = detect_transform(update(child), update(parent, 3))
    assert edge is not None and edge.relation == "pruned"
    assert edge.sparsity == pytest.approx(sparsity, abs=0.02)


def with_dead_lines(raw: Raw) -> Raw:
    """As training leaves an adapter: a few rows of B exactly zero (output channels no gradient reached) and a column of
    A (a dead input)."""

    def dead_rows(m: LoraModule) -> torch.Tensor:
        B = m.B.clone()
        B[::5] = 0.0
        return B

    def dead_column(m: LoraModule) -> torch.Tensor:
        A = m.A.clone()
        A[:, 0] = 0.0
        return A

    return remake(raw, A=dead_column, B=dead_rows)


@settings(max_examples=10, deadline=None)
@given(seeds, st.floats(0.3, 0.6))  # above the dead lines' share (a fifth of B, a twentieth of A), so pruning zeroes more
def test_zeros_training_left_are_no_pruning(seed: int, sparsity: float) -> None:
    """A trained adapter's exact zeros are not read as pruning: not against a copy of it that has them too, however
    close its residual to what they predict; a pruned copy of it is found, with the share of zeros it has."""
    parent = with_dead_lines(random_adapter(seed))
    summary = update(parent).summary
    assert summary is not None and summary.pruning_residual_sq > 0
    g = torch.Generator().manual_seed(seed)
    noise = {n: tuple(torch.randn(t.shape, generator=g) * (t != 0) for t in (m.A, m.B)) for n, m in parent.items()}
    energy = sum(float((m.scale * m.B.double() @ m.A.double()).square().sum()) for m in parent.values())
    bound = math.sqrt(summary.pruning_residual_sq / energy)

    def noisy(eps: float) -> Raw:  # the same zeros, the other entries moved
        return {n: LoraModule(n, m.A + eps * noise[n][0], m.B + eps * noise[n][1], m.alpha, m.scale) for n, m in parent.items()}

    eps = 1e-3 * 0.5 * bound / transforms.fit_scale(update(noisy(1e-3)).modules(), update(parent).modules()).rho
    other = noisy(eps)  # its residual against the parent half the bound the parent's zeros predict
    assert detect_transform(update(parent), update(other, 1)) is None
    child = remake(parent, A=lambda m: prune(m.A, sparsity), B=lambda m: prune(m.B, sparsity))
    edge = detect_transform(update(child), update(parent, 3))
    assert edge is not None and edge.relation == "pruned"
    assert edge.sparsity is not None and sparsity - 0.02 <= edge.sparsity <= sparsity + summary.zero_share + 0.02


def test_a_pruned_copy_needs_its_raw_factors() -> None:
    """Stored canonical factors keep no zeros: pruning is recognized at ingest only, and else gives no edge."""
    parent = random_adapter(5)
    child = remake(parent, A=lambda m: prune(m.A, 0.3), B=lambda m: prune(m.B, 0.3))
    assert detect_transform(update(child, keep_raw=False), update(parent, 3)) is None


@settings(max_examples=20, deadline=None)
@given(seeds, st.booleans())
def test_an_identical_update_is_found_whatever_its_factorization(seed: int, keep_raw: bool) -> None:
    """The gauge freedom: B·M and M⁻¹·A (M invertible) are the same update, and rescaling them is still found."""
    parent = random_adapter(seed)
    g = torch.Generator().manual_seed(seed + 1)
    M = {n: torch.eye(3) + 0.5 * torch.randn(3, 3, generator=g) for n in SHAPES}
    assume(all(float(torch.linalg.cond(m)) < 50 for m in M.values()))
    regauged = {n: LoraModule(n, torch.linalg.solve(M[n], m.A), m.B @ M[n], m.alpha, m.scale) for n, m in parent.items()}
    edge = detect_transform(update(regauged, keep_raw=keep_raw), update(parent, 1))
    assert edge is not None and edge.relation == "identical"
    rescaled = remake(regauged, scale=lambda m: 2.0 * m.scale)
    edge = detect_transform(update(rescaled, keep_raw=keep_raw), update(parent, 1))
    assert edge is not None and edge.relation == "rescaled" and edge.scale == pytest.approx(2.0, rel=1e-5)


def test_the_parent_of_a_stored_copy_is_found_the_other_way() -> None:
    parent = random_adapter(11, rank=4)
    relations = find_relations(update(parent), [update(random_adapter(12), 1), update(truncate(parent, 2), 2)])
    assert [(e.parent, e.child, e.relation) for e in relations.transforms] == [(None, 2, "truncated")]


def test_a_query_no_candidate_shares_the_structure_of_is_not_read() -> None:
    """Every detector compares one structure: a query with no such candidate finds nothing, and its float64 modules
    (which cost as much as its sketches at real sizes) are never made."""
    query = update(random_adapter(21))
    other = {n: m for n, m in random_adapter(22).items() if n != "layers.1.fc"}
    assert find_relations(query, []) == Relations()
    assert find_relations(query, [update(other, 1)]) == Relations()
    assert find_merge(query, [update(other, 1), update(other, 2)]) is None
    never = object()
    assert query.computed("modules", lambda: never) is never  # made now, by this call: not before
    compared = update(random_adapter(21))
    assert find_relations(compared, [update(random_adapter(22), 1)]) == Relations()
    assert compared.computed("modules", lambda: never) is not never


# --- unrelated adapters -----------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seeds, st.booleans())
def test_an_unrelated_adapter_gives_no_edge(seed: int, keep_raw: bool) -> None:
    candidates = [update(random_adapter(seed + i + 1), i) for i in range(6)]
    assert_no_edge(update(random_adapter(seed), keep_raw=keep_raw), candidates)


@settings(max_examples=20, deadline=None)
@given(seeds, st.floats(2.0, 4.0))
def test_a_same_task_adapter_far_from_the_parent_gives_no_edge(seed: int, spread: float) -> None:
    """Parent + an independent perturbation of A and B `spread` times their size: similar, not related."""
    parent = random_adapter(seed)
    g = torch.Generator().manual_seed(seed + 1)
    sibling = remake(
        parent,
        A=lambda m: m.A + spread * m.A.norm() / m.A.numel() ** 0.5 * torch.randn(m.A.shape, generator=g),
        B=lambda m: m.B + spread * m.B.norm() / m.B.numel() ** 0.5 * torch.randn(m.B.shape, generator=g),
    )
    candidates = [update(parent, 0), *(update(random_adapter(seed + i + 2), i) for i in range(1, 8))]
    assert_no_edge(update(sibling), candidates)


# --- merges -----------------------------------------------------------------------------------------------


def weighted_sum(parents: list[Update], weights: list[float]) -> Update:
    """Σ w_i dW_i as one adapter whose factors are the parents' concatenated (what PEFT's `cat` writes)."""
    out = {}
    for n in SHAPES:
        fs: list[CanonicalFactors] = [p.factors[n] for p in parents]
        U = torch.cat([f.U for f in fs], dim=1)
        V = torch.cat([w * f.S[:, None] * f.V.T for f, w in zip(fs, weights, strict=True)])
        out[n] = canonicalize(V, U)
    return Update(out)


@settings(max_examples=25, deadline=None)
@given(seeds, st.lists(st.floats(0.2, 1.0), min_size=2, max_size=3), st.data())
def test_a_weighted_sum_of_candidates_is_found_with_parents_and_weights(seed: int, weights: list[float], data: st.DataObject) -> None:
    candidates = [update(random_adapter(seed + i), 100 + i, keep_raw=False) for i in range(10)]
    chosen = data.draw(st.lists(st.integers(0, 9), min_size=len(weights), max_size=len(weights), unique=True))
    merge = detect_merge(weighted_sum([candidates[i] for i in chosen], weights), candidates)
    assert merge is not None and merge.combination == "cat"
    found = dict(zip(merge.parents, merge.weights, strict=True))
    assert set(found) == {100 + i for i in chosen}
    for i, w in zip(chosen, weights, strict=True):
        assert found[100 + i] == pytest.approx(w, abs=0.05)


def test_a_merge_is_found_whatever_the_query_factorization() -> None:
    candidates = [update(random_adapter(40 + i), i, keep_raw=False) for i in range(8)]
    merged = weighted_sum([candidates[1], candidates[6]], [0.4, 0.9])
    g = torch.Generator().manual_seed(0)
    regauged = {}
    for n, f in merged.factors.items():
        M = torch.eye(f.rank) + 0.3 * torch.randn(f.rank, f.rank, generator=g)
        regauged[n] = canonicalize(torch.linalg.solve(M, f.S[:, None] * f.V.T), f.U @ M)
    a, b = detect_merge(merged, candidates), detect_merge(Update(regauged), candidates)
    assert a is not None and b is not None
    assert a.parents == b.parents and a.weights == pytest.approx(b.weights, abs=1e-4)


# --- merges made by PEFT ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peft_model() -> PeftModel:
    return peft_merge_model(20, 32, 24, 4)


@pytest.mark.parametrize("combination", ["cat", "svd", "linear"])
def test_peft_merges_are_found_with_parents_weights_and_combination(peft_model, combination: str) -> None:  # noqa: ANN001
    candidates = [peft_update(peft_model, f"a{i}", i) for i in range(8)]
    parents, weights = [2, 5, 6], [0.5, 0.3, 0.8]
    peft_model.add_weighted_adapter([f"a{i}" for i in parents], weights, f"merged_{combination}", combination_type=combination)
    merge = detect_merge(peft_update(peft_model, f"merged_{combination}"), candidates)
    assert merge is not None and merge.combination == combination
    found = dict(zip(merge.parents, merge.weights, strict=True))
    assert set(found) == set(parents)
    for i, w in zip(parents, weights, strict=True):
        assert found[i] == pytest.approx(w, abs=0.05)
    assert merge.confidence > 0.5 and merge.evidence["relative_residual"] < 1e-3


def test_a_merge_of_two_is_found_with_two_parents(peft_model) -> None:  # noqa: ANN001
    candidates = [peft_update(peft_model, f"a{i}", i) for i in range(8)]
    peft_model.add_weighted_adapter(["a1", "a3"], [1.0, 0.6], "two_linear", combination_type="linear")
    merge = detect_merge(peft_update(peft_model, "two_linear"), candidates)
    assert merge is not None and merge.combination == "linear"
    assert dict(zip(merge.parents, merge.weights, strict=True)) == {1: pytest.approx(1.0, abs=0.05), 3: pytest.approx(0.6, abs=0.05)}


def test_a_merge_is_no_continuation_of_its_parents(peft_model) -> None:  # noqa: ANN001
    """A merge that is mostly one parent looks like that parent trained further; the merge found explains it."""
    candidates = [peft_update(peft_model, f"a{i}", i) for i in range(8)]
    peft_model.add_weighted_adapter(["a1", "a3"], [1.0, 0.3], "mostly_a1", combination_type="svd", svd_rank=4)
    merged = peft_update(peft_model, "mostly_a1")
    assert detect_continuation(merged, candidates[1]) is not None  # alone, the pair passes the continuation test
    relations = find_relations(merged, candidates)
    assert relations.merge is not None and set(relations.merge.parents) == {1, 3}
    assert not {e.other for e in relations.continuations} & {1, 3}


def test_the_merge_alone_is_the_one_find_relations_finds(peft_model) -> None:  # noqa: ANN001
    """find_merge (the relation step's test again of a stored neighbour) finds find_relations' merge, and none where a
    candidate is a copy of the query."""
    candidates = [peft_update(peft_model, f"a{i}", i) for i in range(8)]
    peft_model.add_weighted_adapter(["a2", "a4"], [0.7, 0.4], "again_cat", combination_type="cat")
    merged = peft_update(peft_model, "again_cat")
    merge = find_merge(merged, candidates)
    assert merge is not None and set(merge.parents) == {2, 4} and merge == find_relations(merged, candidates).merge
    stored_copy = Update(merged.factors, id=99)
    assert find_relations(merged, [*candidates, stored_copy]).transforms and find_merge(merged, [*candidates, stored_copy]) is None


@pytest.mark.parametrize(
    ("combination", "density"),
    [("ties", 0.5), ("ties", 0.8), ("dare_linear", 0.5), ("dare_ties", 0.7), ("magnitude_prune", 0.3), ("magnitude_prune", 0.9)],
)
def test_peft_factorwise_merges_are_found_from_the_factors_as_saved(peft_model, combination: str, density: float) -> None:  # noqa: ANN001
    """PEFT prunes A and B apart, so no sum of the parents' dW is the merge's; in the factors as saved it is exact."""
    candidates = [peft_update(peft_model, f"a{i}", i, with_gauges=True) for i in range(8)]
    parents, weights = [2, 5, 6], [0.5, 0.3, 0.8]
    name = f"{combination}_{int(100 * density)}"
    torch.manual_seed(1)  # dare's draws
    peft_model.add_weighted_adapter([f"a{i}" for i in parents], weights, name, combination_type=combination, density=density)
    merged = peft_update(peft_model, name, with_gauges=True)
    merge = detect_merge(merged, candidates)
    assert merge is not None and merge.combination == combination, merge
    found = dict(zip(merge.parents, merge.weights, strict=True))
    assert set(found) == set(parents)
    for i, w in zip(parents, weights, strict=True):
        assert found[i] == pytest.approx(w, abs=0.05)
    assert merge.evidence["density"] == pytest.approx(density, abs=0.05) and merge.evidence["relative_residual"] < 1e-4
    assert merge.confidence > 0.9


def test_without_gauges_a_factorwise_merge_is_not_exact(peft_model) -> None:  # noqa: ANN001
    candidates = [peft_update(peft_model, f"a{i}", i) for i in range(8)]
    peft_model.add_weighted_adapter(["a1", "a4"], [0.6, 0.9], "ties_no_gauge", combination_type="ties", density=0.5)
    merge = detect_merge(peft_update(peft_model, "ties_no_gauge"), candidates)
    assert merge is None or merge.combination == "approximate"


def test_a_factorwise_merge_of_unrelated_adapters_names_no_parent(peft_model) -> None:  # noqa: ANN001
    """The merge's parents are left out of the candidates: the fit over the others is no merge."""
    candidates = [peft_update(peft_model, f"a{i}", i, with_gauges=True) for i in (0, 1, 3, 4, 7)]
    peft_model.add_weighted_adapter(["a2", "a5"], [0.7, 0.7], "ties_elsewhere", combination_type="ties", density=0.6)
    assert detect_merge(peft_update(peft_model, "ties_elsewhere", with_gauges=True), candidates) is None


@settings(max_examples=30, deadline=None)
@given(seed=seeds, rank=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]), batched=st.booleans())
def test_the_gauge_gives_back_the_factors_as_given(seed: int, rank: int, dtype: torch.dtype, batched: bool) -> None:
    """B = U·M and A = N·Vᵀ on both canonicalization paths, S = s·M·N; no gauge where the rank is below the factors'."""
    g = torch.Generator().manual_seed(seed)
    A, B = torch.randn(rank, 20, generator=g).to(dtype), torch.randn(24, rank, generator=g).to(dtype)
    f = canonicalize_batched([A], [B], 2.0)[0] if batched else canonicalize(A, B, 2.0)
    assert f.gauge is not None
    M, N = f.gauge
    assert torch.allclose(f.U @ M, B.float(), atol=1e-4 * float(B.float().abs().max()))
    assert torch.allclose(N @ f.V.T, A.float(), atol=1e-4 * float(A.float().abs().max()))
    raw = RawModule(f.U.double().numpy(), f.S.double().numpy(), f.V.double().numpy(), M.double().numpy(), N.double().numpy())
    assert raw.scale == pytest.approx(2.0, rel=1e-4)
    A[-1] = 0  # a rank below the factors': B's last column is not in dW
    assert (canonicalize_batched([A], [B], 2.0)[0] if batched else canonicalize(A, B, 2.0)).gauge is None


def test_raw_sketches_are_near_for_shared_factors_and_far_otherwise() -> None:
    """A continuation keeps A (near in the raw sketches though its dW turned), an unrelated adapter shares nothing, and
    the same entries are read from every adapter of one rank."""
    parent, other = random_adapter(1, rank=4), random_adapter(2, rank=4)
    child = remake(parent, B=lambda m: m.B + 2 * torch.randn_like(m.B) * m.B.std())  # B learnt anew, A as it was
    modules = [(n, o, i) for n, (o, i) in SHAPES.items()]

    def sketch(raw: Raw) -> np.ndarray:
        v = raw_sketches([{n: canonicalize(m.A, m.B, m.scale) for n, m in raw.items()}], modules, raw_width(len(modules)))[0]
        return v / np.linalg.norm(v)

    p, c, u = sketch(parent), sketch(child), sketch(other)
    assert p @ c > 0.4 and abs(p @ u) < 0.25
    assert p @ sketch(remake(parent, scale=lambda m: 3 * m.scale)) == pytest.approx(1.0, abs=1e-5)  # alpha changed: the same factors


# --- continuations ------------------------------------------------------------------------------------------


def trained_further(raw: Raw, seed: int, growth: float) -> Raw:
    """More steps of the same run: B grows along and beside its direction, A drifts a little from its init."""
    g = torch.Generator().manual_seed(seed)
    return remake(
        raw,
        A=lambda m: m.A + 0.05 * m.A.norm() / m.A.numel() ** 0.5 * torch.randn(m.A.shape, generator=g),
        B=lambda m: growth * m.B + 0.3 * m.B.norm() / m.B.numel() ** 0.5 * torch.randn(m.B.shape, generator=g),
    )


@settings(max_examples=20, deadline=None)
@given(seeds, st.floats(1.3, 3.0))
def test_a_continuation_is_found_with_its_direction(seed: int, growth: float) -> None:
    parent = random_adapter(seed)
    child = trained_further(parent, seed + 1, growth)
    forward = detect_continuation(update(child), update(parent, 1))
    backward = detect_continuation(update(parent), update(child, 2))
    assert forward is not None and backward is not None
    assert forward.query_is_later and not backward.query_is_later
    assert forward.direction_confidence > 0.5 and 0.0 <= forward.confidence <= 1.0
    votes = {v.name: v for v in forward.votes}
    assert votes["norm"].query_is_later and votes["norm"].query > votes["norm"].candidate
    assert {"norm", "kurtosis", "stable_rank", "spectral_norm"} <= votes.keys()
    relations = find_relations(update(child), [update(parent, 1), *(update(random_adapter(seed + i + 2), i + 2) for i in range(4))])
    assert [e.other for e in relations.continuations] == [1] and relations.merge is None and not relations.transforms
    assert_confidences(relations)


def trained_on_another_task(raw: Raw, seed: int) -> Raw:
    """The run resumed on another task: B learns anew (its direction unrelated to the parent's), A drifts a little."""
    g = torch.Generator().manual_seed(seed)
    return remake(
        raw,
        A=lambda m: m.A + 0.05 * m.A.norm() / m.A.numel() ** 0.5 * torch.randn(m.A.shape, generator=g),
        B=lambda m: 2.0 * m.B.norm() / m.B.numel() ** 0.5 * torch.randn(m.B.shape, generator=g),
    )


@settings(max_examples=20, deadline=None)
@given(seeds)
def test_a_continuation_on_another_task_is_found_from_the_rows_it_shares(seed: int) -> None:
    """dW's direction is new (cosine near 0), but A's rows are the parent's: a continuation, later than the parent."""
    parent = random_adapter(seed)
    child = trained_on_another_task(parent, seed + 1)
    candidates = [update(parent, 1), *(update(random_adapter(seed + i + 2), i + 2) for i in range(4))]
    relations = find_relations(update(child), candidates)
    assert [(e.other, e.query_is_later) for e in relations.continuations] == [(1, True)]
    edge = relations.continuations[0]
    assert abs(edge.evidence["module_cosine"]) < 0.5 and edge.evidence["shared_rows"] > 0.9
    assert shared_rows(update(child).modules(), update(random_adapter(seed + 9)).modules()) < MIN_SHARED_ROWS


@pytest.mark.parametrize("seed", range(5))
def test_a_child_keeps_one_parent_the_one_it_shares_most_rows_with(seed: int) -> None:
    """A sibling further along the same run (its A drifted more) is also earlier than the child and shares its rows;
    the child is the continuation of the parent only."""
    parent = random_adapter(seed)
    g = torch.Generator().manual_seed(seed + 100)
    sibling = remake(parent, A=lambda m: m.A + 0.3 * m.A.norm() / m.A.numel() ** 0.5 * torch.randn(m.A.shape, generator=g))
    child = trained_further(parent, seed + 1, 3.0)
    relations = find_relations(update(child), [update(sibling, 2), update(parent, 1)])
    assert [(e.other, e.query_is_later) for e in relations.continuations] == [(1, True)]


@pytest.mark.parametrize("seed", range(5))
def test_of_a_parent_and_its_stored_copy_the_first_stored_is_named(seed: int) -> None:
    """A run resumed from a magnitude-pruned copy of its root shares its rows with both, a little more with the copy;
    the weights cannot tell which it was resumed from, so it is named the continuation of the first stored (the root),
    as a merge of either is named. Stored the other way round, the copy is the first stored and is named."""
    root = random_adapter(seed)
    copy = remake(root, A=lambda m: prune(m.A, 0.1), B=lambda m: prune(m.B, 0.1))
    child = update(trained_on_another_task(copy, seed + 1))
    scores = {i: origin_score(e.evidence) for i, c in ((1, root), (2, copy)) if (e := detect_continuation(child, update(c, i)))}
    assert scores.keys() == {1, 2} and scores[2] > scores[1]  # both pass; the copy scores higher
    relations = find_relations(child, [update(copy, 2), update(root, 1), *(update(random_adapter(seed + i + 9), i + 3) for i in range(3))])
    assert [(e.other, e.query_is_later) for e in relations.continuations] == [(1, True)]
    relations = find_relations(child, [update(copy, 1), update(root, 2)])
    assert [(e.other, e.query_is_later) for e in relations.continuations] == [(1, True)]


def test_rows_tell_nothing_where_a_rank_covers_half_the_inputs() -> None:
    """With rank ≥ half a module's inputs any two row spaces overlap by chance: shared_rows gives None there."""
    wide = random_adapter(3, rank=13)  # 13 of 20 and 24 inputs
    assert shared_rows(update(wide).modules(), update(random_adapter(4, rank=13)).modules()) is None


def test_a_copy_is_no_continuation() -> None:
    parent = random_adapter(9)
    assert detect_continuation(update(cast(parent, torch.bfloat16)), update(parent, 1)) is None
    assert detect_continuation(update(random_adapter(10)), update(parent, 1)) is None


def test_adapters_of_another_structure_are_not_compared() -> None:
    parent = random_adapter(1)
    other_rank = random_adapter(1, rank=5)
    assert detect_transform(update(other_rank), update(parent, 1)) is None
    assert detect_continuation(update(other_rank), update(parent, 1)) is None
    fewer = {n: m for n, m in parent.items() if n != "layers.1.fc"}
    assert find_relations(update(fewer), [update(parent, 1)]) == Relations()
    assert math.isfinite(expected_cast_residual("bf16"))
