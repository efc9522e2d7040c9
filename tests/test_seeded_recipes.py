"""The seeded recipes (digits-vit-seeded, docs-minilm-seeded): each adapter draws its head, LoRA init, data order and
dropout from its own seed; the pinned recipes they vary write the bytes they wrote before the variants existed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from zoo.formats import read_adapter
from zoo.reference import digits, shapes, training
from zoo.reference.build import ATTRIBUTES_FILE, build_one, plan_zoo, planned_attributes
from zoo.reference.recipes import RECIPES, get_recipe
from zoo.reference.training import AdapterAttributes

REPO = Path(__file__).resolve().parent.parent
#: The last commit before the seeded recipes: the pinned recipes' code as it was, built again to compare bytes with.
PINNED_AT = "0a55bb98f5e643cf12f376494d2480f1cf03644d"
SEEDS = (11, 12)


# ---- the pinned recipes, before and after -----------------------------------------------------------------------

#: Builds two adapters of each pinned recipe with build_one (the steps cut to keep it quick) and prints the sha256 of
#: every file written (an attributes file without its train_seconds); run with the code to test first on sys.path.
BUILD_SCRIPT = """
import hashlib, json, sys
from pathlib import Path
import zoo
from zoo.reference.build import build_one, planned_attributes

out, cache = Path(sys.argv[1]), Path(sys.argv[2])
cases = {"digits-vit": {"steps": 10}, "shapes-cnn": {"steps": 10}, "docs-minilm": {"steps": 2, "task": "files-vs-text"}}
hashes = {"zoo": zoo.__file__}
for recipe, changes in cases.items():
    for index in (0, 1):
        name = f"{recipe}-{index}"
        build_one(recipe, cache, out, name, {**planned_attributes(recipe, 5, index), **changes})
        for path in sorted((out / name).iterdir()):
            blob = path.read_bytes()
            if path.name == "zoo_attributes.json":
                row = json.loads(blob)
                row.pop("train_seconds")
                blob = json.dumps(row, sort_keys=True).encode()
            hashes[f"{name}/{path.name}"] = hashlib.sha256(blob).hexdigest()
print(json.dumps(hashes))
"""


def _has_commit(commit: str) -> bool:
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return found.returncode == 0


def _build_hashes(code_roots: list[Path], out: Path, cache: Path) -> list[dict[str, str]]:
    """BUILD_SCRIPT's hashes for each code root, run side by side in fresh interpreters, each importing `zoo` from
    its root. PEFT keeps target_modules as a set, so adapter_config.json lists them in string-hash order: the hash
    seed is fixed (the same for all)."""
    runs = []
    for i, root in enumerate(code_roots):
        (out / str(i)).mkdir()
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"}
        command = [sys.executable, "-c", BUILD_SCRIPT, str(out / str(i)), str(cache)]
        runs.append(subprocess.Popen(command, env=env, cwd=out / str(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    found = []
    for root, run in zip(code_roots, runs, strict=True):
        stdout, stderr = run.communicate()
        assert run.returncode == 0, stderr
        hashes = dict(json.loads(stdout.splitlines()[-1]))
        assert Path(hashes.pop("zoo")).is_relative_to(root)
        found.append(hashes)
    return found


def _random_bases(cache: Path) -> None:
    """Seeded, untrained bases in the cache: which base does not matter to the comparison, and pretraining is slow."""
    torch.manual_seed(0)
    save_file(digits.DigitsViT().state_dict(), str(digits.base_path(cache)))
    save_file(shapes.ShapesCNN().state_dict(), str(shapes.base_path(cache)))


@pytest.mark.slow
@pytest.mark.skipif(not _has_commit(PINNED_AT), reason="needs the repository's history (git)")
def test_pinned_recipes_write_the_bytes_they_wrote_before(tmp_path: Path) -> None:
    """digits-vit, shapes-cnn (both train by the shared loop the variants extend) and docs-minilm, built by this code
    and by the code at PINNED_AT, in the same environment: the same files, byte for byte."""
    before_code = tmp_path / "before"
    before_code.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PINNED_AT, "zoo"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(before_code)], input=archive.stdout, check=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    _random_bases(cache)
    (tmp_path / "out").mkdir()
    now, then = _build_hashes([REPO, before_code], tmp_path / "out", cache)
    assert len(now) >= 6 * 3 and any(k.endswith("adapter_model.safetensors") for k in now)
    assert now == then


# ---- what a seeded run draws from its seed ----------------------------------------------------------------------


@dataclass
class Seen:
    """One run as observed from inside: the new head and first LoRA A as initialised, the training inputs in the
    order drawn, the first LoRA dropout module's masks."""

    head: torch.Tensor
    lora_a: torch.Tensor
    batches: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)


def _watch(monkeypatch: pytest.MonkeyPatch, head: str, dropout: bool = True) -> list[Seen]:
    """Every run's Seen, appended as train_lora wires each adapter (PEFT's get_peft_model, wrapped). `dropout`: False
    for a run without LoRA dropout (PEFT has an identity in its place; no masks are recorded)."""
    seen: list[Seen] = []
    real = training.get_peft_model

    def spy(model: torch.nn.Module, config: Any, *args: Any, **kwargs: Any) -> PeftModel:
        peft = real(model, config, *args, **kwargs)
        modules = dict(peft.named_modules())
        saved = modules[f"base_model.model.{head}.modules_to_save.default"]
        first_a = next(m for n, m in modules.items() if n.endswith("lora_A.default"))
        run = Seen(saved.weight.detach().clone(), first_a.weight.detach().clone())

        def record_batch(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if module.training:
                run.batches.append((args[0] if args else kwargs["input_ids"]).clone())

        def record_mask(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if module.training:
                run.masks.append(output == 0)

        peft.register_forward_pre_hook(record_batch, with_kwargs=True)
        first_dropout = next(m for n, m in modules.items() if n.endswith("lora_dropout.default"))
        assert isinstance(first_dropout, torch.nn.Dropout) == dropout
        first_dropout.register_forward_hook(record_mask)
        seen.append(run)
        return peft

    monkeypatch.setattr(training, "get_peft_model", spy)
    return seen


def _assert_drawn_per_seed(a: Seen, b: Seen) -> None:
    """Two runs alike but for the seed: every draw differs."""
    assert a.head.shape == b.head.shape and not torch.equal(a.head, b.head)
    assert not torch.equal(a.lora_a, b.lora_a)
    assert a.batches and len(a.batches) == len(b.batches) and not torch.equal(a.batches[0], b.batches[0])
    assert a.masks and 0 < int(a.masks[0].sum()) < a.masks[0].numel()  # dropout is on: some inputs dropped, not all
    assert not torch.equal(a.masks[0], b.masks[0])


def _attrs(recipe: str, seed: int, **changes: object) -> AdapterAttributes:
    """Adapter 0 of plan seed 0, with another seed (and changes): the same task and hyperparameters for each seed."""
    return {**planned_attributes(recipe, 0, 0), "seed": seed, **changes}  # type: ignore[typeddict-item]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != ATTRIBUTES_FILE}


def test_seeded_recipes_plan_as_the_pinned_ones() -> None:
    """Registered, on the pinned recipe's base, and drawing the same plan: a seeded zoo and a pinned zoo of one seed
    hold the same tasks and hyperparameters adapter for adapter (a paired comparison)."""
    for seeded, pinned in (("digits-vit-seeded", "digits-vit"), ("docs-minilm-seeded", "docs-minilm")):
        assert seeded in RECIPES
        assert get_recipe(seeded).base_model == get_recipe(pinned).base_model
        assert list(plan_zoo(seeded, 3, 5).values()) == list(plan_zoo(pinned, 3, 5).values())


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded, untrained digits base: what is drawn per adapter does not depend on pretraining (slow)."""
    path = tmp_path_factory.mktemp("seeded-digits-cache")
    torch.manual_seed(0)
    save_file(digits.DigitsViT().state_dict(), str(digits.base_path(path)))
    return path


@pytest.mark.slow
def test_digits_seeded_draws_everything_from_the_adapter_seed(digits_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two adapters alike but for the seed: different new heads, LoRA inits, batch orders and dropout masks; the same
    seed again: the same bytes."""
    seen = _watch(monkeypatch, "head")
    for name, seed in (("a", SEEDS[0]), ("b", SEEDS[1]), ("a-again", SEEDS[0])):
        build_one("digits-vit-seeded", digits_cache, tmp_path, name, _attrs("digits-vit-seeded", seed, steps=10))
    first, second, again = seen
    _assert_drawn_per_seed(first, second)
    assert torch.equal(first.head, again.head) and torch.equal(first.batches[-1], again.batches[-1])
    assert _files(tmp_path / "a") == _files(tmp_path / "a-again")
    assert load_file(tmp_path / "a" / "adapter_model.safetensors")["base_model.model.head.weight"].shape == (digits.CLASSES, digits.DIM)


@pytest.mark.slow
def test_digits_seeded_differs_from_pinned_only_by_its_head_and_dropout(digits_cache: Path, tmp_path: Path) -> None:
    """The same attributes built by both recipes: the same LoRA modules on the same base, the head besides them, and
    a config that differs in lora_dropout and modules_to_save only; the adapter loads on the pinned base as trained."""
    attrs = _attrs("digits-vit", SEEDS[0], steps=10)
    pinned = build_one("digits-vit", digits_cache, tmp_path, "pinned", attrs)
    seeded = build_one("digits-vit-seeded", digits_cache, tmp_path, "seeded", attrs)
    before, after = dict(pinned), dict(seeded)
    differs = {k for k in before if before[k] != after[k]}
    assert differs <= {"name", "recipe", "test_accuracy", "train_seconds"} and "recipe" in differs
    configs = [json.loads((tmp_path / n / "adapter_config.json").read_text()) for n in ("pinned", "seeded")]
    assert {k for k in configs[0] if configs[0][k] != configs[1][k]} == {"lora_dropout", "modules_to_save"}
    assert (configs[1]["lora_dropout"], configs[1]["modules_to_save"]) == (0.1, ["head"])
    read = [read_adapter(tmp_path / n) for n in ("pinned", "seeded")]
    assert [m.name for m in read[0].modules] == [m.name for m in read[1].modules]
    assert read[0].base_model == read[1].base_model == digits.BASE_MODEL
    assert not read[0].extra_tensors and set(read[1].extra_tensors) == {"head.weight", "head.bias"}
    base = digits.load_base(digits_cache)
    model, _ = digits.train_adapter(base, digits.load_data(), attrs, seeded=digits.SEEDED)
    loaded = PeftModel.from_pretrained(digits.load_base(digits_cache), str(tmp_path / "seeded"))
    loaded.eval()
    images = digits.load_data().test_x[:16]
    with torch.no_grad():
        assert torch.allclose(loaded(images), model(images), atol=1e-6)
        assert not torch.allclose(base(images), model(images), atol=1e-3)  # the pretrained head is not the adapter's


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def docs_ctx() -> Any:
    from zoo.reference import text

    return text.prepare(Path("."))


def _docs_attrs(seed: int, steps: int) -> AdapterAttributes:
    """A docs task with few held-out texts and a small training pool: quick to train and score."""
    return _attrs("docs-minilm", seed, steps=steps, task="files-vs-text", n_train=32)


@pytest.mark.slow
def test_docs_seeded_draws_everything_from_the_adapter_seed(docs_ctx: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two adapters alike but for the seed: different heads, LoRA inits, batch orders and dropout masks; the same
    seed again: the same bytes, and a config that differs from the pinned recipe's in lora_dropout only."""
    from zoo.reference import text

    seen = _watch(monkeypatch, "classifier")
    for name, seed in (("a", SEEDS[0]), ("b", SEEDS[1]), ("a-again", SEEDS[0])):
        model, _ = text.train_adapter(docs_ctx, _docs_attrs(seed, steps=2), seeded=text.SEEDED)
        model.save_pretrained(str(tmp_path / name), save_embedding_layers=False)
    first, second, again = seen
    _assert_drawn_per_seed(first, second)
    assert torch.equal(first.head, again.head)
    assert _sha256(tmp_path / "a" / "adapter_model.safetensors") == _sha256(tmp_path / "a-again" / "adapter_model.safetensors")
    std = float(docs_ctx.base.config.initializer_range)
    assert abs(float(first.head.std()) - std) < 0.2 * std  # drawn as transformers draws a new head
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.1 and "classifier" in config["modules_to_save"]


@pytest.mark.slow
def test_docs_pinned_heads_all_start_from_seed_zero(docs_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the seeded variant changes: docs-minilm's adapters of two seeds start from one head (the base's, seed 0's),
    though their LoRA inits differ; no LoRA dropout."""
    from zoo.reference import text

    seen = _watch(monkeypatch, "classifier", dropout=False)
    for seed in SEEDS:
        text.train_adapter(docs_ctx, _docs_attrs(seed, steps=0))
    first, second = seen
    assert torch.equal(first.head, second.head) and torch.equal(first.head, docs_ctx.base.classifier.weight)
    assert not torch.equal(first.lora_a, second.lora_a)
