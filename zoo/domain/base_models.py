"""The base model family an adapter's module names and shapes name, for files that name none.

Each family's vocabulary is every module a LoRA of it can adapt, at the shapes of its published config
(zoo/domain/model_shapes.py). Module names are compared after naming conventions are set aside (`canonical_name`:
PEFT's, kohya's and diffusers' prefixes, `.` or `_`). A family fits an adapter when no module it knows has another
shape there and it knows at least half of the adapter's modules; of the families that fit, those that know the most
modules are the guess. Families that fit equally (Llama-3-8B and Mistral-7B share every projection's shape: only a
token embedding or LM head tells them apart) are named together (`llama-3-8b-or-mistral-7b`). An adapter no family
fits gets a space of its own shapes, `unknown-<hash>`, so that two different unknown architectures never share one.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from zoo.domain.model_shapes import VOCABULARIES

#: the prefix of the space of an adapter no known family fits
UNKNOWN_PREFIX = "unknown-"


@dataclass(frozen=True)
class Family:
    """A base model family: the name of the space its guessed adapters land in, the vocabulary of model_shapes
    that holds its shapes, and a pattern that recognizes its models' names (a Hub id, a checkpoint file name)."""

    name: str
    shapes: str
    named_by: str


#: the known families; a name recognized by two patterns is recognized by neither
FAMILIES = (
    Family("sd1.x", "sd1.5", r"stable-diffusion-v1|sd-?v?1(?:[-.]?[45x])?(?![0-9])|v1-[45]"),
    Family("sd2.x", "sd2.1", r"stable-diffusion-2|sd-?v?2(?:[-.]?[01x])?(?![0-9])|v2-[01]"),
    Family("sdxl", "sdxl", r"sd-?xl|stable-diffusion-xl"),
    Family("flux.1", "flux1-dev", r"flux"),
    Family("llama-3-8b", "llama3-8b", r"llama-?3(?:\.[0-9])?-8b"),
    Family("mistral-7b", "mistral-7b", r"mistral-7b"),
    Family("qwen2.5-7b", "qwen2.5-7b", r"qwen2(?:\.5)?-7b"),
    Family("bert-base", "bert-base", r"(?<![a-z])bert-base"),
    Family("distilbert-base", "distilbert-base", r"distilbert"),
    Family("gpt2", "gpt2", r"gpt-?2(?![a-z0-9-])"),
)
_BY_NAME = {f.name: f for f in FAMILIES}

#: prefixes that say which part of a pipeline or wrapper a module is in, not which module it is
_WRAPPERS = re.compile(r"^(?:base_model_model_|model_|lora_unet_|unet_|lora_transformer_|transformer_|diffusion_model_|bert_|distilbert_)+")
#: the text encoders of a Stable Diffusion pipeline: kohya's te/te1/te2, diffusers' text_encoder/text_encoder_2
_TEXT_ENCODERS = (
    (re.compile(r"^(?:lora_te2_|text_encoder_2_)(?:text_model_)?"), "te2_"),
    (re.compile(r"^(?:lora_te1?_|text_encoder_)(?:text_model_)?"), "te1_"),
)


def canonical_name(name: str) -> str:
    """A module's name without its naming convention: `.` as `_`, a `.weight` suffix and wrapper prefixes dropped, a
    text encoder's named te1_/te2_ without `text_model` (kohya's `lora_te_text_model_encoder…`, diffusers'
    `text_encoder.text_model.encoder…` and `text_encoder.encoder…` agree)."""
    flat = name.removesuffix(".weight").replace(".", "_")
    for pattern, short in _TEXT_ENCODERS:
        if pattern.match(flat):
            return pattern.sub(short, flat, count=1)
    return _WRAPPERS.sub("", flat)


@functools.cache
def _vocabulary(shapes: str) -> dict[str, tuple[int, int]]:
    return {canonical_name(m.name): (m.out, m.fan_in) for m in VOCABULARIES[shapes]()}


@dataclass(frozen=True)
class Guess:
    """What an adapter's shapes name: `families` (the known ones that fit best, one unless they cannot be told apart;
    none when no known family fits) and `base_model`, the space it lands in."""

    base_model: str
    families: tuple[str, ...]
    matched: int  # modules the families know
    modules: int  # modules of the adapter

    @property
    def known(self) -> bool:
        return bool(self.families)

    def describe(self) -> str:
        """A note for the adapter: what was guessed from what."""
        if not self.known:
            return f"base model guessed from shapes: no known family fits its {self.modules} modules; space {self.base_model} (its shapes)"
        which = " or ".join(self.families)
        alike = " (their module shapes are the same)" if len(self.families) > 1 else ""
        return f"base model guessed from shapes: {which}{alike}, from {self.matched} of {self.modules} modules"


def guess_base_model(shapes: Iterable[tuple[str, int, int]]) -> Guess:
    """The base model family named by an adapter's (module name, out, in) shapes (the module's docstring)."""
    have = {canonical_name(n): (int(o), int(i)) for n, o, i in shapes}
    fitting: list[tuple[int, str]] = []
    for family in FAMILIES:
        known = _vocabulary(family.shapes)
        matched = 0
        for name, shape in have.items():
            want = known.get(name)
            if want is not None and want != shape:
                break
            matched += want is not None
        else:
            if matched and 2 * matched >= len(have):
                fitting.append((matched, family.name))
    if not fitting:
        signature = "\n".join(f"{n} {o}x{i}" for n, (o, i) in sorted(have.items()))
        return Guess(UNKNOWN_PREFIX + hashlib.sha256(signature.encode()).hexdigest()[:12], (), 0, len(have))
    best = max(m for m, _ in fitting)
    families = tuple(name for m, name in fitting if m == best)
    return Guess("-or-".join(families), families, best, len(have))


def named_family(base_model: str) -> str | None:
    """The known family a base model's name names (`runwayml/stable-diffusion-v1-5` → sd1.x), None when no family's
    pattern or more than one recognizes it."""
    text = re.sub(r"[\s_]+", "-", base_model.lower())
    if text in _BY_NAME:
        return text
    found = [f.name for f in FAMILIES if re.search(f.named_by, text)]
    return found[0] if len(found) == 1 else None


def contradiction(base_model: str, guess: Guess) -> str | None:
    """Why a named base model contradicts the shapes (its name names a known family the shapes rule out), else None."""
    named = named_family(base_model)
    if named is None or not guess.known or named in guess.families:
        return None
    return f"base model {base_model!r} names the {named} family, but the module shapes are {' or '.join(guess.families)}'s"
