"""Zero-shot from the base model: how strongly each adapter's update responds to a description, read off its weights.

The description and a set of generic sentences go through the space's base model; the hidden states entering each
module an adapter adapts are H_desc and H_generic (a row per token). An adapter's response to a token h at a module is
‖dW·h‖² = ‖Σ Vᵀ h‖², from its canonical factors (the module store's w = S/‖S‖ and V; its scale cancels below). Its
score is the mean, over the modules it adapts, of log(mean response to the description's tokens / mean response to the
generic sentences' tokens): an update that reads what the description says more than it reads any text scores above 0.

Only where the service can run the base model: a text base it ships (BASES: all-MiniLM-L6-v2, from the `text` extra's
package, the docs-minilm zoo's base). An image base (the digits ViT, the shapes CNN) reads no text, so a description
has no hidden states there: `not_runnable` says so and search by meaning goes without this list. A space whose module
store is not loaded (too big for ZOO_MODULE_STORE_BYTES) or holds more than MAX_ADAPTERS adapters is skipped too: each
query costs adapters × modules × rank × width × tokens multiply-adds.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import cast

import numpy as np

from zoo.domain.similarity import ModuleStack

#: base models whose hidden states the service can compute: all-MiniLM-L6-v2, the text encoder's own weights
BASES = frozenset({"sentence-transformers/all-MiniLM-L6-v2"})
#: image bases of the reference zoos: a description cannot be fed to them
IMAGE_BASES = frozenset({"zoo/digits-vit", "zoo/shapes-cnn"})
#: adapters a space may hold for the score to run per query
MAX_ADAPTERS = 5_000
#: tokens of a description read (a sentence is far shorter)
MAX_TOKENS = 64
#: what a description is compared with: sentences that ask for no task
GENERIC = (
    "The weather was mild for most of the week.",
    "She put the keys on the kitchen table and sat down.",
    "The meeting was moved to Thursday afternoon.",
    "He walked to the station and waited for the train.",
    "There are many ways to cook rice.",
    "The old house at the end of the street was painted blue.",
    "Children played in the park until it got dark.",
    "The report is due at the end of the month.",
    "We bought bread, cheese and apples at the market.",
    "The film was longer than anyone expected.",
    "A small boat drifted slowly across the lake.",
    "Please remember to close the window before you leave.",
)
#: keeps log(0) away from modules a text does not reach
EPS = 1e-12


def not_runnable(base_model: str) -> str | None:
    """Why the zero-shot score cannot run for a base model, or None where it can."""
    if base_model in BASES:
        return None
    if base_model in IMAGE_BASES:
        return f"{base_model} reads images, not text: a description has no hidden states there"
    return f"{base_model} is not a base model the service can run (it runs {', '.join(sorted(BASES))})"


def base_inputs(texts: Sequence[str], modules: Sequence[str]) -> dict[str, np.ndarray]:
    """{module: the hidden states entering it, a row per token of every text (padding left out)} of the base model's
    linear modules named (matched by the end of the name: `bert.encoder.layer.0.attention.self.query` is the base's
    `encoder.layer.0.attention.self.query`); modules the base does not have are left out."""
    import torch

    from embed.serving.text_index import encoder, encoder_lock

    model = encoder()
    bert = cast(torch.nn.Module, model[0].auto_model)  # sentence-transformers' Transformer module holds the Hugging Face model
    linear = {n: m for n, m in bert.named_modules() if isinstance(m, torch.nn.Linear)}
    wanted = {name: next((n for n in linear if name == n or name.endswith("." + n)), None) for name in modules}
    found: dict[str, list[torch.Tensor]] = {n: [] for n in set(wanted.values()) if n}
    hooks = [linear[n].register_forward_pre_hook(lambda _m, args, n=n: found[n].append(args[0].detach())) for n in found]
    batch = model.tokenizer(list(texts), padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    try:
        with encoder_lock, torch.inference_mode():
            bert(**batch)
    finally:
        for h in hooks:
            h.remove()
    keep = batch["attention_mask"].reshape(-1).bool()
    rows = {n: torch.cat(x).reshape(keep.shape[0], -1)[keep].numpy() for n, x in found.items()}
    return {name: rows[n] for name, n in wanted.items() if n in rows}


def responses(stack: ModuleStack, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(mean response per token, adapted) per module and adapter, (adapters, modules) each, for the modules `inputs`
    holds, in sorted order: ‖w ⊙ V h‖² averaged over the rows h (a module kept dense: ‖dŴ h‖², dŴ of unit norm)."""
    names = sorted(n for n in inputs if n in stack.factors or n in stack.dense)
    out = np.zeros((stack.size, len(names)), np.float64)
    adapted = np.zeros((stack.size, len(names)), bool)
    for j, name in enumerate(names):
        h = inputs[name].astype(np.float32)
        if name in stack.factors:
            _, v, w = stack.factors[name]  # (N, R, in), (N, R)
            proj = np.einsum("nri,ti->nrt", v, h) * w[:, :, None]
        else:
            proj = np.einsum("noi,ti->not", stack.dense[name], h)
        out[:, j] = (proj.astype(np.float64) ** 2).sum(axis=1).mean(axis=1)
        adapted[:, j] = stack.norms[name] > 0
    return out, adapted


_generic: weakref.WeakKeyDictionary[ModuleStack, tuple[np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=4)
def _generic_inputs(modules: tuple[str, ...]) -> dict[str, np.ndarray]:
    return base_inputs(GENERIC, modules)


def scores(stack: ModuleStack, description: str) -> np.ndarray:
    """Each adapter's zero-shot score for the description (the module's doc), a value per row of the stack; the
    generic sentences' responses are computed once per stack."""
    modules = tuple(sorted({*stack.factors, *stack.dense}))
    if stack not in _generic:
        _generic[stack] = responses(stack, _generic_inputs(modules))
    generic, adapted = _generic[stack]
    mine, _ = responses(stack, base_inputs([description], modules))
    ratio = np.where(adapted, np.log(mine + EPS) - np.log(generic + EPS), 0.0)
    return ratio.sum(axis=1) / np.maximum(adapted.sum(axis=1), 1)
