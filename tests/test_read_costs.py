"""What `zoo embed`, its relation step and `zoo ingest` compute per adapter, made cheaper without changing it: a large
blob of canonical factors as views of a private map of its file, the raw-factor sketches made a module at a time for
all the adapters of one rank, and a file's zeros and precisions counted on half-precision bits."""

from __future__ import annotations

import gc
import zlib
from pathlib import Path

import numpy as np
import torch

from zoo.domain.canonical import canonicalize
from zoo.domain.raw_sketch import RANK_SALT, raw_sketches
from zoo.domain.transforms import raw_precisions, zero_count
from zoo.formats import LoraModule
from zoo.store.blobs import MAPPED_FROM, BlobStore


def lora(seed: int, out: int, inp: int, rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of a random LoRA, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inp, generator=g).to(dtype), torch.randn(out, rank, generator=g).to(dtype)


def test_a_many_module_blob_is_read_with_one_cyclic_collection_at_most_and_leaves_the_collector_as_it_was(tmp_path: Path) -> None:
    """A blob of 400 modules (2,000 tensors: about an SDXL adapter's) is read back, whole and mapped, setting off at most
    one collection by Python's cyclic garbage collector (the one its objects' count sets off once it is back on), not
    one every 700 of them (where every tenth is of the older generations too); the collector is on after the read if
    it was on before, and off if it was off."""
    modules = [(f"m{i:03d}", canonicalize(*lora(i, 256, 128, 2))) for i in range(400)]
    store = BlobStore(tmp_path)
    staged = store.stage_factors(modules)
    store.commit(staged)
    assert staged.size >= MAPPED_FROM
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        got = dict(store.get_factors(staged.digest))
        assert gc.isenabled() and len(collections) <= 1, collections
        gc.disable()
        try:
            assert torch.equal(dict(store.get_factors(staged.digest))["m399"].U, modules[-1][1].U)
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(count)
    assert all(torch.equal(got[n].U, f.U) and torch.equal(got[n].V, f.V) for n, f in modules)


def test_a_large_factor_blob_reads_back_as_views_that_never_write_to_the_file(tmp_path: Path) -> None:
    """Tensors of a large blob equal those stored; writing to one changes neither the file (it still hashes to its
    digest) nor the next read; a large blob of mixed dtypes (a head) reads back through safetensors, equal too."""
    modules = [(f"m{i}", canonicalize(*lora(i, 3000, 200, 8))) for i in range(12)]
    store = BlobStore(tmp_path)
    staged = store.stage_factors(modules)
    store.commit(staged)
    assert staged.size >= MAPPED_FROM
    got = dict(store.get_factors(staged.digest))
    assert all(torch.equal(got[n].U, f.U) and torch.equal(got[n].S, f.S) and torch.equal(got[n].V, f.V) for n, f in modules)
    assert all(torch.equal(got[n].gauge[0], f.gauge[0]) for n, f in modules if f.gauge is not None)  # type: ignore[index]
    got["m0"].U.mul_(0.0)
    assert store.verify(staged.digest) == "ok"
    assert torch.equal(dict(store.get_factors(staged.digest))["m0"].U, modules[0][1].U)
    head = {"w": torch.randn(600, 600).to(torch.bfloat16), "idx": torch.arange(300_000)}
    mixed = store.stage_tensors(head)
    store.commit(mixed)
    assert mixed.size >= MAPPED_FROM
    back = store.get(mixed.digest)
    assert back.keys() == head.keys() and all(torch.equal(back[k], v) for k, v in head.items())


def reference_raw_sketches(adapters: list[dict], modules: list[tuple[str, int, int]], width: int) -> np.ndarray:
    """The raw-factor sketch one adapter and one module at a time, in torch, as the formula reads."""
    half = width // 2
    out = np.zeros((len(adapters), len(modules), 2, half), dtype=np.float32)
    for m, (name, rows, cols) in enumerate(modules):
        rng = np.random.default_rng(zlib.crc32(f"{name}:{rows}x{cols}".encode()))
        b_rows, b_comp = rng.integers(rows, size=half), rng.integers(RANK_SALT, size=half)
        a_cols, a_comp = rng.integers(cols, size=half), rng.integers(RANK_SALT, size=half)
        for i, factors in enumerate(adapters):
            f = factors.get(name)
            if f is None or f.gauge is None or (f.U.shape[0], f.V.shape[0]) != (rows, cols):
                continue
            M, N = f.gauge[0].double(), f.gauge[1].double()
            r = M.shape[1]
            b = (f.U[b_rows].double() * M[:, b_comp % r].T).sum(dim=1)  # B[o, k] = U[o]·M[:, k]
            a = (N[a_comp % r] * f.V[a_cols].double()).sum(dim=1)  # A[k, c] = N[k]·V[c]
            for part, x in ((0, b), (1, a)):
                out[i, m, part] = (x / torch.linalg.vector_norm(x)).numpy()
    return out.reshape(len(adapters), -1)


def test_raw_sketches_of_mixed_ranks_dtypes_and_missing_modules_are_each_adapters_own() -> None:
    """Adapters of two ranks, in float32 and bfloat16, one lacking a module, one without a gauge (a rank below its
    factors'), one of another shape: each adapter's sketch is the one the formula gives it alone."""
    shapes = {"q": (96, 64), "k": (32, 64)}
    specs = [(0, 4, torch.float32), (1, 8, torch.float32), (2, 4, torch.bfloat16), (3, 8, torch.bfloat16), (4, 4, torch.float32)]
    adapters = []
    for seed, rank, dtype in specs:
        adapter = {}
        for k, (name, (o, i)) in enumerate(shapes.items()):
            f = canonicalize(*(t.float() for t in lora(seed * 10 + k, o, i, rank, dtype)))
            assert f.gauge is not None
            adapter[name] = type(f)(f.U.to(dtype), f.S.to(dtype), f.V.to(dtype), (f.gauge[0].to(dtype), f.gauge[1].to(dtype)))
        adapters.append(adapter)
    del adapters[1]["k"]
    A, B = lora(99, 96, 64, 4)
    low = canonicalize(torch.cat([A[:2], A[:2]]), B)  # rank 2 of 4-wide factors: no gauge
    assert low.gauge is None
    adapters[4]["q"] = low
    adapters.append({"q": canonicalize(*lora(7, 64, 96, 4))})  # another shape of q
    modules = [("k", 32, 64), ("q", 96, 64)]
    got = raw_sketches(adapters, modules, 16)
    want = reference_raw_sketches(adapters, modules, 16)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.abs(got[:4]).sum() > 0 and not got[5].any() and not got[4, 16:].any()


def test_zeros_and_precisions_of_half_precision_factors_are_those_of_their_values() -> None:
    """Zeros of either sign are counted in float16 and bfloat16 as in float32 (and nothing else is: the smallest
    subnormals, negative numbers); a float16 file holds fp16 and a bfloat16 one bf16, a float32 one each only where
    its values fit."""
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 6e-8, -6e-8, 0.0, 3.0])
    for dtype in (torch.float16, torch.bfloat16):
        t = values.to(dtype)
        assert zero_count(t) == int((t.float() == 0).sum()) == 3
    A, B = lora(5, 16, 12, 4)
    for dtype, big, want in ((torch.float16, 1.0, {"fp16"}), (torch.bfloat16, 1e5, {"bf16"}), (torch.float32, 1.0, set())):
        module = LoraModule("m", (A * big).to(dtype), B.to(dtype), 1.0, 1.0)  # 1e5: past float16's range
        assert raw_precisions({"m": module}) == want
    module = LoraModule("m", (A * 1e5).to(torch.bfloat16).float(), B.to(torch.bfloat16).float(), 1.0, 1.0)
    assert raw_precisions({"m": module}) == {"bf16"}
