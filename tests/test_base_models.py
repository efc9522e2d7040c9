"""The base model from the shapes when neither the user nor the files name one (zoo/domain/base_models.py): adapters at
the real module shapes of public models (zoo/reference/real_shapes.py, one block each; BERT, DistilBERT and GPT-2
written by PEFT on their transformers configs) land in their family's space, SD 1.5 and SD 2 no longer in one; a named
base the shapes contradict is stored as named, with a warning; `zoo check` names an adapter that does not fit its space."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel, GPT2Config, GPT2Model

from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from zoo.domain.base_models import guess_base_model
from zoo.domain.model_shapes import VOCABULARIES
from zoo.reference.real_shapes import write_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the space each kind's adapter lands in when nothing names its base; Llama-3-8B and Mistral-7B adapt projections of
#: the same shapes: without a token embedding or LM head nothing tells them apart
FAMILY = {
    "sd1.5": "sd1.x",
    "sd2.1": "sd2.x",
    "sdxl": "sdxl",
    "flux1-dev": "flux.1",
    "llama3-8b": "llama-3-8b-or-mistral-7b",
    "mistral-7b": "llama-3-8b-or-mistral-7b",
    "qwen2.5-7b": "qwen2.5-7b",
}


def _ingest(cli: CLI, *args: str) -> tuple[int, list[dict], str]:
    """`zoo ... --json`: exit status, JSON lines and stderr."""
    rc, out, err = cli(*args, "--json")
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_adapters_without_a_named_base_land_in_their_familys_space(cli: CLI, tmp_path: Path) -> None:
    """One block of each model, its files naming no base: each stored under its family (a space per base model: SD 1.5
    and SD 2.1 apart), noted as guessed."""
    paths = {kind: write_adapter(kind, tmp_path / "written", family=0, member=0, layers=1, name_base=False) for kind in FAMILY}
    rc, rows, err = _ingest(cli, "ingest", "--no-embed", *map(str, paths.values()))
    assert rc == 0 and all(r["status"] == "ingested" and not r["warnings"] for r in rows), rows
    by_kind = dict(zip(paths, rows, strict=True))
    for kind, row in by_kind.items():
        rc, (shown,) = cli.json_lines("show", str(row["adapter_id"]))
        assert shown["base_model"] == FAMILY[kind], kind
        assert any(n.startswith("base model guessed from shapes") for n in shown["notes"]), shown["notes"]
    rc, out, _ = cli("show", str(by_kind["sd1.5"]["adapter_id"]))
    assert "note: base model guessed from shapes: sd1.x, from 35 of 35 modules" in out


def test_a_file_naming_no_base_is_searched_in_its_familys_space(cli: CLI, tmp_path: Path) -> None:
    """SD 1.5 and SD 2.1 adapters naming no base: two spaces after `zoo embed`, nothing misfits; each file, searched by
    path (no --space), is answered from its own family's space, as the adapter it is."""
    paths = [write_adapter(kind, tmp_path, family=0, member=0, layers=1, name_base=False) for kind in ("sd1.5", "sd2.1")]
    rc, rows, _ = _ingest(cli, "ingest", "--no-embed", *map(str, paths))
    assert rc == 0 and [r["status"] for r in rows] == ["ingested", "ingested"], rows
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0 and {r["space"] for r in reports} == {"sd1.x", "sd2.x"}
    assert all(r["skipped_not_fitting"] == 0 for r in reports), reports
    for path, row, row_space in zip(paths, rows, ("sd1.x", "sd2.x"), strict=True):
        rc, (found,) = cli.json_lines("search", str(path), "-k", "1")
        assert rc == 0 and found["space"] == row_space and found["stored_as"]["adapter_id"] == row["adapter_id"], found
    rc, (report,) = cli.json_lines("check")
    assert rc == 0 and report["misfits"] == [], report


def test_encoders_written_by_peft_are_named_by_their_shapes(cli: CLI, tmp_path: Path) -> None:
    """BERT-base, DistilBERT and GPT-2 (one layer each, at their real widths), LoRA written by PEFT, whose configs name
    no base model; a tiny model no family fits gets a space of its own shapes, another architecture another one."""
    models = {  # the token embeddings, which no LoRA here adapts, shrunk to 64 rows: building them is the slow part
        "bert-base": (BertModel(BertConfig(num_hidden_layers=1, vocab_size=64)), ["query", "value"]),
        "distilbert-base": (DistilBertModel(DistilBertConfig(n_layers=1, vocab_size=64)), ["q_lin", "v_lin", "lin1"]),
        "gpt2": (GPT2Model(GPT2Config(n_layer=1, vocab_size=64)), ["c_attn", "c_fc"]),
    }
    for name, (model, targets) in models.items():
        get_peft_model(model, LoraConfig(r=4, target_modules=targets)).save_pretrained(str(tmp_path / name))
    tiny_qv = write_random_peft_adapters(tmp_path / "qv", 1)[0]
    tiny_o = write_random_peft_adapters(tmp_path / "o", 1, targets=("o_proj", "k_proj"))[0]
    rc, rows, _ = _ingest(cli, "ingest", "--no-embed", *[str(tmp_path / n) for n in models], str(tiny_qv), str(tiny_o))
    assert rc == 0 and all(r["status"] == "ingested" for r in rows), rows
    bases = [cli.json_lines("show", str(r["adapter_id"]))[1][0]["base_model"] for r in rows]
    assert bases[:3] == list(models)
    assert bases[3].startswith("unknown-") and bases[4].startswith("unknown-") and bases[3] != bases[4]
    rc, again, _ = _ingest(cli, "ingest", "--no-embed", str(tiny_qv))  # the same file: the same guess finds it
    assert again[0]["status"] == "duplicate" and again[0]["adapter_id"] == rows[3]["adapter_id"], again


def test_a_token_embedding_or_lm_head_tells_llama_3_from_mistral() -> None:
    """Their projections have the same shapes; their vocabularies (128,256 and 32,000) differ."""
    layer = [(m.name, m.out, m.fan_in) for m in VOCABULARIES["llama3-8b"]() if m.name.startswith("model.layers.0.")]
    assert guess_base_model(layer).families == ("llama-3-8b", "mistral-7b")
    assert guess_base_model([*layer, ("lm_head", 128256, 4096)]).base_model == "llama-3-8b"
    assert guess_base_model([*layer, ("model.embed_tokens", 32000, 4096)]).base_model == "mistral-7b"


def test_diffusers_names_are_guessed_as_kohyas() -> None:
    """The same SD 1.5 modules in diffusers' names (`unet.…`, `text_encoder.…` with or without `text_model.`) and
    in kohya's land in one family; SD 2's text encoder width (1,024) in SD 2's."""
    kohya = [(m.name, m.out, m.fan_in) for m in VOCABULARIES["sd1.5"]() if "attentions_0_transformer_blocks_0_attn2" in m.name]
    assert guess_base_model(kohya).base_model == "sd1.x"
    diffusers = [
        ("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", 640, 768),
        ("text_encoder.text_model.encoder.layers.0.self_attn.q_proj", 768, 768),
        ("text_encoder.encoder.layers.1.mlp.fc1", 3072, 768),
    ]
    assert guess_base_model(diffusers).base_model == "sd1.x"
    assert guess_base_model([("text_encoder.encoder.layers.0.mlp.fc1", 4096, 1024)]).base_model == "sd2.x"


def test_a_named_base_the_shapes_contradict_is_stored_as_named_with_a_warning(cli: CLI, tmp_path: Path) -> None:
    """--base-model naming SDXL for an SD 1.5 adapter: stored under that name, with a warning on stderr and in --json;
    a name of the right family, or one naming no known family, warns of nothing. A file naming the wrong base warns too."""
    sd15 = write_adapter("sd1.5", tmp_path, family=0, member=0, layers=1, name_base=False)
    rc, (row,), err = _ingest(cli, "ingest", "--no-embed", str(sd15), "--base-model", "stabilityai/stable-diffusion-xl-base-1.0")
    assert rc == 0 and row["status"] == "ingested", row
    assert len(row["warnings"]) == 1 and "names the sdxl family, but the module shapes are sd1.x's" in row["warnings"][0]
    assert f"warning: {row['warnings'][0]}" in err
    rc, (shown,) = cli.json_lines("show", str(row["adapter_id"]))
    assert shown["base_model"] == "stabilityai/stable-diffusion-xl-base-1.0"
    for name in ("runwayml/stable-diffusion-v1-5", "my-finetune"):
        rc, (row,), err = _ingest(cli, "ingest", "--no-embed", str(sd15), "--base-model", name)
        assert rc == 0 and row["status"] == "ingested" and row["warnings"] == [] and "warning" not in err, row
    sdxl = write_adapter("sd2.1", tmp_path, family=0, member=0, layers=1)  # names its own base: no warning
    rc, (row,), _ = _ingest(cli, "ingest", "--no-embed", str(sdxl))
    assert row["status"] == "ingested" and row["warnings"] == [], row


def test_check_names_an_adapter_that_does_not_fit_its_space(cli: CLI, tmp_path: Path) -> None:
    """SD 1.5 and SD 2.1 adapters stored under one base model before its space existed (ingest could not refuse the
    second then): `zoo embed` makes the space of the first's shapes; `zoo check` names the other, exit 1."""
    sd15 = write_adapter("sd1.5", tmp_path, family=0, member=0, layers=1, name_base=False)
    sd2 = write_adapter("sd2.1", tmp_path, family=0, member=0, layers=1, name_base=False)
    rc, rows, _ = _ingest(cli, "ingest", "--no-embed", str(sd15), str(sd2), "--base-model", "my-sd")
    assert rc == 0 and [r["status"] for r in rows] == ["ingested", "ingested"], rows
    assert cli("embed")[0] == 0
    rc, (report,) = cli.json_lines("check")
    assert rc == 1 and not report["ok"], report
    (misfit,) = report["misfits"]
    assert (misfit["space"], misfit["adapter_id"], misfit["name"]) == ("my-sd", rows[1]["adapter_id"], "sd2.1-f0-m0")
    assert misfit["shape"][1] != misfit["space_shape"][1], misfit
    rc, out, _ = cli("check")
    assert rc == 1 and f"my-sd: adapter {rows[1]['adapter_id']} sd2.1-f0-m0 does not fit: {misfit['module']}" in out
