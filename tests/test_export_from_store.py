"""Exports from the zoo alone: ingest stores a PEFT adapter's head (its tensors that are not LoRA factors) as a blob
and each conv module's kernel in its row, so an adapter whose source is deleted exports whole (zoo/services/file_parts.py);
the head blob goes with the adapter like its factors' blob; the adapter page offers the downloads an export writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load, save_file

from embed.serving.adapter_resource import delete_adapter
from tests.conftest import CLI
from tests.diffusers_models import add_random_lora, fused_deltas, tiny_unet
from tests.factories import train_peft_adapter, write_kohya_file
from tests.test_export import load as load_stored
from tests.test_export import stored_before_0016, write
from tests.test_export_loads import IDS, assert_same_weights, peft_loaded, write_seq_cls_adapter
from tests.test_formats_diffusers import write_lora_diffusion_file
from webapp import create_app
from zoo.errors import UsageError
from zoo.services.export import FORMATS, ExportMeta, ModuleLayout, check_exportable, export_files, export_notes, exportable_formats
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

#: DistilBERT's SEQ_CLS head: PEFT's modules_to_save "classifier" matches pre_classifier too
HEAD = "classifier.bias, classifier.weight, pre_classifier.bias, pre_classifier.weight"


def test_a_classifier_exports_with_its_head_after_its_source_is_deleted(cli: CLI, tmp_path: Path) -> None:
    """A DistilBERT SEQ_CLS adapter: ingest says its head is stored (and `zoo show` lists it); with the source directory
    deleted, PEFT loads the export and gives the original's logits; deleting the adapter leaves its head blob to
    `zoo check --repair`, as its factors' blob, and the zoo checks clean."""
    source = tmp_path / "source"
    write_seq_cls_adapter("distilbert", source)
    with torch.no_grad():
        want = peft_loaded("distilbert", source)(IDS).logits
    rc, out, _ = cli("ingest", "--no-embed", str(source), "--base-model", "distilbert")
    assert rc == 0 and f"with its head (4 tensors: {HEAD};" in out
    rc, (shown,) = cli.json_lines("show", "1")
    head_blob = BlobStore(cli.settings.blob_dir).path(shown["head_blob"])
    assert head_blob.is_file() and head_blob != BlobStore(cli.settings.blob_dir).path(shown["factors_blob"])
    assert f"head: 4 tensors: {HEAD} (stored for exports" in cli("show", "1")[1]
    shutil.rmtree(source)

    rc, (info,) = cli.json_lines("export", "1", "--format", "peft", "--out", str(tmp_path / "export"))
    assert rc == 0 and info["notes"] == []
    config = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier", "score"]
    with torch.no_grad():
        got = peft_loaded("distilbert", tmp_path / "export")(IDS).logits
    assert float((got - want).norm()) <= 1e-5 * float(want.norm())

    assert delete_adapter(session_factory(cli.settings.database_url), 1)["deleted"]
    rc, (found,) = cli.json_lines("check", "--grace", "0")
    assert rc == 1 and str(head_blob) in found["orphans"] and found["blobs"]["rows"] == 0
    assert cli("check", "--repair", "--grace", "0")[0] == 0 and not head_blob.exists()
    rc, (after,) = cli.json_lines("check", "--grace", "0")
    assert rc == 0 and after["ok"] and after["orphans"] == []


def test_a_conv_lora_exports_with_its_kernels_after_its_source_is_deleted(cli: CLI, tmp_path: Path) -> None:
    """3×3 resnet convs and 1×1 projections of a diffusers SD LoRA: their kernels are stored at ingest, and with the
    file deleted diffusers loads the kohya and the diffusers export with the original's fused weights."""
    layers = add_random_lora(tiny_unet(), ("to_q", "conv1", "proj_in"), seed=3)
    StableDiffusionPipeline.save_lora_weights(tmp_path / "source", unet_lora_layers=layers)
    source = tmp_path / "source" / "pytorch_lora_weights.safetensors"
    reference = fused_deltas(source)
    rc, (ingested,) = cli.json_lines("ingest", "--no-embed", str(source))
    assert rc == 0 and ingested["status"] == "ingested"
    shutil.rmtree(tmp_path / "source")

    rc, (shown,) = cli.json_lines("show", "1")
    kernels = {tuple(m["kernel"][1:]) for m in shown["modules"] if m["kind"] == "conv"}
    assert kernels == {(1, 1), (3, 3)} and all(m["kernel"] is None for m in shown["modules"] if m["kind"] != "conv")
    factors, meta = load_stored(cli.settings, 1)
    for fmt in ("kohya", "diffusers"):
        assert_same_weights(fused_deltas(next(write(export_files(factors, meta, fmt), tmp_path / fmt).iterdir())), reference)


def test_a_head_past_the_limit_is_not_stored_and_is_read_from_its_source_file(
    cli: CLI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZOO_MAX_HEAD_BYTES bounds the head stored: past it, ingest notes it and stores none; an export reads it from the
    source file while that is as ingested, and leaves it out, saying so, once it is gone."""
    train_peft_adapter(tmp_path / "head", seed=3, steps=1, modules_to_save=["head"])  # head: 3×16 + 3 float32 = 204 bytes
    monkeypatch.setenv("ZOO_MAX_HEAD_BYTES", "200")
    rc, (ingested,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "head"))
    assert rc == 0 and ingested["head"] is None
    assert "the head (2 tensors that are not LoRA factors) is not stored: its 204 bytes are past the limit of 200" in " ".join(
        ingested["notes"]
    )
    factors, meta = load_stored(cli.settings, 1)
    assert meta.heads is not None and f"written from the source file {tmp_path / 'head'}" in export_notes(meta, "peft")[0]
    shutil.rmtree(tmp_path / "head")
    factors, meta = load_stored(cli.settings, 1)
    assert meta.heads is None and "are not stored and the source is not at" in export_notes(meta, "peft")[0]
    assert not [key for key in load(export_files(factors, meta, "peft")["adapter_model.safetensors"]) if ".head." in key]


def test_the_adapter_page_offers_only_the_downloads_an_export_writes(cli: CLI, tmp_path: Path) -> None:
    """A kohya file with conv modules offers all three; a cloneofsimo file none (its modules have no model names); a
    conv adapter stored before kernels were, its source gone, none; each offered download is written."""
    write_kohya_file(tmp_path / "conv.safetensors", seed=6)
    write_lora_diffusion_file(tmp_path / "lora_diffusion.safetensors")
    write_kohya_file(tmp_path / "old-conv.safetensors", seed=7)
    names = ("conv", "lora_diffusion", "old-conv")
    rc, results = cli.json_lines("ingest", "--no-embed", *(str(tmp_path / f"{n}.safetensors") for n in names))
    assert rc == 0 and [r["adapter_id"] for r in results] == [1, 2, 3]
    stored_before_0016(cli.settings, 3)
    (tmp_path / "old-conv.safetensors").unlink()
    (tmp_path / "conv.safetensors").unlink()  # its kernels are stored
    app = create_app({"ZOO_DATABASE_URL": cli.settings.database_url, "ZOO_DATA_DIR": str(cli.settings.data_dir), "TESTING": True})
    client = app.test_client()
    head = tmp_path / "head"
    train_peft_adapter(head, seed=3, steps=1, modules_to_save=["head"])
    assert cli("ingest", "--no-embed", str(head))[0] == 0
    page = client.get("/adapters/4").get_data(as_text=True)
    assert "2 tensors beside the LoRA factors (head.bias, head.weight), stored: the peft download has them" in page
    for adapter_id, offered in ((1, FORMATS), (2, ()), (3, ()), (4, FORMATS)):
        page = client.get(f"/adapters/{adapter_id}").get_data(as_text=True)
        assert [fmt for fmt in FORMATS if f"format={fmt}" in page] == list(offered), adapter_id
        assert ("Download:" in page) == bool(offered)
        for fmt in FORMATS:
            assert (client.get(f"/api/v1/adapters/{adapter_id}/download?format={fmt}").status_code == 200) == (fmt in offered)


def test_two_modules_of_one_kohya_name_are_refused_before_an_export_is_written() -> None:
    """A module under its diffusers path and one under its kohya name: no file of kohya's layout can hold both, so the
    kohya export (and the diffusers one, written in kohya's layout for kohya-named modules) is refused by
    `check_exportable`, which the adapter page asks, not midway through writing."""
    layout = ModuleLayout("linear", False)
    names = ("unet.down_blocks.0.attentions.0.proj_in", "lora_unet_down_blocks_0_attentions_0_proj_in")
    meta = ExportMeta(1, "twins", "diffusers", None, {}, dict.fromkeys(names, layout))
    assert exportable_formats(meta) == ["peft"]
    with pytest.raises(UsageError, match="have one kohya name, lora_unet_down_blocks_0_attentions_0_proj_in"):
        check_exportable(meta, "kohya")


def test_the_kernels_of_a_file_whose_every_name_is_prefixed_are_stored(cli: CLI, tmp_path: Path) -> None:
    """DDP's `module.` before every name of a kohya conv file: its kernels are found under the names as read and stored;
    with the file deleted, its kohya export holds the plain file's tensors (the same update at the same rank)."""
    tensors = write_kohya_file(tmp_path / "plain.safetensors", seed=6)
    save_file({"module." + k: v for k, v in tensors.items()}, str(tmp_path / "prefixed.safetensors"))
    rc, (ingested,) = cli.json_lines("ingest", "--no-embed", str(tmp_path / "prefixed.safetensors"))
    assert rc == 0 and ingested["status"] == "ingested"
    (tmp_path / "prefixed.safetensors").unlink()
    rc, (shown,) = cli.json_lines("show", "1")
    assert [m["kernel"] for m in shown["modules"] if m["kind"] == "conv"] == [[8, 3, 3]]
    factors, meta = load_stored(cli.settings, 1)
    exported = load(next(iter(export_files(factors, meta, "kohya").values())))
    convs = [k for k in tensors if k.endswith("lora_down.weight") and tensors[k].ndim == 4]
    assert convs and all(exported[k].shape == tensors[k].shape for k in convs)
