"""W2T v2: second-order Gram sketches (embed/w2t/model.py), the exact kernels from tokens that pretraining distills and its
re-seeded-head view (embed/training/distill.py), pretraining (embed/training/train.py), and checkpoints from before still embedding the
same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embed.data.dataset import ExactScores
from embed.data.tokens import TypeTokens, max_rank, tokenize
from embed.data.types import schema_of
from embed.training.distill import distillation_loss, rotate_outputs, token_kernel
from embed.training.train import train_w2t
from embed.training.train_options import TrainOptions
from embed.w2t.ensemble import W2TEnsemble
from embed.w2t.model import W2T, W2TConfig
from tests.test_embed import synthetic_zoo
from tests.test_w2t_views import canonical_tokens

V1_CHECKPOINT = Path(__file__).parent / "data" / "w2t_v1_checkpoint"


def gram_blocks(model: W2T, tok: TypeTokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first-order sketch, input Gram sketch, output Gram sketch) of every module, as the model reads them out."""
    with torch.no_grad():
        sketch = model.module_tokens("t", tok)[2]
    k2 = model.config.outer_dim**2
    return sketch[..., :k2], sketch[..., k2 : 2 * k2], sketch[..., 2 * k2 :]


def orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0].float()


@settings(max_examples=15, deadline=None)
@given(rank=st.integers(1, 5), out=st.integers(2, 9), inp=st.integers(2, 9), log_c=st.floats(-4.0, 4.0), seed=st.integers(0, 2**16))
def test_gram_sketches_ignore_the_output_side_signs_and_scale(rank: int, out: int, inp: int, log_c: float, seed: int) -> None:
    """The input Gram sketch is unchanged by u → Q u (orthogonal Q), both Gram sketches by the joint sign flips
    (u_i, v_i) → (−u_i, −v_i) and by dW → c·dW, and each is Σ_i s_i² (P x_i)(P x_i)ᵀ·width, s_i² = σ_i² / Σ σ²."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = W2T(W2TConfig({"t": (out, inp)}, n_layers=2, n_modules=2, dim=8, embed_dim=8, outer_dim=3, heads=2, gram_sketches=True))
    tok = canonical_tokens(2, 2, rank, out, inp, torch.randint(1, rank + 1, (2, 2), generator=gen), gen)
    first, gram_in, gram_out = gram_blocks(model, tok)

    q = orthogonal(out, gen)
    turned = TypeTokens(tok.u @ q.T, tok.v, tok.log_sigma, tok.mask, tok.layers, tok.groups)
    assert torch.allclose(gram_blocks(model, turned)[1], gram_in, atol=1e-5)

    signs = torch.where(torch.rand(tok.mask.shape, generator=gen) < 0.5, -1.0, 1.0)[..., None]
    flipped = TypeTokens(tok.u * signs, tok.v * signs, tok.log_sigma, tok.mask, tok.layers, tok.groups)
    for got, want in zip(gram_blocks(model, flipped), (first, gram_in, gram_out), strict=True):
        assert torch.allclose(got, want, atol=1e-5)

    scaled = TypeTokens(tok.u, tok.v, (tok.log_sigma + log_c).masked_fill(~tok.mask, 0.0), tok.mask, tok.layers, tok.groups)
    for got, want in zip(gram_blocks(model, scaled), (first, gram_in, gram_out), strict=True):
        assert torch.allclose(got, want, atol=1e-4 * (1 + float(want.abs().max())))

    s2 = (tok.log_sigma.exp() * tok.mask).pow(2)
    s2 = s2 / s2.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        b = model.proj_v["t"](tok.v) * inp**0.5
    want_in = torch.einsum("bmr,bmri,bmrj->bmij", s2, b, b).flatten(-2)
    assert torch.allclose(gram_in, want_in, atol=1e-4 * (1 + float(want_in.abs().max())))


def test_token_kernels_are_the_exact_scores_and_the_input_gram_ignores_a_rotated_output_side() -> None:
    zoo = synthetic_zoo(n_per_task=4, tasks=3, seed=1)
    tokens = tokenize(zoo, schema_of("s", zoo), max_rank(zoo))
    exact = ExactScores.of_factors(zoo).scores
    for score in ("dw", "module", "input_gram"):
        assert np.allclose(token_kernel(tokens, score).numpy(), exact[score], atol=1e-5)
    turned = rotate_outputs(tokens, torch.Generator().manual_seed(0))
    assert torch.allclose(token_kernel(turned, "input_gram"), token_kernel(tokens, "input_gram"), atol=1e-5)
    assert not torch.allclose(token_kernel(turned, "dw"), token_kernel(tokens, "dw"), atol=1e-2)  # it is a nuisance
    with pytest.raises(ValueError, match="unknown exact score"):
        token_kernel(tokens, "spectrum")


def test_the_distillation_loss_is_least_when_the_cosines_rank_as_the_target() -> None:
    gen = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(12, 6, generator=gen), dim=-1)
    agreeing = z @ z.T
    assert float(distillation_loss(z, agreeing, 0.1)) < float(distillation_loss(z, -agreeing, 0.1))


def test_pretraining_lowers_the_distillation_loss_and_is_kept_in_the_checkpoint(tmp_path: Path) -> None:
    zoo = synthetic_zoo(n_per_task=6, tasks=3, seed=2)
    unlabelled = [type(a)(a.id, a.name, a.factors, {}, {}, a.source_uri) if i % 2 else a for i, a in enumerate(zoo)]
    options = TrainOptions(epochs=1, members=1, dim=16, gram_sketches=True, pretrain_epochs=6, pretrain_score="input_gram")
    emb = train_w2t(unlabelled, schema_of("s", zoo), options, progress=False)
    done = emb.config.pretraining
    assert done["score"] == "input_gram" and done["adapters"] == len(zoo) and done["rotate_outputs"]
    assert float(done["loss_after"]) < 0.8 * float(done["loss_before"])  # type: ignore[arg-type]
    emb.save(tmp_path / "ckpt")
    loaded = W2TEnsemble.load(tmp_path / "ckpt")
    assert loaded.config.gram_sketches and loaded.config.pretraining == done
    assert np.allclose(loaded.embed(zoo), emb.embed(zoo), atol=1e-6)


def test_a_checkpoint_from_before_gram_sketches_loads_and_embeds_as_it_did() -> None:
    """tests/data/w2t_v1_checkpoint was written before Gram sketches and pretraining, with the embeddings it gave."""
    zoo = synthetic_zoo(n_per_task=5, tasks=2, seed=3)
    loaded = W2TEnsemble.load(V1_CHECKPOINT, device="cpu")
    assert not loaded.config.gram_sketches and loaded.config.pretraining == {}
    assert np.allclose(loaded.embed(zoo), np.load(V1_CHECKPOINT / "embeddings.npy"), atol=1e-5)
