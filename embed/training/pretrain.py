"""Self-supervised pretraining of W2T: its cosine taught to rank a batch's adapters as an exact score does
(embed.training.distill), on every adapter, labelled or not; the members of a training then start from these weights."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
from tqdm import tqdm

from embed.data.tokens import Batch, n_rows, select, to_device, tokens_per_adapter
from embed.selection.metrics import retrieval
from embed.training.distill import distillation_loss, rotate_outputs, token_kernel
from embed.training.train_options import TrainOptions
from embed.training.views import VIEW_NOISE, augment, module_view, readout_scale
from embed.w2t.ensemble import batch_rows
from embed.w2t.model import W2T, W2TConfig

#: pretraining views rescale dW by e^c, c ~ U(-PRETRAIN_RESCALE, PRETRAIN_RESCALE)
PRETRAIN_RESCALE = 1.0
#: multiply-adds the pretraining target may take (n² pairs × modules × rank² × width): fewer adapters are drawn where
#: pretrain_adapters of them would take more (300 digits-vit adapters: 6·10¹⁰; at Llama-3-8B r16, projected: 101 adapters)
PRETRAIN_KERNEL_MACS = 3 * 10**11


def pretraining_rows(tokens: Batch, most: int) -> int:
    """How many adapters pretraining draws: at most `most`, and as many as PRETRAIN_KERNEL_MACS allows (at least 2)."""
    per_pair = sum(int(t.mask.shape[1] * t.mask.shape[2] ** 2 * (t.u.shape[-1] + t.v.shape[-1])) for t in tokens.values())
    return max(2, min(most, n_rows(tokens), math.isqrt(PRETRAIN_KERNEL_MACS // max(1, per_pair))))


def favoured_score(tokens: Batch, tasks: list[str]) -> str:
    """The exact score (dw, module, input_gram) that retrieves the tasks best among the rows with one: each queries
    the others, scored by MRR + nDCG@10; dW cosine where fewer than two rows have a task."""
    rows = [r for r, t in enumerate(tasks) if t]
    if len(rows) < 2:
        return "dw"
    labelled = select(tokens, torch.tensor(rows))
    labels = [tasks[r] for r in rows]
    quality = {}
    for score in ("dw", "module", "input_gram"):
        got = retrieval(token_kernel(labelled, score).numpy(), labels, labels, list(range(len(rows))))
        quality[score] = got["mrr"] + got["ndcg@10"]
    return max(quality, key=lambda s: quality[s])


#: pretrained weights and the record of how they were made (embed.training.pretrain.pretrain)
Pretrained = tuple[dict[str, torch.Tensor], dict[str, object]]


def pretrain(
    config: W2TConfig, tokens: Batch, tasks: list[str], options: TrainOptions, device: torch.device, progress: bool = False
) -> Pretrained:
    """Self-supervised pretraining on the rows of `tokens` (at most options.pretrain_adapters of them and
    PRETRAIN_KERNEL_MACS' worth, drawn with the seed), labelled or not: options.pretrain_epochs epochs of the
    distillation loss (embed.training.distill) between the W2T cosines of a batch and the exact score options.pretrain_score
    among its adapters (`tasks`, "" where unknown, pick it where "auto"). (weights, what was done: score, epochs,
    views, the mean loss on plain views before and after)."""
    torch.manual_seed(options.seed)
    gen = torch.Generator().manual_seed(options.seed)
    rows = torch.randperm(n_rows(tokens), generator=gen)[: pretraining_rows(tokens, options.pretrain_adapters)].sort().values
    tokens = select(tokens, rows)
    score = favoured_score(tokens, [tasks[r] for r in rows.tolist()]) if options.pretrain_score == "auto" else options.pretrain_score
    kernel = token_kernel(tokens, score).float()
    model = W2T(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    size = batch_rows(tokens_per_adapter(tokens), options.batch_size)
    views = replace(options, augment_rescale=PRETRAIN_RESCALE)
    rotate = options.pretrain_augment and score == "input_gram"
    before = _distillation_on(model, tokens, kernel, size, options.temperature, device)
    bar = tqdm(range(options.pretrain_epochs), desc=f"pretrain w2t (distil {score})", unit="epoch", disable=not progress)
    for _ in bar:
        model.train()
        order = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            if len(idx) < 2:
                continue
            batch, scale = module_view(tokens, idx, options.step_rank_tokens, gen)
            factor, noise = None, 0.0
            if options.pretrain_augment:
                batch, factor = augment(batch, gen, views, contrastive_view=True)
                batch = rotate_outputs(batch, gen) if rotate else batch
                noise = VIEW_NOISE
            z = model(to_device(batch, device), noise=noise, generator=gen, readout_scale=readout_scale(scale, factor, device))
            loss = distillation_loss(z, kernel[idx][:, idx], options.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
    after = _distillation_on(model, tokens, kernel, size, options.temperature, device)
    info: dict[str, object] = {
        "score": score,
        "epochs": options.pretrain_epochs,
        "adapters": len(rows),
        "augment": options.pretrain_augment,
        "rotate_outputs": rotate,
        "loss_before": before,
        "loss_after": after,
    }
    return copy.deepcopy(model.state_dict()), info


@torch.no_grad()
def _distillation_on(model: W2T, tokens: Batch, kernel: torch.Tensor, size: int, temperature: float, device: torch.device) -> float:
    """The mean distillation loss of plain views over consecutive batches of `size` rows (a fixed measure for
    before and after)."""
    model.eval()
    n = n_rows(tokens)
    parts = []
    for start in range(0, n, size):
        idx = torch.arange(start, min(n, start + size))
        if len(idx) >= 2:
            z = model(to_device(select(tokens, idx), device))
            parts.append(float(distillation_loss(z, kernel[idx][:, idx], temperature)))
    return sum(parts) / max(1, len(parts))
