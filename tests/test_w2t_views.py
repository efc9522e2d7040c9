"""W2T's training views: mixes of two adapters of a task, dropped modules, rescaled updates (embed/training/train.py)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embed.data.tokens import Batch, TypeTokens
from embed.data.types import schema_of
from embed.training.train import rows_for_epoch, train_w2t
from embed.training.train_options import TrainOptions
from embed.training.views import augment, mix, mix_partners, module_dropout
from tests.test_embed import synthetic_zoo


def canonical_tokens(rows: int, modules: int, rank: int, out: int, inp: int, ranks: torch.Tensor, gen: torch.Generator) -> TypeTokens:
    """Tokens of random canonical factors padded to `rank`: orthonormal u and v, σ descending, each (row, module) of
    its own rank (at most the narrower side)."""
    k = min(rank, out, inp)
    pad = (0, 0, 0, rank - k)
    u = torch.nn.functional.pad(torch.linalg.qr(torch.randn(rows, modules, out, k, generator=gen))[0].transpose(-1, -2), pad)
    v = torch.nn.functional.pad(torch.linalg.qr(torch.randn(rows, modules, inp, k, generator=gen))[0].transpose(-1, -2), pad)
    sigma = (torch.rand(rows, modules, rank, generator=gen) + 0.05).sort(dim=-1, descending=True).values
    mask = torch.arange(rank) < ranks.clamp(max=k)[..., None]
    u, v = u * mask[..., None], v * mask[..., None]
    return TypeTokens(u, v, torch.log(sigma).masked_fill(~mask, 0.0), mask, torch.arange(modules), torch.arange(modules))


def update(tok: TypeTokens) -> torch.Tensor:
    """Each (row, module)'s dW = Σ σ_i u_i v_iᵀ."""
    sigma = tok.log_sigma.exp() * tok.mask
    return (tok.u.transpose(-1, -2) * sigma[..., None, :]) @ tok.v


@settings(max_examples=40, deadline=None)
@given(
    rank=st.integers(1, 6),
    out=st.integers(2, 10),
    inp=st.integers(2, 10),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_a_mix_is_the_best_low_rank_form_of_the_mixed_update(rank: int, out: int, inp: int, lam: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, modules = 3, 2
    ranks = torch.randint(0, rank + 1, (2, rows, modules), generator=gen)
    a = canonical_tokens(rows, modules, rank, out, inp, ranks[0], gen)
    b = canonical_tokens(rows, modules, rank, out, inp, ranks[1], gen)
    lams = torch.tensor([lam, 1.0, 0.0])
    mixed = mix({"t": a}, {"t": b}, lams)["t"]
    target = lams[:, None, None, None] * update(a) + (1 - lams)[:, None, None, None] * update(b)
    # Eckart–Young: the best rank-`rank` approximation of the mixed update, whatever the two factorizations were
    left, sigma, right = torch.linalg.svd(target.double(), full_matrices=False)
    k = min(rank, sigma.shape[-1])
    best = (left[..., :k] * sigma[..., None, :k]) @ right[..., :k, :]
    assert torch.allclose(update(mixed).double(), best, atol=1e-4)
    # canonical again: σ descending over the real components, u and v orthonormal there
    s = mixed.log_sigma.exp() * mixed.mask
    assert bool((s[..., :-1] >= s[..., 1:] - 1e-6).all())
    gram = mixed.u @ mixed.u.transpose(-1, -2)
    eye = torch.diag_embed(mixed.mask.float())
    assert torch.allclose(gram, eye, atol=1e-4)
    # λ = 1 gives back the row's own update, λ = 0 its mate's
    assert torch.allclose(update(mixed)[1], update(a)[1], atol=1e-5)
    assert torch.allclose(update(mixed)[2], update(b)[2], atol=1e-5)


def two_types(rows: int, gen: torch.Generator) -> Batch:
    ranks = torch.randint(0, 4, (rows, 5), generator=gen)
    ranks[0] = 0
    ranks[0, 3] = 2  # an adapter with one module only
    return {
        "a": canonical_tokens(rows, 3, 3, 5, 4, ranks[:, :3], gen),
        "b": canonical_tokens(rows, 2, 3, 6, 5, ranks[:, 3:], gen),
    }


@given(share=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_module_dropout_drops_only_present_modules_and_keeps_one(share: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = two_types(8, gen)
    dropped, factor = module_dropout(batch, gen, share)
    if not share:
        assert dropped == {} and factor is None
        return
    assert factor is not None
    present = {t: tok.mask.any(dim=-1) for t, tok in batch.items()}
    have = sum(p.sum(dim=1) for p in present.values())
    kept = sum((present[t] & ~dropped[t]).sum(dim=1) for t in batch)
    assert all(bool((dropped[t] <= present[t]).all()) for t in batch)  # never a module the adapter lacks
    assert bool((kept >= torch.clamp(have, max=1)).all())
    assert torch.allclose(factor, have.float() / kept.clamp_min(1).float())


def test_a_view_keeps_the_whole_adapters_norm_and_rescales_only_sigma() -> None:
    gen = torch.Generator().manual_seed(3)
    batch = two_types(16, gen)
    options = TrainOptions(augment_rescale=1.0, augment_module_dropout=0.9)
    view, factor = augment(batch, torch.Generator().manual_seed(0), options, contrastive_view=True)
    assert factor is not None
    for t, tok in view.items():
        before = batch[t]
        assert bool((tok.mask <= before.mask).all())
        assert torch.equal(tok.u, before.u) and torch.equal(tok.v, before.v)
        # one scale per adapter: log σ moved by the same amount on every kept component, norms by its exponential
        shift = (tok.log_sigma - before.log_sigma).masked_fill(~tok.mask, float("nan"))
        assert tok.norms is not None
        scale = tok.norms / before.sigma_norms()
        for row in range(len(shift)):
            values = shift[row][~torch.isnan(shift[row])]
            if len(values):
                assert torch.allclose(values, values[0].expand_as(values), atol=1e-5)
                assert abs(float(values[0].exp()) - float(scale[row])) < 1e-4
                assert abs(float(values[0])) <= 1.0 + 1e-6


def test_mates_are_other_training_adapters_of_the_same_task() -> None:
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 0])
    train = torch.tensor([0, 1, 2, 3, 5, 6])
    rows = torch.tensor([0, 1, 3, 5, 6])
    for seed in range(20):
        mates = mix_partners(rows, train, groups, 1.0, torch.Generator().manual_seed(seed))
        for r, m in zip(rows.tolist(), mates.tolist(), strict=True):
            if m < 0:
                assert r in (3, 5, 6)  # no other training adapter of its task (7 is held out)
            else:
                assert m != r and m in train.tolist() and groups[m] == groups[r]
        assert bool((mates[:2] >= 0).all())
    assert bool((mix_partners(rows, train, groups, 0.0, torch.Generator()) < 0).all())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), labelled_share=st.floats(0.0, 1.0), ratio=st.floats(0.0, 3.0), seed=st.integers(0, 2**16))
def test_an_epoch_keeps_every_labelled_row_and_draws_a_bounded_share_of_the_rest(
    n: int, labelled_share: float, ratio: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    has_target = torch.rand(2 * n, generator=gen) < labelled_share
    rows = torch.randperm(2 * n, generator=gen)[:n]
    drawn = rows_for_epoch(rows, has_target, ratio, torch.Generator().manual_seed(seed))
    got, labelled = set(drawn.tolist()), {r for r in rows.tolist() if has_target[r]}
    assert len(got) == len(drawn) and got <= set(rows.tolist())  # no row twice, none from outside
    if labelled:
        assert labelled <= got
        unlabelled = len(got - labelled)
        assert unlabelled == min(n - len(labelled), int(np.ceil(ratio * len(labelled))))
    else:  # nothing to bound by: every row
        assert got == set(rows.tolist())
    assert torch.equal(rows_for_epoch(rows, has_target, None, gen), rows)


def test_training_with_every_view_learns_the_tasks() -> None:
    zoo = synthetic_zoo(n_per_task=10, tasks=3, seed=1)
    schema = schema_of("synthetic", zoo)
    options = TrainOptions(epochs=6, seed=0, members=1, augment_rescale=1.0, augment_module_dropout=0.5, augment_mixup=0.5)
    emb = train_w2t(zoo, schema, options, progress=False)
    z = emb.embed(zoo)
    tasks = np.array([a.labels["task"] for a in zoo])
    sim = z @ z.T
    np.fill_diagonal(sim, -np.inf)
    assert float(np.mean(tasks[sim.argmax(axis=1)] == tasks)) >= 0.9
