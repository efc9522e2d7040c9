"""The one LoRA training loop the reference recipes share: a typed plan, PEFT wiring, seeded AdamW steps on one thread.

A recipe supplies its base model, the modules to adapt and a `batch_loss(model, generator)`; everything else
(seeding, the adapter's wiring, the optimizer, the order the generator is drawn from) is here, so every
recipe's adapters are bitwise reproducible in the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn


class AdapterAttributes(TypedDict):
    """The generating attributes of one reference adapter as a recipe samples them (AdapterPlan's fields)."""

    task: str
    rank: int
    alpha: float
    learning_rate: float
    steps: int
    n_train: int
    target_modules: str
    seed: int


@dataclass(frozen=True)
class AdapterPlan:
    """The generating attributes of one reference adapter."""

    task: str
    rank: int
    alpha: float
    learning_rate: float
    steps: int
    n_train: int
    target_modules: str
    seed: int

    @classmethod
    def of(cls, attrs: Mapping[str, object]) -> AdapterPlan:
        """The plan in a labels row or an attributes dict (extra keys are ignored)."""

        def number(key: str) -> float:
            value = attrs[key]
            if not isinstance(value, int | float | str):
                raise TypeError(f"attribute {key} is {type(value).__name__}, not a number")
            return float(value)

        return cls(
            task=str(attrs["task"]),
            rank=int(number("rank")),
            alpha=number("alpha"),
            learning_rate=number("learning_rate"),
            steps=int(number("steps")),
            n_train=int(number("n_train")),
            target_modules=str(attrs["target_modules"]),
            seed=int(number("seed")),
        )

    def as_dict(self) -> AdapterAttributes:
        return {
            "task": self.task,
            "rank": self.rank,
            "alpha": self.alpha,
            "learning_rate": self.learning_rate,
            "steps": self.steps,
            "n_train": self.n_train,
            "target_modules": self.target_modules,
            "seed": self.seed,
        }


class single_thread:
    """Run torch on one thread inside the block (bitwise-reproducible CPU training)."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def lora_config(
    rank: int,
    alpha: float,
    targets: str | Sequence[str],
    task_type: str | None = None,
    dropout: float = 0.0,
    modules_to_save: Sequence[str] = (),
) -> LoraConfig:
    """PEFT's LoraConfig of a reference adapter: `targets` a regex (str) or module names; `task_type` PEFT's (None:
    none, as by default); no LoRA dropout and no modules to save but those of the task type unless given."""
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft types it int; a float alpha scales as well
        target_modules=targets if isinstance(targets, str) else list(targets),
        lora_dropout=dropout,
        task_type=task_type,
        modules_to_save=list(modules_to_save) or None,
    )


@dataclass(frozen=True)
class SeededRun:
    """What a run of a seeded recipe draws from its adapter's seed beyond the LoRA init and data order every recipe
    draws from it, as a real fine-tuning run does: a new head, and LoRA dropout masks."""

    #: re-initialises the head of (a copy of) the base in place, drawing from the global torch RNG
    new_head: Callable[[nn.Module], None]
    #: modules trained whole and saved beside the factors (the head), besides those PEFT's task type saves
    modules_to_save: tuple[str, ...] = ()
    lora_dropout: float = 0.0


BatchLoss = Callable[[PeftModel, torch.Generator], torch.Tensor]


def train_lora(
    base: nn.Module,
    base_model: str,
    plan: AdapterPlan,
    targets: str | Sequence[str],
    pick: Callable[[torch.Generator], BatchLoss],
    task_type: str | None = None,
    resume: Path | None = None,
    seeded: SeededRun | None = None,
) -> PeftModel:
    """A LoRA adapter of (a copy of) `base` trained by the plan, in eval mode. Call inside `single_thread()`.

    The global torch seed is the plan's (LoRA's initialization draws from it); one generator seeded the same way
    is handed to `pick`, which draws the training sample and returns the loss of a batch drawn by it, once per step.
    `task_type`: PEFT's task type (e.g. SEQ_CLS for a sequence classifier), None by default. `resume`: a saved
    adapter to train further, as PEFT resumes one (loaded with `is_trainable=True`, a fresh optimizer; the plan's
    rank, alpha and targets are then the saved adapter's). `seeded`: a seeded recipe's new head (drawn right after
    the seed is set, before LoRA's initialization) and LoRA dropout; None: the base's head as it is, no LoRA dropout."""
    torch.manual_seed(plan.seed)
    model: PeftModel
    if seeded is not None and resume is not None:
        raise ValueError("a seeded run starts a new adapter: it cannot resume one")
    if seeded is not None:
        fresh = copy.deepcopy(base)
        seeded.new_head(fresh)
        config = lora_config(plan.rank, plan.alpha, targets, task_type, seeded.lora_dropout, seeded.modules_to_save)
        model = get_peft_model(fresh, config)
    elif resume is None:
        model = get_peft_model(copy.deepcopy(base), lora_config(plan.rank, plan.alpha, targets, task_type))
    else:
        model = PeftModel.from_pretrained(copy.deepcopy(base), str(resume), is_trainable=True)
    model.peft_config["default"].base_model_name_or_path = base_model
    generator = torch.Generator().manual_seed(plan.seed)
    batch_loss = pick(generator)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=plan.learning_rate)
    model.train()
    for _ in range(plan.steps):
        loss = batch_loss(model, generator)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model
