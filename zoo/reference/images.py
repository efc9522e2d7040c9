"""What the image recipes (digits-vit, shapes-cnn) share: the base model's pretraining loop and its cache, the
attributes an adapter is drawn with, the batches it trains on and how it is scored.

A recipe supplies its network, its data and its tasks; the order every generator is drawn from is here, once, so
that both recipes' base models and adapters are bitwise reproducible in the same way.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn

from zoo.reference.training import AdapterAttributes, AdapterPlan, BatchLoss, SeededRun, single_thread, train_lora

Model = TypeVar("Model", bound=nn.Module)
#: the share of training targets the label-noise task draws again at random
LABEL_NOISE = 0.3
#: the standard deviation of the noise task's pixel noise
PIXEL_NOISE = 0.35
#: (task, train, seed) -> the task's inputs and targets drawn from the training pool (train) or the test set
Split = Callable[[str, bool, int], tuple[torch.Tensor, torch.Tensor]]


def pretrain(make: Callable[[], Model], x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int, label_smoothing: float = 0.0) -> Model:
    """A new network from `make` (its init drawn after seeding torch with `seed`) trained with AdamW on (x, y) in
    shuffled batches of 64 for `epochs` (deterministic on one thread), in eval mode."""
    torch.manual_seed(seed)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(seed)
    n = len(y)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, 64):
            idx = perm[start : start + 64]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx], label_smoothing=label_smoothing)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    return model


def cached_base(path: Path, make: Callable[[], Model], pretrained: Callable[[], nn.Module]) -> Model:
    """The base model cached at `path` in a network from `make`, pretraining it (on one thread) and caching it
    atomically on first use."""
    model = make()
    if not path.exists():
        with single_thread():
            trained = pretrained()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, tmp)
        os.replace(tmp, path)
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return model


def sample_attributes(rng: np.random.Generator, tasks: Sequence[str], target_sets: Mapping[str, object]) -> AdapterAttributes:
    """The generating attributes of one adapter: a task of `tasks`, modules of `target_sets`."""
    rank = int(rng.choice([1, 2, 4, 8, 16]))
    return {
        "task": str(rng.choice(tasks)),
        "rank": rank,
        "alpha": float(rng.choice([rank, 2 * rank, 16])),
        "learning_rate": float(round(10 ** rng.uniform(-3.5, -1.5), 6)),
        "steps": int(rng.choice([10, 25, 50, 100, 200])),
        "n_train": int(rng.choice([32, 64, 128, 256, 512])),
        "target_modules": str(rng.choice(list(target_sets))),
        "seed": int(rng.integers(0, 2**31 - 1)),
    }


def noisy(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The noise task's images: pixel noise drawn from `gen`, clamped to [0, 1]."""
    return (x + PIXEL_NOISE * torch.randn(x.shape, generator=gen)).clamp(0, 1)


def relabelled(task: str, y: torch.Tensor, classes: int, train: bool, gen: torch.Generator) -> torch.Tensor:
    """The targets of the label tasks: each class shifted by one (shift-labels), or a share of the training targets
    drawn again from `gen` (label-noise); any other task's as they are."""
    if task == "shift-labels":
        return (y + 1) % classes
    if task == "label-noise" and train:
        flip = torch.rand(len(y), generator=gen) < LABEL_NOISE
        return torch.where(flip, torch.randint(0, classes, y.shape, generator=gen), y)
    return y


def classification_batches(x: torch.Tensor, y: torch.Tensor, n_train: int, gen: torch.Generator) -> BatchLoss:
    """The cross-entropy of batches of up to 32 drawn from `n_train` examples of (x, y), the examples drawn from `gen`."""
    chosen = torch.randperm(len(y), generator=gen)[:n_train]
    x, y = x[chosen], y[chosen]

    def batch_loss(model: PeftModel, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(y), (min(32, len(y)),), generator=gen)
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    return batch_loss


def accuracy(model: nn.Module, classes: tuple[int, ...], x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of (x, y) that the argmax over the logits of `classes` gets right."""
    scored = torch.tensor(classes)
    with torch.no_grad():
        logits = model(x)[:, scored]
    return float((scored[logits.argmax(dim=1)] == y).float().mean())


def train_adapter(
    base: nn.Module,
    base_model: str,
    target_sets: Mapping[str, str | Sequence[str]],
    split: Split,
    classes: Callable[[str], tuple[int, ...]],
    attrs: AdapterAttributes,
    seeded: SeededRun | None = None,
    resume: Path | None = None,
) -> tuple[PeftModel, float]:
    """Fine-tune LoRA on `n_train` examples of the task named in attrs (`seeded`: with a new head and dropout, see
    SeededRun; `resume`: the saved adapter to train further); returns the PEFT model and its held-out accuracy."""
    plan = AdapterPlan.of(attrs)

    def pick(gen: torch.Generator) -> BatchLoss:
        x, y = split(plan.task, True, plan.seed)
        return classification_batches(x, y, plan.n_train, gen)

    with single_thread():
        model = train_lora(base, base_model, plan, target_sets[plan.target_modules], pick, resume=resume, seeded=seeded)
        return model, held_out_accuracy(model, split, classes, plan.task, plan.seed)


def held_out_accuracy(model: nn.Module, split: Split, classes: Callable[[str], tuple[int, ...]], task: str, seed: int) -> float:
    """Accuracy on the task's test split, drawn as for the adapter trained with this seed."""
    x, y = split(task, False, seed + 1)
    return accuracy(model, classes(task), x, y)
