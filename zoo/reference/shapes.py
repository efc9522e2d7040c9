"""The `shapes-cnn` reference zoo: a small residual convolutional network pretrained on procedurally
drawn shapes and textures, and PEFT LoRA adapters on subsets of its Conv2d layers.

Unlike digits-vit (a ViT: only Linear layers) and docs-minilm (a pretrained BERT), every adapted module
here is a convolution: 3×3 kernels with and without stride, and 1×1 shortcut projections, so the
adapters exercise the conv path of the readers and of canonicalization (dW flattened to
out × in·kh·kw).

Data: 16×16 grayscale images of ten shape classes (disk, ring, square, frame, triangle, plus, cross,
horizontal and vertical stripes, checkerboard) at random positions, sizes, contrasts and background
levels with pixel noise, drawn by this module from fixed seeds (nothing is downloaded; only +, −, ×,
÷ and floor on the pixel grid, so the images are the same on every machine). The base model is
pretrained on the training pool; adapters train on samples of the same pool and are scored on a
held-out test set drawn from another seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from torch import nn

from zoo.reference import images
from zoo.reference.training import AdapterAttributes

BASE_MODEL = "zoo/shapes-cnn"
BASE_VERSION = "v1"
IMAGE = 16
CLASSES = ("disk", "ring", "square", "frame", "triangle", "plus", "cross", "hstripes", "vstripes", "checker")
N_TRAIN, N_TEST = 4000, 1500
TRAIN_SEED, TEST_SEED = 20260311, 20260312
#: shapes of half-size at least this are "large" (half of them) (the size task's class 1)
LARGE = 4.75
#: pretraining targets are smoothed so that the base is not overconfident (its logits stay small enough
#: for LoRA to move them without first blowing up on a few confidently wrong examples)
LABEL_SMOOTHING = 0.1


# ---- images --------------------------------------------------------------------------------


def shape_masks(u: np.ndarray, v: np.ndarray, s: np.ndarray) -> np.ndarray:
    """(10, n, H, W) masks of every class for shapes centred at u = v = 0 with half-size s."""
    au, av = np.abs(u), np.abs(v)
    box = np.maximum(au, av)
    inside = box <= s
    r2 = u * u + v * v
    stripe_h = np.floor((v + s) / 2.0) % 2 == 0
    stripe_v = np.floor((u + s) / 2.0) % 2 == 0
    return np.stack(
        [
            r2 <= s * s,  # disk
            (r2 <= s * s) & (r2 >= (s - 1.5) ** 2),  # ring
            inside,  # square
            inside & (box >= s - 1.2),  # frame
            (v >= -s) & (v <= s) & (au <= (v + s) / 2.0),  # triangle, apex up
            inside & ((au <= 0.75) | (av <= 0.75)),  # plus
            inside & ((np.abs(u - v) <= 1.0) | (np.abs(u + v) <= 1.0)),  # cross
            inside & stripe_h,  # horizontal stripes
            inside & stripe_v,  # vertical stripes
            inside & (stripe_h == stripe_v),  # checkerboard
        ]
    )


def render(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n images (n × 1 × 16 × 16 in [0, 1]), their classes and their shapes' half-sizes."""
    rng = np.random.default_rng(seed)
    cls = rng.integers(0, len(CLASSES), n)
    s = rng.uniform(3.0, 6.5, n)
    cx = s + rng.random(n) * (IMAGE - 1 - 2 * s)
    cy = s + rng.random(n) * (IMAGE - 1 - 2 * s)
    fg = rng.uniform(0.6, 1.0, n)
    bg = rng.uniform(0.0, 0.25, n)
    grid = np.arange(IMAGE, dtype=np.float64)
    u = grid[None, None, :] - cx[:, None, None]
    v = grid[None, :, None] - cy[:, None, None]
    masks = shape_masks(u, v, s[:, None, None])
    mask = masks[cls, np.arange(n)]
    img = bg[:, None, None] + (fg - bg)[:, None, None] * mask + 0.06 * rng.standard_normal((n, IMAGE, IMAGE))
    images = torch.tensor(np.clip(img, 0.0, 1.0)[:, None], dtype=torch.float32)
    return images, torch.tensor(cls, dtype=torch.long), torch.tensor(s, dtype=torch.float32)


@dataclass(frozen=True)
class ShapesData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    train_size: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    test_size: torch.Tensor


def load_data() -> ShapesData:
    """The training pool and the held-out test set (drawn from two seeds; a fraction of a second)."""
    return ShapesData(*render(N_TRAIN, TRAIN_SEED), *render(N_TEST, TEST_SEED))


# ---- base model ----------------------------------------------------------------------------


class Stage(nn.Module):
    """A residual stage that halves the resolution: 3×3 stride-2 conv, 3×3 conv, 1×1 stride-2 shortcut."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + self.shortcut(x))


class ShapesCNN(nn.Module):
    """stem (1→16, 3×3) · stage 16→32 (8×8) · stage 32→64 (4×4) · global average pool · 10-way head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.stages = nn.ModuleList([Stage(16, 32), Stage(32, 64)])
        self.head = nn.Linear(64, len(CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(images))
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean(dim=(2, 3)))


def pretrain_base(data: ShapesData, epochs: int = 12, seed: int = 0) -> ShapesCNN:
    """Pretrain the CNN on the 10 shape classes of the training pool (deterministic on one thread)."""
    return images.pretrain(ShapesCNN, data.train_x, data.train_y, epochs, seed, label_smoothing=LABEL_SMOOTHING)


def base_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / f"shapes-cnn-{BASE_VERSION}.safetensors"


def load_base(cache_dir: Path, data: ShapesData | None = None) -> ShapesCNN:
    """The cached base model, pretraining and caching it (atomically) on first use."""
    return images.cached_base(base_path(cache_dir), ShapesCNN, lambda: pretrain_base(data or load_data()))


# ---- tasks ---------------------------------------------------------------------------------

PAIRS = {
    "disk-ring": (0, 1),
    "square-frame": (2, 3),
    "plus-cross": (5, 6),
    "stripes": (7, 8),
    "triangle-square": (4, 2),
}
SUBSETS = {"filled": (0, 2, 4), "outline": (1, 3, 5, 6), "texture": (7, 8, 9)}
TRANSFORMS = ("rot90", "flipud", "invert", "blur", "noise", "pixelate")
TASKS: tuple[str, ...] = (
    *(f"pair-{k}" for k in PAIRS),
    *(f"subset-{k}" for k in SUBSETS),
    *TRANSFORMS,
    "shift-labels",
    "label-noise",
    "size",
)


def task_classes(task: str) -> tuple[int, ...]:
    """Classes (logits) the task is scored on (argmax over these)."""
    if task.startswith("pair-"):
        return PAIRS[task.removeprefix("pair-")]
    if task.startswith("subset-"):
        return SUBSETS[task.removeprefix("subset-")]
    if task == "size":
        return (0, 1)
    return tuple(range(len(CLASSES)))


def _transform(task: str, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if task == "rot90":
        return torch.rot90(x, 1, dims=(2, 3))
    if task == "flipud":
        return torch.flip(x, dims=(2,))
    if task == "invert":
        return 1.0 - x
    if task == "blur":
        return nn.functional.avg_pool2d(nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    if task == "noise":
        return images.noisy(x, gen)
    if task == "pixelate":
        return nn.functional.interpolate(nn.functional.avg_pool2d(x, 2), scale_factor=2, mode="nearest")
    return x


def task_split(
    task: str, x: torch.Tensor, y: torch.Tensor, size: torch.Tensor, train: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's inputs and targets derived from (images, classes, sizes); label noise only on training targets."""
    if task not in TASKS:
        raise ValueError(f"unknown shapes task {task!r}; known: {', '.join(TASKS)}")
    gen = torch.Generator().manual_seed(seed)
    if task == "size":
        return x, (size >= LARGE).long()
    keep = torch.isin(y, torch.tensor(task_classes(task)))
    x, y = _transform(task, x[keep], gen), y[keep]
    return x, images.relabelled(task, y, len(CLASSES), train, gen)


def splits(data: ShapesData) -> images.Split:
    """The tasks' splits of these shapes: of the training pool, or of the test set."""

    def split(task: str, train: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, size = (data.train_x, data.train_y, data.train_size) if train else (data.test_x, data.test_y, data.test_size)
        return task_split(task, x, y, size, train, seed)

    return split


def accuracy(model: nn.Module, task: str, x: torch.Tensor, y: torch.Tensor) -> float:
    return images.accuracy(model, task_classes(task), x, y)


# ---- adapters ------------------------------------------------------------------------------

#: PEFT target_modules: a list of name suffixes, or a regex the full module name must match
TARGET_SETS: dict[str, list[str] | str] = {
    "early": r"stem|stages\.0\.conv[12]",  # the 16×16 and 8×8 3×3 convs
    "late": r"stages\.1\.conv[12]",  # the 4×4 3×3 convs
    "second": ["conv2"],  # each stage's unstrided 3×3 conv
    "strided": ["conv1", "shortcut"],  # the downsampling convs, 3×3 and 1×1
    "all": ["stem", "conv1", "conv2", "shortcut"],
}


def sample_attributes(rng: np.random.Generator) -> AdapterAttributes:
    """The generating attributes of one adapter."""
    return images.sample_attributes(rng, TASKS, TARGET_SETS)


def train_adapter(base: ShapesCNN, data: ShapesData, attrs: AdapterAttributes, resume: Path | None = None) -> tuple[PeftModel, float]:
    """Fine-tune LoRA on the task named in attrs (`resume`: the saved adapter to train further); returns the PEFT
    model and its held-out accuracy."""
    return images.train_adapter(base, BASE_MODEL, TARGET_SETS, splits(data), task_classes, attrs, resume=resume)


def held_out_accuracy(model: nn.Module, data: ShapesData, task: str, seed: int) -> float:
    """Accuracy on the task's held-out split, drawn as for the adapter trained with this seed."""
    return images.held_out_accuracy(model, splits(data), task_classes, task, seed)
