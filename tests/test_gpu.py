"""CUDA paths agree with the CPU: batched canonicalization, W2T training and embedding, the index.

Skipped where torch sees no GPU (CI has none); run on a GPU machine with `pytest tests/test_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embed.data.types import ZooAdapter, schema_of
from embed.serving.index import AdapterIndex, gpu_available
from embed.training.train import train_w2t
from embed.training.train_options import TrainOptions
from embed.w2t.ensemble import W2TEnsemble
from tests.test_canonical import random_lora
from tests.test_embed import synthetic_zoo
from zoo.domain.fingerprint import DUPLICATE_RTOL, relative_distance
from zoo.formats.records import LoraModule
from zoo.services.ingest import canonicalize_modules

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_batched_canonicalization_on_cuda_is_the_same_update_as_on_cpu() -> None:
    modules = []
    for i, (out, inp, r) in enumerate([(96, 64, 8), (64, 96, 8), (128, 128, 4), (32, 48, 16), (96, 64, 8)]):
        A, B = random_lora(i, out, inp, r)
        modules.append(LoraModule(f"m{i}", A, B, alpha=2.0 * r, scale=2.0))
    cpu = canonicalize_modules(modules, torch.device("cpu"))
    gpu = canonicalize_modules(modules, torch.device("cuda"))
    for c, g in zip(cpu, gpu, strict=True):
        assert g.U.device.type == "cpu"  # returned on the CPU, as the ingest pipeline stores them
        assert torch.allclose(c.S, g.S, rtol=1e-4, atol=0)
    named = lambda fs: [(f"m{i}", f) for i, f in enumerate(fs)]  # noqa: E731
    assert relative_distance(named(cpu), named(gpu)) < DUPLICATE_RTOL  # a GPU ingest finds the CPU copy as a duplicate


@pytest.fixture(scope="module")
def zoo() -> list[ZooAdapter]:
    return synthetic_zoo(n_per_task=10, tasks=4, seed=3)


def test_w2t_trained_on_cuda_embeds_the_same_on_cpu(zoo: list[ZooAdapter], tmp_path: Path) -> None:
    schema = schema_of("synthetic", zoo)
    emb = train_w2t(zoo, schema, TrainOptions(epochs=3, seed=0, members=2, device="cuda"), progress=False)
    assert next(emb.models[0].parameters()).device.type == "cuda"
    z_gpu = emb.embed(zoo)
    emb.save(tmp_path / "ckpt")
    z_cpu = W2TEnsemble.load(tmp_path / "ckpt", device="cpu").embed(zoo)
    assert np.min((z_gpu * z_cpu).sum(axis=1)) >= 0.9999


def test_index_search_matches_brute_force_with_the_gpu_build_when_present() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(2000, 64)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = np.arange(10, 2010, dtype=np.int64)
    index = AdapterIndex.build(ids, vectors)
    scores, found = index.search(vectors[:20], 10)
    truth = ids[np.argsort(-(vectors[:20] @ vectors.T), axis=1)[:, :10]]
    assert np.array_equal(found, truth)  # exact: no mismatch allowed
    assert np.allclose(scores[:, 0], 1.0, atol=1e-4)
    print(f"faiss GPU build in use: {gpu_available()}")
