"""Fuzzing ingest with hypothesis: mutations of real PEFT and kohya files (headers, configs, shapes,
dtypes, offsets, names, bytes). Every mutation ends as ingested, duplicate or failed with a reason
naming the file, and a failure leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select

from tests.factories import train_peft_adapter, write_kohya_file
from zoo.services.ingest import IngestOptions, Ingestor
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter
from zoo.store.session import session_factory, upgrade

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
CONFIG_KEYS = ["r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "fan_in_fan_out", "peft_type",
               "base_model_name_or_path", "target_modules", "task_type"]  # fmt: skip
DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.int64]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-seeds")
    train_peft_adapter(root / "peft", seed=11, steps=2)
    write_kohya_file(root / "kohya.safetensors", seed=11)
    return {"peft": root / "peft", "kohya": root / "kohya.safetensors"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ingestor, Path, str]:
    data = tmp_path_factory.mktemp("fuzz-data")
    url = f"sqlite:///{data / 'zoo.db'}"
    upgrade(url)
    return Ingestor(session_factory(url), BlobStore(data / "blobs"), IngestOptions(base_model="fuzz")), data, url


def weights_of(source: Path) -> Path:
    return source / "adapter_model.safetensors" if source.is_dir() else source


def mutate(source: Path, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["header", "config", "shape", "dtype", "name", "bytes"] if source.is_dir() else
                                     ["header", "shape", "dtype", "name", "bytes"]))  # fmt: skip
    path = weights_of(source)
    if kind == "config":
        cfg = json.loads((source / "adapter_config.json").read_text())
        cfg[data.draw(st.sampled_from(CONFIG_KEYS))] = data.draw(json_values)
        (source / "adapter_config.json").write_text(json.dumps(cfg))
    elif kind == "bytes":
        raw = bytearray(path.read_bytes())
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        else:
            for _ in range(data.draw(st.integers(1, 8))):
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(raw))
    elif kind == "header":
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        key = data.draw(st.sampled_from(sorted(header)))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None or key == "__metadata__":
            header[key] = data.draw(json_values)
        else:
            header[key][field] = data.draw(json_values | st.lists(st.integers(-5, 2**40), max_size=3))
        new = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    else:
        tensors = load_file(str(path))
        key = data.draw(st.sampled_from(sorted(tensors)))
        if kind == "shape":
            shape = data.draw(st.lists(st.integers(0, 70), max_size=3))
            tensors[key] = torch.randn(*shape) if shape else torch.tensor(data.draw(st.floats(-10, 10)))
        elif kind == "dtype":
            tensors[key] = tensors[key].to(data.draw(st.sampled_from(DTYPES)))
        else:
            tensors[data.draw(st.text(min_size=1, max_size=80))] = tensors.pop(key)
        save_file(tensors, str(path))


def state(data_dir: Path, url: str) -> tuple[int, list[str]]:
    with session_factory(url)() as session:
        count = int(session.scalar(select(func.count(Adapter.id))) or 0)
    files = sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*") if p.is_file() and "zoo.db" not in p.name)
    return count, files


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_files_are_ingested_or_refused_and_leave_nothing(seeds: dict[str, Path], store: tuple, data: st.DataObject) -> None:
    ingestor, data_dir, url = store
    which = data.draw(st.sampled_from(["peft", "kohya"]))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / seeds[which].name
        (shutil.copytree if which == "peft" else shutil.copy)(seeds[which], source)
        for _ in range(data.draw(st.integers(1, 3))):
            try:
                mutate(source, data)
            except Exception:  # noqa: BLE001 - a mutation the file no longer allows (it is already broken): keep it
                break
        before = state(data_dir, url)
        result = ingestor.ingest(source)
        after = state(data_dir, url)
    if result.status == "failed":
        assert result.error and str(source) in result.error and "\n" not in result.error
        assert after == before  # no rows, no blob, no temporary file
    elif result.status == "ingested":
        assert result.adapter_id is not None and after[0] == before[0] + 1
        with session_factory(url)() as session:
            row = session.get(Adapter, result.adapter_id)
            assert row is not None and row.factors_blob is not None, result
            blobs = {f"blobs/{BlobStore.key(d)}" for d in (row.factors_blob, row.head_blob) if d is not None}
        # its update's blob, the blob of the tensors kept beside the update where it has any (a pair renamed to a name no
        # reader claims is such a tensor), and no temporary file; a blob may be stored already (another base model's)
        assert set(after[1]) == set(before[1]) | blobs, result.head
    else:  # a mutation that leaves the update as stored (e.g. in metadata only) finds the stored adapter
        assert result.status == "duplicate", result
        assert result.adapter_id is not None and after == before
