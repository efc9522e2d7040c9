"""Lineage zoos (`zoo make-zoo --recipe shapes-lineage`): adapters with known parents, the relation step's ground truth.

Roots are trained as their recipe trains its adapters; every other member is made from roots the ways adapters
are made from others in the wild, and records its parents and parameters:

- `root`: a fresh draw of the recipe, or one sharing an earlier root's structure (rank, alpha, target modules:
  merges need parents of one structure), or all of an earlier root's attributes but its seed: an unrelated
  adapter of the same task and hyperparameters, similar but not related;
- `rescaled` (alpha times `scale`), `cast` (A and B to `precision`, bf16 or fp16, and back to float32),
  `truncated` (the top-`kept_rank` of each module's SVD of dW, written as a rank-`kept_rank` adapter of the same
  scale), `pruned` (the smallest-magnitude share `sparsity` of each A and B set to zero; more are zero where the
  root had zeros): one root's update, no training;
- `merge`: 2-3 roots of one structure by PEFT's `add_weighted_adapter` (`combination`, `weights`, `density`);
- `continuation`: a root's saved adapter loaded with `is_trainable=True` and trained `steps` more, on the same
  task and data, another task, or at another learning rate (`variant`).

The plan is drawn member by member from (seed, index) and the members before it, so a zoo's first n members do
not depend on its count. Every member is a real PEFT adapter written by `save_pretrained`.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from zoo.errors import UsageError
from zoo.reference.recipes import LineageHooks, Recipe
from zoo.reference.training import AdapterAttributes

TRANSFORMS = ("rescaled", "cast", "truncated", "pruned")
#: PEFT's combination types a merge is made by
COMBINATIONS = ("cat", "svd", "linear", "ties", "dare_linear", "magnitude_prune")
#: combinations PEFT makes factor by factor: their parents must share a rank (cat's share one here, so that their
#: sum stays within LineageHooks.max_cat_rank)
SAME_RANK = frozenset({"cat", "linear", "ties", "dare_linear", "magnitude_prune"})
#: combinations that sparsify the parents first, at a density
SPARSIFYING = frozenset({"ties", "dare_linear", "magnitude_prune"})
VARIANTS = ("same-task", "other-task", "other-lr")
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: a new root shares all but the seed of an earlier root with this probability, and its structure with the next
SIBLING, SAME_STRUCTURE = 0.25, 0.25
PARENTS_SEP = ";"
TASKS_SEP = "+"
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class Mix:
    """The share of each kind of member (normalized; the first member is always a root)."""

    root: float = 0.3
    transform: float = 0.3
    merge: float = 0.2
    continuation: float = 0.2

    @classmethod
    def parse(cls, text: str) -> Mix:
        """`root=0.4,merge=0.1`: the named shares replace the defaults."""
        known = {f.name for f in fields(cls)}
        given: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in known:
                raise UsageError(f"--mix: unknown kind {key.strip()!r}; kinds: {', '.join(sorted(known))}")
            try:
                given[key.strip()] = float(value)
            except ValueError:
                raise UsageError(f"--mix: {part!r} is not KIND=SHARE") from None
        mix = cls(**given)
        if any(not math.isfinite(s) or s < 0 for s in mix.shares().values()) or mix.root <= 0:
            raise UsageError("--mix: shares must be finite and non-negative, the roots' positive")
        return mix

    def shares(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class LineageAttributes(TypedDict):
    """One member of a lineage zoo: its relation, parents and parameters, and its training attributes where it has
    them (a transform: its parent's; a continuation: the further run's, `steps` those after the parent's)."""

    relation: str  # root | rescaled | cast | truncated | pruned | merge | continuation
    parents: str | None  # PARENTS_SEP-separated names
    task: str  # a merge's: its parents' tasks joined by TASKS_SEP
    rank: int
    alpha: float
    learning_rate: float | None
    steps: int | None
    n_train: int | None
    target_modules: str
    seed: int
    scale: float | None  # rescaled: the factor on alpha (and dW)
    precision: str | None  # cast: bf16 | fp16
    kept_rank: int | None  # truncated
    sparsity: float | None  # pruned: the share of each A and B set to zero
    combination: str | None  # merge: PEFT's combination_type
    weights: str | None  # merge: PARENTS_SEP-separated, the parents' order
    density: float | None  # merge: PEFT's density, for the sparsifying combinations
    variant: str | None  # continuation: same-task | other-task | other-lr


Root = tuple[str, LineageAttributes]


#: the training attributes a transform inherits from its root, and a continuation starts from
TRAINING = ("task", "rank", "alpha", "learning_rate", "steps", "n_train", "target_modules", "seed")
#: the parameters only some relations have
PARAMETERS = ("parents", "scale", "precision", "kept_rank", "sparsity", "combination", "weights", "density", "variant")


def _member(training: Mapping[str, Any], **changes: Any) -> LineageAttributes:
    """A member with the training attributes, then the changes (a root with no parameters unless changed)."""
    return cast(LineageAttributes, {"relation": "root", **{k: training[k] for k in TRAINING}, **dict.fromkeys(PARAMETERS), **changes})


def plan_lineage(recipe: Recipe, seed: int, count: int, mix: Mix, name: Callable[[int], str]) -> list[LineageAttributes]:
    """The members 0..count-1, each drawn from (seed, index) and the members before it.

    Each member is of the kind furthest below its share so far (among those its predecessors allow), and of the
    relation, combination or variant used least so far (the first listed of those): a small zoo has every kind."""
    hooks = _hooks(recipe)
    members: list[LineageAttributes] = []
    roots: list[Root] = []
    used: Counter[str] = Counter()
    for i in range(count):
        member = _draw(recipe, hooks, np.random.default_rng([seed, i]), roots, mix, used)
        members.append(member)
        used.update({str(v) for v in (kind_of(member), member["relation"], member["combination"], member["variant"]) if v})
        if member["relation"] == "root":
            roots.append((name(i), member))
    return members


def kind_of(member: LineageAttributes) -> str:
    """root, transform, merge or continuation."""
    return "transform" if member["relation"] in TRANSFORMS else member["relation"]


def _hooks(recipe: Recipe) -> LineageHooks:
    if recipe.lineage is None:
        raise UsageError(f"recipe {recipe.name} cannot grow a lineage zoo")
    return recipe.lineage


def _least_used(options: Sequence[str], used: Counter[str]) -> str:
    """The option used least so far; the first listed of those."""
    return min(options, key=lambda o: used[o])


def _draw(
    recipe: Recipe, hooks: LineageHooks, rng: np.random.Generator, roots: list[Root], mix: Mix, used: Counter[str]
) -> LineageAttributes:
    fresh = recipe.sample_attributes(rng)
    groups = _merge_groups(roots, hooks)
    shares = mix.shares()
    total = sum(shares.values())
    possible = {"root": True, "transform": bool(roots), "merge": bool(groups), "continuation": bool(roots)}
    n = sum(used[k] for k in shares) + 1
    kind = max((k for k in shares if possible[k] and shares[k] > 0), key=lambda k: shares[k] / total * n - used[k])
    if kind == "transform":
        return _transform(rng, roots, hooks, used)
    if kind == "merge":
        return _merge(rng, groups, fresh, hooks, used)
    if kind == "continuation":
        return _continuation(recipe, rng, roots, fresh, used)
    return _root(rng, roots, fresh)


def _root(rng: np.random.Generator, roots: list[Root], fresh: AdapterAttributes) -> LineageAttributes:
    like = rng.random()
    if not roots or like >= SIBLING + SAME_STRUCTURE:
        return _member(fresh)
    _, other = roots[int(rng.integers(len(roots)))]
    if like < SIBLING:
        return _member(other, seed=fresh["seed"])
    return _member(fresh, rank=other["rank"], alpha=other["alpha"], target_modules=other["target_modules"])


def _transform(rng: np.random.Generator, roots: list[Root], hooks: LineageHooks, used: Counter[str]) -> LineageAttributes:
    parent, p = roots[int(rng.integers(len(roots)))]
    relation = _least_used([t for t in TRANSFORMS if t != "truncated" or p["rank"] >= 2], used)
    if relation == "rescaled":
        factor = round(2.0 ** (float(rng.choice([-1.0, 1.0])) * rng.uniform(0.25, 2.0)), 3)
        changes: dict[str, Any] = {"scale": factor, "alpha": p["alpha"] * factor}
    elif relation == "cast":
        changes = {"precision": str(rng.choice(list(PRECISIONS)))}
    elif relation == "truncated":
        k = int(rng.integers(1, min(p["rank"] // 2, hooks.max_svd_rank) + 1))
        changes = {"kept_rank": k, "rank": k, "alpha": p["alpha"] * k / p["rank"]}  # the same scale, alpha / rank
    else:
        changes = {"sparsity": round(float(rng.uniform(0.05, 0.6)), 2)}
    return _member(p, relation=relation, parents=parent, **changes)


def _merge_groups(roots: list[Root], hooks: LineageHooks) -> dict[str, list[list[Root]]]:
    """Per combination, the groups of roots PEFT can merge by it (one target set; one rank where it needs one)."""
    out: dict[str, list[list[Root]]] = {}
    for combination in COMBINATIONS:
        by: dict[tuple[str, int], list[Root]] = {}
        for r in roots:
            if combination != "cat" or 2 * r[1]["rank"] <= hooks.max_cat_rank:
                by.setdefault((r[1]["target_modules"], r[1]["rank"] if combination in SAME_RANK else 0), []).append(r)
        groups = [g for g in by.values() if len(g) >= 2]
        if groups:
            out[combination] = groups
    return out


def _merge(
    rng: np.random.Generator, groups: dict[str, list[list[Root]]], fresh: AdapterAttributes, hooks: LineageHooks, used: Counter[str]
) -> LineageAttributes:
    combination = _least_used(list(groups), used)
    group = groups[combination][int(rng.integers(len(groups[combination])))]
    n = min(len(group), int(rng.integers(2, 4)), hooks.max_cat_rank // group[0][1]["rank"] if combination == "cat" else 3)
    chosen = [group[int(i)] for i in rng.choice(len(group), size=n, replace=False)]
    weights = [round(float(rng.uniform(0.2, 1.0)), 2) for _ in chosen]
    ranks = [p["rank"] for _, p in chosen]
    rank = sum(ranks) if combination == "cat" else min(max(ranks), hooks.max_svd_rank) if combination == "svd" else ranks[0]
    density = round(float(rng.choice([0.3, 0.5, 0.7, 0.9])), 1) if combination in SPARSIFYING else None
    tasks = list(dict.fromkeys(p["task"] for _, p in chosen))
    return _member(
        fresh,
        relation="merge",
        parents=PARENTS_SEP.join(name for name, _ in chosen),
        task=TASKS_SEP.join(tasks),
        rank=rank,
        alpha=float(rank),  # PEFT gives a merged adapter lora_alpha = r
        learning_rate=None,
        steps=None,
        n_train=None,
        target_modules=chosen[0][1]["target_modules"],
        combination=combination,
        weights=PARENTS_SEP.join(str(w) for w in weights),
        density=density,
    )


def _continuation(
    recipe: Recipe, rng: np.random.Generator, roots: list[Root], fresh: AdapterAttributes, used: Counter[str]
) -> LineageAttributes:
    parent, p = roots[int(rng.integers(len(roots)))]
    variant = _least_used(VARIANTS, used)
    changes: dict[str, Any] = {}  # same-task: the root's task, data (n_train, seed) and learning rate
    if variant == "other-task":
        other = _redraw(recipe, rng, lambda a: a["task"] != p["task"])
        changes = {"task": other["task"], "n_train": fresh["n_train"], "seed": fresh["seed"]} if other else {}
        variant = variant if other else "same-task"
    elif variant == "other-lr":
        lr = float(p["learning_rate"] or 0.0)
        other = _redraw(recipe, rng, lambda a: max(a["learning_rate"], lr) >= 2 * min(a["learning_rate"], lr))
        changes = {"learning_rate": other["learning_rate"] if other else 3 * lr}
    return _member(p, relation="continuation", parents=parent, variant=variant, steps=fresh["steps"], **changes)


def _redraw(recipe: Recipe, rng: np.random.Generator, ok: Callable[[AdapterAttributes], bool], tries: int = 50) -> AdapterAttributes | None:
    """A fresh draw of the recipe for which `ok` holds (None after `tries`)."""
    for _ in range(tries):
        attrs = recipe.sample_attributes(rng)
        if ok(attrs):
            return attrs
    return None


# ---- making members from their parents ---------------------------------------------------------------------


def make_child(recipe: Recipe, ctx: Any, out_dir: Path, attrs: LineageAttributes) -> tuple[PeftModel, float]:
    """A member that is not a root, made from its parents' saved adapters in out_dir, and its held-out accuracy
    (a merge's: the mean over its parents' tasks)."""
    hooks = _hooks(recipe)
    parents = [out_dir / p for p in (attrs["parents"] or "").split(PARENTS_SEP)]
    if attrs["relation"] == "continuation":
        return hooks.resume(ctx, cast(AdapterAttributes, attrs), parents[0])  # a continuation has every training attribute
    base = hooks.base(ctx)
    model = merged(base, parents, attrs) if attrs["relation"] == "merge" else transformed(base, parents[0], attrs)
    accuracy = statistics.mean(hooks.score(ctx, model, task, attrs["seed"]) for task in attrs["task"].split(TASKS_SEP))
    return model, accuracy


def transformed(base: torch.nn.Module, parent: Path, attrs: LineageAttributes) -> PeftModel:
    """The parent's adapter transformed as attrs say, as a PEFT model of (a copy of) base."""
    config = LoraConfig.from_pretrained(str(parent))
    state = load_file(str(parent / ADAPTER_FILE))
    relation = attrs["relation"]
    if relation == "cast":
        dtype = PRECISIONS[str(attrs["precision"])]
        state = {k: v.to(dtype).float() for k, v in state.items()}
    elif relation == "pruned":
        state = {k: prune(v, float(attrs["sparsity"] or 0.0)) for k, v in state.items()}
    elif relation == "truncated":
        state = truncate(state, int(attrs["kept_rank"] or 0))
    config.r, config.lora_alpha = attrs["rank"], attrs["alpha"]  # a float alpha scales as well
    base_model, config.base_model_name_or_path = config.base_model_name_or_path, None  # get_peft_model resets it
    model = get_peft_model(copy.deepcopy(base), config)
    model.peft_config["default"].base_model_name_or_path = base_model
    set_peft_model_state_dict(model, state)
    model.eval()
    return model


def prune(t: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The tensor with its round(sparsity · size) smallest-magnitude entries set to zero (ties broken by position)."""
    k = round(sparsity * t.numel())
    flat = t.flatten().clone()
    flat[torch.argsort(flat.abs(), stable=True)[:k]] = 0.0
    return flat.reshape(t.shape)


def truncate(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Each module's B·A cut to the top k of its SVD, split evenly as rank-k factors of the same layouts."""
    out = {}
    for key_a in (k_ for k_ in state if k_.endswith("lora_A.weight")):
        key_b = key_a.replace("lora_A", "lora_B")
        A, B = state[key_a], state[key_b]
        U, S, Vh = torch.linalg.svd(B.flatten(1).double() @ A.flatten(1).double(), full_matrices=False)
        root = S[:k].sqrt()
        out[key_a] = (root[:, None] * Vh[:k]).float().reshape(k, *A.shape[1:])
        out[key_b] = (U[:, :k] * root).float().reshape(B.shape[0], k, *B.shape[2:])
    return out


def merged(base: torch.nn.Module, parents: Sequence[Path], attrs: LineageAttributes) -> PeftModel:
    """The parents merged by PEFT's add_weighted_adapter as attrs say, as the only adapter of a PEFT model."""
    names = [f"parent{i}" for i in range(len(parents))]
    model = PeftModel.from_pretrained(copy.deepcopy(base), str(parents[0]), adapter_name=names[0])
    for name, path in zip(names[1:], parents[1:], strict=True):
        model.load_adapter(str(path), adapter_name=name)
    weights = [float(w) for w in (attrs["weights"] or "").split(PARENTS_SEP)]
    torch.manual_seed(attrs["seed"])  # dare's random pruning
    model.add_weighted_adapter(
        names,
        weights,
        "default",
        combination_type=attrs["combination"],
        svd_rank=attrs["rank"] if attrs["combination"] == "svd" else None,
        density=attrs["density"],
    )
    model.set_adapter("default")
    for name in names:
        model.delete_adapter(name)
    model.eval()
    return model
