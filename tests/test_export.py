"""Exporting stored adapters (zoo/services/export.py, `zoo export`): PEFT loads the export with the stored
update, every export ingests again as a duplicate, and what cannot be written back is refused."""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel
from safetensors.torch import load_file, save_file

from tests.conftest import CLI
from tests.factories import TinyLM, train_peft_adapter, write_kohya_file
from tests.test_formats_diffusers import write_lora_diffusion_file
from tests.test_formats_lycoris import lycoris_file
from zoo.config import Settings
from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.fingerprint import NamedFactors
from zoo.errors import NotFoundError, StorageError, UsageError
from zoo.formats import read_adapter
from zoo.services.describe import describe
from zoo.services.export import ExportMeta, export_files, export_zip, file_stem, load_for_export, lora_factors
from zoo.services.ingest import UNKNOWN_BASE, IngestOptions, Ingestor, canonicalize_modules
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter
from zoo.store.repository import get_adapter
from zoo.store.session import session_factory

BASE = "tiny-lm"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real adapters: plain PEFT; PEFT on embeddings and GPT-2 Conv1D layers (fan_in_fan_out) with rsLoRA and
    rank/alpha patterns; PEFT with a modules_to_save head; DoRA; kohya files with and without a conv module;
    a full checkpoint and its base."""
    root = tmp_path_factory.mktemp("export-sources")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about the tiny model's layers
        train_peft_adapter(root / "plain", seed=1, steps=3)
        train_peft_adapter(
            root / "varied",
            seed=2,
            steps=3,
            targets=("embed", "c_fc", "c_proj"),
            fan_in_fan_out=True,
            use_rslora=True,
            rank_pattern={"c_fc": 2},
            alpha_pattern={"c_proj": 3},
        )
        train_peft_adapter(root / "head", seed=3, steps=2, modules_to_save=["head"])
        train_peft_adapter(root / "dora", seed=4, steps=1, use_dora=True)
    write_kohya_file(root / "kohya.safetensors", seed=5, conv=False)
    write_kohya_file(root / "kohya-conv.safetensors", seed=6)
    gen = torch.Generator().manual_seed(7)
    base = {"layers.0.w": torch.randn(8, 8, generator=gen)}
    save_file(base, str(root / "base.safetensors"))
    save_file(
        {"layers.0.w": base["layers.0.w"] + torch.randn(8, 2, generator=gen) @ torch.randn(2, 8, generator=gen)},
        str(root / "ft.safetensors"),
    )
    return root


def ingest(settings: Settings, path: Path, **options: object) -> int:
    ingestor = Ingestor(session_factory(settings.database_url), BlobStore(settings.blob_dir), IngestOptions(**options))
    result = ingestor.ingest(path)
    assert result.status == "ingested", result.error
    return int(result.adapter_id)


def load(settings: Settings, adapter_id: int) -> tuple[NamedFactors, ExportMeta]:
    with session_factory(settings.database_url)() as session:
        return load_for_export(session, BlobStore(settings.blob_dir), adapter_id)


def stored(settings: Settings, adapter_id: int) -> Adapter:
    with session_factory(settings.database_url)() as session:
        return get_adapter(session, adapter_id)


def stored_before_0016(settings: Settings, adapter_id: int) -> None:
    """Make a stored adapter what one stored before migration 0016 is: no head blob, no conv kernels (its export takes
    them from its source file where that is still the file ingested)."""
    with session_factory(settings.database_url)() as session, session.begin():
        adapter = get_adapter(session, adapter_id, with_modules=True)
        adapter.head_blob = None
        for m in adapter.modules:
            m.kernel = None


def write(files: dict[str, bytes], directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def merged_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return PeftModel.from_pretrained(TinyLM(), str(adapter_dir)).merge_and_unload().state_dict()


@pytest.mark.parametrize("source", ["plain", "varied"])
def test_peft_loads_the_export_with_the_stored_update(settings: Settings, sources: Path, tmp_path: Path, source: str) -> None:
    factors, meta = load(settings, ingest(settings, sources / source, base_model=BASE))
    out = write(export_files(factors, meta, "peft"), tmp_path / "export")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["base_model_name_or_path"]) == (4, 4, False, BASE)
    if source == "varied":  # the rank-2 modules by exact name, scaling 1 everywhere
        assert config["rank_pattern"] == config["alpha_pattern"] == {r"^layers\.0\.c_fc": 2, r"^layers\.1\.c_fc": 2}
        assert config["fan_in_fan_out"] and set(config["target_modules"]) == {"embed", "c_fc", "c_proj"}

    original, exported, base = merged_weights(sources / source), merged_weights(out), TinyLM().state_dict()
    assert original.keys() == exported.keys()
    changed = [k for k in original if not torch.equal(original[k], base[k])]
    assert len(changed) == (4 if source == "plain" else 5)
    for key in original:
        torch.testing.assert_close(exported[key], original[key], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("source", "base_model"), [("plain", BASE), ("varied", BASE), ("kohya.safetensors", "sd-v1-5")])
def test_every_export_ingests_again_as_the_same_adapter(
    settings: Settings, sources: Path, tmp_path: Path, source: str, base_model: str
) -> None:
    adapter_id = ingest(settings, sources / source, **({"base_model": BASE} if base_model == BASE else {}))
    factors, meta = load(settings, adapter_id)
    stored_hash = stored(settings, adapter_id).canonical_hash

    zipped = export_zip(factors, meta)
    assert zipped == export_zip(factors, meta)  # deterministic bytes
    with zipfile.ZipFile(io.BytesIO(zipped)) as zf:
        assert sorted(zf.namelist()) == [f"{meta.name}/adapter_config.json", f"{meta.name}/adapter_model.safetensors"]
        zf.extractall(tmp_path / "unzipped")
    exports = {
        "peft": write(export_files(factors, meta, "peft"), tmp_path / "peft"),
        "zip": tmp_path / "unzipped" / meta.name,
        **{fmt: write(export_files(factors, meta, fmt), tmp_path / fmt) for fmt in ("diffusers", "kohya")},
    }
    kohya = load_file(str(next(exports["kohya"].iterdir())))
    assert {float(v) for k, v in kohya.items() if k.endswith(".alpha")} == {float(f.rank) for _, f in factors}

    ingestor = Ingestor(session_factory(settings.database_url), BlobStore(settings.blob_dir), IngestOptions())
    for fmt, path in exports.items():
        path = path if fmt in ("peft", "zip") else next(path.iterdir())
        data = read_adapter(path)
        canonical = canonicalize_modules(data.modules, torch.device("cpu"))
        described = describe(data, str(path), data.base_model or UNKNOWN_BASE, canonical).adapter
        assert (described.canonical_hash, described.base_model) == (stored_hash, base_model), fmt
        result = ingestor.ingest(path)
        assert (result.status, result.adapter_id) == ("duplicate", adapter_id), (fmt, result.error)


def test_what_cannot_be_exported_is_refused(settings: Settings, sources: Path, tmp_path: Path) -> None:
    factors, meta = load(settings, ingest(settings, sources / "plain"))
    assert meta.base_model is None  # unknown: written as such, not as "unknown"
    with pytest.raises(UsageError, match="unknown export format 'onnx'"):
        export_files(factors, meta, "onnx")
    conv = tmp_path / "conv.safetensors"  # stored before kernels were: its kernel size is read from the source file, gone here
    conv.write_bytes((sources / "kohya-conv.safetensors").read_bytes())
    conv_id = ingest(settings, conv)
    stored_before_0016(settings, conv_id)
    conv.unlink()
    write_lora_diffusion_file(tmp_path / "lora_diffusion.safetensors")
    lycoris_file(tmp_path / "full.safetensors", "full")
    refused = {
        conv_id: f"resnets.0.conv1 is a conv layer whose kernel size is not stored .*, nor read from a source file at {conv}",
        ingest(settings, sources / "dora"): "is a DoRA adapter",
        ingest(settings, sources / "ft.safetensors"): "is a checkpoint, not a LoRA adapter",  # spectra only: no factors
        ingest(settings, tmp_path / "lora_diffusion.safetensors"): "its modules are named by the order",
        ingest(settings, tmp_path / "full.safetensors"): "is stored as its spectrum only",  # LyCORIS full: spectra only
    }
    for adapter_id, reason in refused.items():
        factors, meta = load(settings, adapter_id)
        for fmt in ("peft", "diffusers", "kohya"):
            with pytest.raises(UsageError, match=reason):
                export_files(factors, meta, fmt)
    factors, meta = load(settings, ingest(settings, sources / "ft.safetensors", base_checkpoint=sources / "base.safetensors"))
    with pytest.raises(UsageError, match="is a checkpoint-delta, not a LoRA adapter"):
        export_zip(factors, meta)
    with pytest.raises(NotFoundError, match="no adapter with id 999"):
        load(settings, 999)

    adapter_id = ingest(settings, sources / "varied")
    blob = BlobStore(settings.blob_dir).path(stored(settings, adapter_id).factors_blob)
    blob.write_bytes(b"not a blob")
    with pytest.raises(StorageError, match="missing or unreadable"):
        load(settings, adapter_id)
    blob.unlink()
    with pytest.raises(StorageError, match="missing or unreadable.*ingest the adapter again"):
        load(settings, adapter_id)


def test_zoo_export_command(cli: CLI, sources: Path, tmp_path: Path) -> None:
    conv = tmp_path / "conv.safetensors"
    conv.write_bytes((sources / "kohya-conv.safetensors").read_bytes())
    rc, results = cli.json_lines("ingest", "--no-embed", str(sources / "head"), str(conv))
    assert rc == 0 and results[0]["head"]["tensors"] == ["head.bias", "head.weight"] and results[1]["head"] is None
    head_id, conv_id = (r["adapter_id"] for r in results)
    conv.unlink()  # its conv modules' kernels are stored: its export needs no source file
    rc, (info,) = cli.json_lines("export", str(head_id), "--format", "peft", "--out", str(tmp_path / "peft"))
    assert rc == 0 and info["files"] == [
        str(tmp_path / "peft" / "adapter_config.json"),
        str(tmp_path / "peft" / "adapter_model.safetensors"),
    ]
    assert info["size_bytes"] == sum(Path(p).stat().st_size for p in info["files"])
    assert info["notes"] == []  # the head is stored with the adapter: nothing is left out
    rc, (info,) = cli.json_lines("export", str(head_id), "--format", "peft", "--out", str(tmp_path / "head.zip"))
    assert rc == 0 and zipfile.is_zipfile(tmp_path / "head.zip")
    rc, (again,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "head.zip"))  # what export writes, ingest and search read
    assert rc == 0 and again["status"] == "duplicate" and again["adapter_id"] == head_id and again["name"] == "head"
    assert cli("embed")[0] == 0
    rc, (found,) = cli.json_lines("search", str(tmp_path / "head.zip"), "-k", "1", "--space", space_of(cli, head_id))
    assert rc == 0 and found["query_name"] == "head" and found["stored_as"] == {"adapter_id": head_id, "name": "head"}
    (tmp_path / "broken.zip").write_bytes((tmp_path / "head.zip").read_bytes()[:-100])
    rc, (bad,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "broken.zip"))
    assert rc == 1 and bad["status"] == "failed" and "broken.zip" in bad["error"] and "not a readable zip" in bad["error"]

    rc, out, _ = cli("export", str(head_id), "--format", "kohya", "--out", str(tmp_path))  # an existing directory
    assert rc == 0 and (tmp_path / "head.safetensors").is_file() and "exported as kohya" in out and "note:" in out
    rc, _, err = cli("export", str(head_id), "--format", "kohya", "--out", str(tmp_path / "head.safetensors"))
    assert rc == 2 and "head.safetensors exists: choose another --out" in err
    for args, reason in [
        ((str(head_id), "--format", "onnx"), "unknown export format 'onnx'"),
        (("999", "--format", "peft"), "no adapter with id 999"),
    ]:
        rc, _, err = cli("export", *args, "--out", str(tmp_path / "never"))
        assert rc == 2 and reason in err and not (tmp_path / "never").exists()
    assert cli("export", str(conv_id), "--format", "diffusers", "--out", str(tmp_path / "conv"))[0] == 0


def space_of(cli: CLI, adapter_id: int) -> str:
    rc, (shown,) = cli.json_lines("show", str(adapter_id))
    return str(shown["base_model"])


def random_factors(seed: int, out: int, inp: int, k: int) -> CanonicalFactors:
    gen = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(out, k, generator=gen, dtype=torch.float64))[0].float()
    V = torch.linalg.qr(torch.randn(inp, k, generator=gen, dtype=torch.float64))[0].float()
    S = torch.sort(torch.rand(k, generator=gen) * 10 + 0.1, descending=True).values
    return CanonicalFactors(U, S, V)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 12), st.integers(1, 12), st.data())
def test_exported_factors_rebuild_the_canonical_update(seed: int, out: int, inp: int, data: st.DataObject) -> None:
    f = random_factors(seed, out, inp, data.draw(st.integers(0, min(out, inp)), label="k"))
    A, B = lora_factors(f)
    assert A.shape == (max(f.rank, 1), inp) and B.shape == (out, max(f.rank, 1))
    torch.testing.assert_close(B @ A, f.delta(), atol=1e-5, rtol=1e-5)
    again = canonicalize(A, B)  # the canonical form of the exported factors is the stored one
    torch.testing.assert_close(again.S, f.S, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.delta(), f.delta(), atol=1e-5, rtol=1e-5)


def test_file_names_are_safe() -> None:
    meta = ExportMeta(1, "../../etc/My LoRA (v2)", "peft", None, {}, {})
    assert file_stem(meta) == "etc_My_LoRA_v2"
    assert file_stem(ExportMeta(7, "..", "peft", None, {}, {})) == "adapter-7"
