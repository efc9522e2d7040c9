"""Exports load where users load them: PEFT's `PeftModel.from_pretrained` loads a classifier adapter's export with
its head (DistilBERT, GPT-2, BERT), and diffusers' `load_lora_weights` loads the kohya and the diffusers export of
an SD LoRA; each applies the update the original file applies in the same library."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    PreTrainedModel,
)

from tests.conftest import CLI
from tests.diffusers_models import add_random_lora, fused_deltas, tiny_unet, write_current_lora
from tests.hub_server import FakeRepo, HubServer
from tests.test_export import ingest, load, stored_before_0016, write
from tests.test_hub import hub  # noqa: F401 - the fake Hub, as a fixture
from zoo.config import Settings
from zoo.domain.kohya_names import kohya_names
from zoo.formats.diffusers import module_name
from zoo.services.export import export_files, export_notes

VOCAB, LABELS = 50, 3
#: tiny sequence classifiers built from configs, and the modules their LoRA targets
CLASSIFIERS: dict[str, tuple[Callable[[], PreTrainedModel], list[str]]] = {
    "distilbert": (
        lambda: DistilBertForSequenceClassification(
            DistilBertConfig(vocab_size=VOCAB, dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=16, num_labels=LABELS)
        ),
        ["q_lin", "v_lin"],
    ),
    "gpt2": (
        lambda: GPT2ForSequenceClassification(
            GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16, num_labels=LABELS, pad_token_id=0)
        ),
        ["c_attn"],
    ),
    "bert": (
        lambda: BertForSequenceClassification(
            BertConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=16,
                num_labels=LABELS,
            )
        ),
        ["query", "value"],
    ),
}
#: what is measured is the export and the library loading it, not the database: SQLite only (tests/test_export.py runs both)
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
IDS = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))


def classifier(kind: str) -> PreTrainedModel:
    """The same base model every time (seeded), its head drawn anew as transformers draws it."""
    torch.manual_seed(0)
    return CLASSIFIERS[kind][0]().eval()


def write_seq_cls_adapter(kind: str, directory: Path, seed: int = 1) -> None:
    """A SEQ_CLS LoRA saved by PEFT, its factors and its head (modules_to_save) moved off their initial values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(classifier(kind), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=CLASSIFIERS[kind][1]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:  # LoRA factors and the head's trained copy
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(str(directory))


def peft_loaded(kind: str, directory: Path) -> PeftModel:
    return PeftModel.from_pretrained(classifier(kind), str(directory)).eval()


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every weight within 1e-5 of the other's norm (relative)."""
    assert got.keys() == want.keys()
    for key in want:
        diff = float((got[key].double() - want[key].double()).norm())
        assert diff <= 1e-5 * max(float(want[key].double().norm()), 1e-12), (key, diff)


@SQLITE
@pytest.mark.parametrize("kind", list(CLASSIFIERS))
def test_peft_loads_a_classifier_export_with_its_head(settings: Settings, tmp_path: Path, kind: str) -> None:
    write_seq_cls_adapter(kind, tmp_path / "source")
    factors, meta = load(settings, ingest(settings, tmp_path / "source", base_model=kind))
    out = write(export_files(factors, meta, "peft"), tmp_path / "export")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier", "score"]
    assert export_notes(meta, "peft") == []  # the head is stored

    original, exported = peft_loaded(kind, tmp_path / "source"), peft_loaded(kind, out)
    with torch.no_grad():
        want, got = original(IDS).logits, exported(IDS).logits
    assert float((got - want).norm()) <= 1e-5 * float(want.norm())
    assert not torch.allclose(want, classifier(kind)(IDS).logits)  # the adapter and its head change the logits
    assert_same_weights(exported.merge_and_unload().state_dict(), original.merge_and_unload().state_dict())


@SQLITE
def test_a_hub_adapter_is_exported_with_its_head_from_the_hub_cache(cli: CLI, hub: HubServer, tmp_path: Path) -> None:  # noqa: F811
    write_seq_cls_adapter("bert", tmp_path / "source")
    hub.repos["alice/bert-cls"] = FakeRepo.from_dir(tmp_path / "source")
    rc, [ingested] = cli.json_lines("ingest", "--no-embed", "hf://alice/bert-cls")
    assert rc == 0 and ingested["status"] == "ingested", ingested
    stored_before_0016(cli.settings, ingested["adapter_id"])  # no head stored: it is read from the Hub cache
    rc, [info] = cli.json_lines("export", str(ingested["adapter_id"]), "--format", "peft", "--out", str(tmp_path / "export"))
    assert rc == 0 and "written from the source file" in info["notes"][0] and "models--alice--bert-cls" in info["notes"][0]
    with torch.no_grad():
        want, got = (peft_loaded("bert", d)(IDS).logits for d in (tmp_path / "source", tmp_path / "export"))
    assert float((got - want).norm()) <= 1e-5 * float(want.norm())


@SQLITE
def test_a_head_not_found_as_ingested_is_left_out_and_its_task_type_cleared(settings: Settings, tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_seq_cls_adapter("distilbert", source)
    original = peft_loaded("distilbert", source).merge_and_unload().state_dict()
    factors, meta = load(settings, ingest(settings, source, base_model="distilbert"))
    stored_before_0016(settings, meta.adapter_id)  # no head stored: it is read from the source file, if that is as ingested
    write_seq_cls_adapter("distilbert", source, seed=2)  # another head where the source was: not the bytes ingested

    factors, meta = load(settings, meta.adapter_id)
    out = write(export_files(factors, meta, "peft"), tmp_path / "export")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["task_type"] is None and config["modules_to_save"] is None
    assert not any("classifier" in key for key in load_file(str(out / "adapter_model.safetensors")))
    notes = export_notes(meta, "peft")
    assert f"are not stored and the source is not at {source} as ingested" in notes[0] and "task_type SEQ_CLS cleared" in notes[1]

    exported = PeftModel.from_pretrained(classifier("distilbert"), str(out)).merge_and_unload().state_dict()
    head = ("pre_classifier.", "classifier.")
    assert_same_weights(
        {k: v for k, v in exported.items() if not k.startswith(head)}, {k: v for k, v in original.items() if not k.startswith(head)}
    )


@SQLITE
def test_diffusers_loads_the_kohya_and_diffusers_exports_of_an_sd_lora(settings: Settings, tmp_path: Path) -> None:
    source = write_current_lora(tmp_path / "source")
    reference = fused_deltas(source)
    assert {k.split(".")[0] for k in reference} == {"unet", "text_encoder"}
    factors, meta = load(settings, ingest(settings, source))
    exports = {fmt: write(export_files(factors, meta, fmt), tmp_path / fmt) for fmt in ("kohya", "diffusers")}
    kohya = next(exports["kohya"].iterdir())
    assert {k.split("_")[1] for k in load_file(str(kohya))} == {"unet", "te"}  # lora_unet_…, lora_te_…
    for path in (kohya, exports["diffusers"] / "pytorch_lora_weights.safetensors"):
        assert_same_weights(fused_deltas(path), reference)
    # the kohya export reads back as this adapter, its duplicate: tests/test_formats_diffusers.py


@SQLITE
def test_conv_modules_are_exported_with_the_kernels_of_their_source_file(settings: Settings, tmp_path: Path) -> None:
    """3×3 resnet convs and 1×1 projections of an adapter stored before kernels were (its factors hold only in·kh·kw):
    the kernel is read from the source file."""
    layers = add_random_lora(tiny_unet(), ("to_q", "conv1", "proj_in"), seed=3)
    StableDiffusionPipeline.save_lora_weights(tmp_path / "source", unet_lora_layers=layers)
    source = tmp_path / "source" / "pytorch_lora_weights.safetensors"
    reference = fused_deltas(source)
    assert {tuple(d.shape[2:]) for d in reference.values() if d.ndim == 4} == {(1, 1), (3, 3)}
    adapter_id = ingest(settings, source)
    stored_before_0016(settings, adapter_id)
    factors, meta = load(settings, adapter_id)
    assert {m.kind for m in meta.modules.values()} == {"linear", "conv"}
    for fmt in ("kohya", "diffusers"):
        assert_same_weights(fused_deltas(next(write(export_files(factors, meta, fmt), tmp_path / fmt).iterdir())), reference)


def test_kohya_names_of_sdxl_modules_are_those_diffusers_converts_back() -> None:
    """Both text encoders (lora_te1_, lora_te2_) and UNet blocks: diffusers' kohya conversion gives back each module."""
    names = [
        "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
        "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0",
        "unet.mid_block.attentions.0.proj_in",
        "unet.up_blocks.0.attentions.1.transformer_blocks.0.ff.net.0.proj",
        "text_encoder.encoder.layers.0.self_attn.q_proj",
        "text_encoder_2.encoder.layers.1.self_attn.out_proj",
        "text_encoder_2.encoder.layers.1.mlp.fc1",
    ]
    state = {}
    for kohya in kohya_names(names).values():
        assert kohya is not None
        state |= {
            f"{kohya}.lora_down.weight": torch.zeros(2, 4),
            f"{kohya}.lora_up.weight": torch.zeros(4, 2),
            f"{kohya}.alpha": torch.tensor(2.0),
        }
    converted, _ = StableDiffusionXLPipeline.lora_state_dict(state)  # diffusers' names, in its attn-procs layout
    downs = [k for k in converted if k.endswith("down.weight")]
    stems = [
        k.removesuffix("_lora.down.weight").removesuffix(".lora_linear_layer.down.weight").removesuffix(".lora.down.weight") for k in downs
    ]
    assert sorted(module_name(stem, "attn-procs") for stem in stems) == sorted(names)
