"""Telling, from tensor names and shapes alone, that a file no reader claims holds low-rank factor pairs.

Such a file is an adapter in a layout zoo does not know; stored as a full checkpoint it would be searched as
one, so it is refused instead. A pair is two tensors whose names differ in one factor word (down/up, A/B, a/b: whole
words between `.`, `_`, `:`, `-` or `/`, followed by nothing but `weight` or PEFT's `default`, as in `q.lora_down.weight`
or `unet:0:up`, not `mlp.down_proj.weight` or `down_blocks.0`) and whose shapes compose as r × n and m × r (either way
round, conv kernels flattened) with r at most half of min(n, m). A file is taken for factors when its pairs hold at
least half of its tensors of two or more dimensions, so that a checkpoint with a stray pair is still a checkpoint.
Likewise a file is taken for a LoRA missing factors when half of those tensors are named as a factor of either side
(a kohya file whose every `lora_down` was renamed away has only its `lora_up`s left to tell).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

#: the words that name the two factors of a low-rank pair
FACTOR_WORDS = (("down", "up"), ("A", "B"), ("a", "b"))
#: the words that may follow a factor word in its name
TRAILING = {"weight", "default"}
_SEPARATORS = re.compile(r"([._:/-])")
#: each first factor word's partner, and every factor word
_PARTNERS = dict(FACTOR_WORDS)
_EITHER = {**_PARTNERS, **{second: first for first, second in FACTOR_WORDS}}


def _composes(first: Sequence[int], second: Sequence[int]) -> bool:
    """Whether (first, second) are (r × n..., m × r...) or (m × r..., r × n...) with a small r."""
    if len(first) < 2 or len(second) < 2:
        return False
    for down, up in ((first, second), (second, first)):
        r, n, m = down[0], math.prod(down[1:]), up[0]
        if up[1] == r and 0 < 2 * r <= min(n, m):
            return True
    return False


def _factor_word(key: str, words: dict[str, str]) -> tuple[list[str], int] | None:
    """A name split at its separators and the index of its factor word among `words` (followed by nothing but
    TRAILING words); None when it has none."""
    parts = _SEPARATORS.split(key)
    for i, part in enumerate(parts):
        if part in words and all(word in TRAILING for word in parts[i + 2 :: 2]):
            return parts, i
    return None


def _matrices(shapes: Mapping[str, Sequence[int]]) -> int:
    return sum(1 for shape in shapes.values() if len(shape) >= 2)


def low_rank_pairs(shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, str]]:
    """The (first, second) factor pairs of a file's tensors, by name, when they make up at least half of its
    tensors of two or more dimensions; else []."""
    pairs = []
    for key, shape in shapes.items():
        found = _factor_word(key, _PARTNERS)
        if found is None:
            continue
        parts, i = found
        partner = "".join([*parts[:i], _PARTNERS[parts[i]], *parts[i + 1 :]])
        if partner in shapes and _composes(shape, shapes[partner]):
            pairs.append((key, partner))
    paired = {k for pair in pairs for k in pair}
    return sorted(pairs) if pairs and 2 * len(paired) >= _matrices(shapes) else []


def lone_factors(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The tensors of two or more dimensions named as either factor of a low-rank pair (`q.lora_up.weight`), when
    they make up at least half of a file's such tensors: a LoRA missing partners, when too few of them pair up
    (`low_rank_pairs`); else []."""
    named = sorted(k for k, shape in shapes.items() if len(shape) >= 2 and _factor_word(k, _EITHER) is not None)
    return named if named and 2 * len(named) >= _matrices(shapes) else []
