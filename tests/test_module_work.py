"""Per-module work on several threads (zoo/domain/module_work.py): the same vectors as on one, the deadline kept, errors
raised."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from zoo import deadline
from zoo.domain.canonical import canonicalize
from zoo.domain.channels import channel_sketches
from zoo.domain.module_work import for_each_module, module_threads
from zoo.domain.similarity import module_sketches


def _adapters(count: int, seed: int) -> tuple[list[dict], list[str]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"layers.{k}.proj": (24 + 8 * (k % 3), 16 + 4 * (k % 2)) for k in range(6)}
    for k in range(6, 9):  # wide enough for torch to share one product out over threads, and for module_threads
        shapes[f"layers.{k}.mlp"] = (14336, 4096)
    adapters = []
    for i in range(count):
        factors = {}
        for name, (rows, cols) in shapes.items():
            if (i + len(name)) % 5 == 0:
                continue  # some adapters lack some modules
            B, A = torch.randn(rows, 16, generator=gen), torch.randn(16, cols, generator=gen)
            factors[name] = canonicalize(A, B)
        adapters.append(factors)
    return adapters, sorted(shapes)


@pytest.mark.parametrize("seed", [0, 1])
def test_sketches_on_several_threads_equal_those_on_one(seed: int) -> None:
    """Module sketches and the input Gram's sketches, byte for byte, whatever the thread count torch had."""
    adapters, names = _adapters(5, seed)
    before = torch.get_num_threads()
    try:
        made = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            made[threads] = (module_sketches(adapters, names, 9), channel_sketches(adapters, names, 9, "input_gram"))
        assert torch.get_num_threads() == 2  # given back as it was
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(made[1][0], made[2][0]) and np.array_equal(made[1][1], made[2][1])
    assert np.abs(made[1][0]).sum() > 0 and np.abs(made[1][1]).sum() > 0


def test_only_large_modules_go_to_threads() -> None:
    large, _ = _adapters(2, 0)
    small = [{n: f for n, f in a.items() if "proj" in n} for a in large]
    assert module_threads(large, 2) == 2 and module_threads(small, 2) == 1 and module_threads([], 2) == 1


def test_every_module_once_and_the_first_error_raised() -> None:
    names = [f"m{k}" for k in range(11)]
    seen: list[int] = []
    for_each_module(names, lambda m, name: seen.append(m), threads=3)
    assert sorted(seen) == list(range(11))

    def fail(m: int, name: str) -> None:
        if name == "m7":
            raise ValueError(f"module {name} is broken")

    with pytest.raises(ValueError, match="m7"):
        for_each_module(names, fail, threads=3)


def test_a_call_past_its_deadline_stops_on_every_thread() -> None:
    """The caller's deadline reaches the threads: work past it stops at the next module, with TimeLimitError."""
    done: list[int] = []

    def slow(m: int, name: str) -> None:
        time.sleep(0.02)
        done.append(m)

    with deadline.until(time.monotonic() + 0.05), pytest.raises(deadline.TimeLimitError):
        for_each_module([f"m{k}" for k in range(40)], slow, threads=2)
    assert 0 < len(done) < 40
