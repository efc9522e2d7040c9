"""The `digits-vit` reference zoo: a tiny ViT pretrained on scikit-learn's handwritten digits,
and LoRA adapters fine-tuned with PEFT on tasks derived from the same images.

Data: the 1,797 8×8 digits shipped with scikit-learn, split once (seeded) into a training pool
and a held-out test set. The base model is pretrained on the training pool only; adapters
train on samples of the training pool and are scored on the test set, which no adapter and
not the base ever trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from torch import nn

from zoo.reference import images
from zoo.reference.training import AdapterAttributes, SeededRun

BASE_MODEL = "zoo/digits-vit"
BASE_VERSION = "v1"
IMAGE, PATCH, DIM, DEPTH, HEADS, MLP_DIM, CLASSES = 8, 2, 48, 4, 4, 96, 10
TEST_FRACTION = 0.3
SPLIT_SEED = 20261122


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM)
        self.v_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, HEADS, DIM // HEADS).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(n, t, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, MLP_DIM)
        self.fc2 = nn.Linear(MLP_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class DigitsViT(nn.Module):
    """Patches of 2×2 pixels, a class token, DEPTH pre-norm blocks, a 10-way head."""

    def __init__(self) -> None:
        super().__init__()
        n_patches = (IMAGE // PATCH) ** 2
        self.patch_embed = nn.Linear(PATCH * PATCH, DIM)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        p = images.view(n, IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH).permute(0, 1, 3, 2, 4).reshape(n, -1, PATCH * PATCH)
        x = torch.cat([self.cls_token.expand(n, -1, -1), self.patch_embed(p)], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


@dataclass(frozen=True)
class DigitsData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    train_index: np.ndarray  # row numbers in scikit-learn's digits
    test_index: np.ndarray


def load_data() -> DigitsData:
    """scikit-learn's digits in [0, 1], split once into a training pool and a held-out test set."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = int(round(TEST_FRACTION * len(labels)))
    test_index, train_index = np.sort(order[:n_test]), np.sort(order[n_test:])
    return DigitsData(images[train_index], labels[train_index], images[test_index], labels[test_index], train_index, test_index)


# ---- tasks ---------------------------------------------------------------------------------

PAIRS = ((3, 8), (1, 7), (4, 9), (5, 6), (0, 6), (2, 7))
SUBSETS = {"even": (0, 2, 4, 6, 8), "odd": (1, 3, 5, 7, 9), "low": (0, 1, 2, 3, 4), "high": (5, 6, 7, 8, 9)}
TRANSFORMS = ("rot90", "rot180", "flip", "invert", "noise")
TASKS: tuple[str, ...] = (
    *(f"pair-{a}-{b}" for a, b in PAIRS),
    *(f"subset-{k}" for k in SUBSETS),
    *TRANSFORMS,
    "shift-labels",
    "label-noise",
)


def task_classes(task: str) -> tuple[int, ...]:
    """Classes the task is scored on (argmax over these logits)."""
    if task.startswith("pair-"):
        return tuple(int(c) for c in task.split("-")[1:])
    if task.startswith("subset-"):
        return SUBSETS[task.removeprefix("subset-")]
    return tuple(range(CLASSES))


def _transform(task: str, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if task == "rot90":
        return torch.rot90(x, 1, dims=(1, 2))
    if task == "rot180":
        return torch.rot90(x, 2, dims=(1, 2))
    if task == "flip":
        return torch.flip(x, dims=(2,))
    if task == "invert":
        return 1.0 - x
    if task == "noise":
        return images.noisy(x, gen)
    return x


def task_split(task: str, x: torch.Tensor, y: torch.Tensor, train: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's inputs and targets derived from (x, y); label noise only on training targets."""
    if task not in TASKS:
        raise ValueError(f"unknown digits task {task!r}; known: {', '.join(TASKS)}")
    gen = torch.Generator().manual_seed(seed)
    keep = torch.isin(y, torch.tensor(task_classes(task)))
    x, y = x[keep], y[keep]
    x = _transform(task, x, gen)
    return x, images.relabelled(task, y, CLASSES, train, gen)


def splits(data: DigitsData) -> images.Split:
    """The tasks' splits of these digits: of the training pool, or of the test set."""

    def split(task: str, train: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (data.train_x, data.train_y) if train else (data.test_x, data.test_y)
        return task_split(task, x, y, train, seed)

    return split


def accuracy(model: nn.Module, task: str, x: torch.Tensor, y: torch.Tensor) -> float:
    return images.accuracy(model, task_classes(task), x, y)


# ---- base model ----------------------------------------------------------------------------


def pretrain_base(data: DigitsData, epochs: int = 30, seed: int = 0) -> DigitsViT:
    """Pretrain the ViT on the 10-class training pool (deterministic on one thread)."""
    return images.pretrain(DigitsViT, data.train_x, data.train_y, epochs, seed)


def base_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / f"digits-vit-{BASE_VERSION}.safetensors"


def load_base(cache_dir: Path, data: DigitsData | None = None) -> DigitsViT:
    """The cached base model, pretraining and caching it (atomically) on first use."""
    return images.cached_base(base_path(cache_dir), DigitsViT, lambda: pretrain_base(data or load_data()))


# ---- adapters ------------------------------------------------------------------------------

TARGET_SETS = {
    "qv": ("q_proj", "v_proj"),
    "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("fc1", "fc2"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"),
}


def sample_attributes(rng: np.random.Generator) -> AdapterAttributes:
    """The generating attributes of one adapter."""
    return images.sample_attributes(rng, TASKS, TARGET_SETS)


def new_head(model: nn.Module) -> None:
    """A new 10-way head in place of the pretrained one, drawn from the global torch RNG as DigitsViT() draws its own."""
    head = model.get_submodule("head")
    assert isinstance(head, nn.Linear)
    head.reset_parameters()


#: digits-vit-seeded's runs: a new head of the base's shape (scored on the task's classes, as the pretrained one is),
#: trained with the LoRA and saved as modules_to_save; LoRA dropout 0.1, as PEFT's ViT classification example uses.
SEEDED = SeededRun(new_head=new_head, modules_to_save=("head",), lora_dropout=0.1)


def train_adapter(base: DigitsViT, data: DigitsData, attrs: AdapterAttributes, seeded: SeededRun | None = None) -> tuple[PeftModel, float]:
    """Fine-tune LoRA on the task named in attrs (`seeded`: with a new head and dropout; see SeededRun); returns the
    PEFT model and its held-out accuracy."""
    return images.train_adapter(base, BASE_MODEL, TARGET_SETS, splits(data), task_classes, attrs, seeded=seeded)


def held_out_accuracy(model: nn.Module, data: DigitsData, task: str, seed: int) -> float:
    """Accuracy on the task's held-out split, drawn as for the adapter trained with this seed."""
    return images.held_out_accuracy(model, splits(data), task_classes, task, seed)
