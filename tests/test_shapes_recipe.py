"""The shapes-cnn reference zoo: drawn images, a pretrained CNN, real PEFT conv-LoRA adapters; their dW
read back consistently with PEFT's own conv layers, ingested, and found again by search."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn

from tests.conftest import CLI
from zoo.domain.canonical import canonicalize
from zoo.formats import read_adapter
from zoo.reference import shapes
from zoo.reference.build import ATTRIBUTES_FILE, LABELS_FILE, make_zoo, planned_attributes
from zoo.reference.training import lora_config

#: the first three adapters of seed 30 are quick (10–50 steps) and cover three target sets: "second",
#: "all" (the stem, strided 3×3 convs and 1×1 shortcuts; rank 16 > the stem's 1·3·3 inputs) and "early"
SEED = 30


@pytest.fixture(scope="module")
def data() -> shapes.ShapesData:
    return shapes.load_data()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, data: shapes.ShapesData) -> Path:
    """One pretrained base for the module (the recipe's own code path)."""
    path = tmp_path_factory.mktemp("shapes-cache")
    shapes.load_base(path, data)
    return path


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("zoo") / "shapes"
    report = make_zoo(out, "shapes-cnn", 3, seed=SEED, workers=1, cache_dir=cache_dir, progress=False)
    return out, report


def test_images_are_reproducible_balanced_and_distinct(data: shapes.ShapesData) -> None:
    x, y, size = shapes.render(shapes.N_TRAIN, shapes.TRAIN_SEED)
    assert torch.equal(x, data.train_x) and torch.equal(y, data.train_y) and torch.equal(size, data.train_size)
    assert data.train_x.shape == (shapes.N_TRAIN, 1, 16, 16) and data.test_x.shape == (shapes.N_TEST, 1, 16, 16)
    assert float(data.train_x.min()) >= 0.0 and float(data.train_x.max()) <= 1.0
    counts = torch.bincount(data.train_y, minlength=len(shapes.CLASSES))
    assert int(counts.min()) > 0.8 * shapes.N_TRAIN / len(shapes.CLASSES)
    assert 0.4 < float((data.train_size >= shapes.LARGE).float().mean()) < 0.6
    assert not torch.equal(data.train_x[: shapes.N_TEST], data.test_x)  # the test set is drawn from its own seed
    # every class draws a different mask for the same placement (no two classes are the same picture)
    grid = torch.arange(16.0).numpy()
    masks = shapes.shape_masks(grid[None, None, :] - 7.5, grid[None, :, None] - 7.5, torch.tensor([[[5.0]]]).numpy())
    flat = masks.reshape(len(shapes.CLASSES), -1)
    assert all(flat[i].any() for i in range(len(flat)))
    assert len({row.tobytes() for row in flat}) == len(shapes.CLASSES)


def test_tasks(data: shapes.ShapesData) -> None:
    assert len(shapes.TASKS) >= 12 and len(set(shapes.TASKS)) == len(shapes.TASKS)
    for task in shapes.TASKS:
        x, y = shapes.task_split(task, data.test_x, data.test_y, data.test_size, train=False, seed=0)
        assert len(x) == len(y) > 100 and x.shape[1:] == (1, 16, 16)
        assert set(y.tolist()) <= set(shapes.task_classes(task))
    _, y = shapes.task_split("pair-stripes", data.train_x, data.train_y, data.train_size, train=True, seed=0)
    assert set(y.tolist()) == {7, 8}
    x, _ = shapes.task_split("rot90", data.train_x, data.train_y, data.train_size, train=True, seed=0)
    assert torch.equal(x, torch.rot90(data.train_x, 1, dims=(2, 3)))
    _, y = shapes.task_split("size", data.train_x, data.train_y, data.train_size, train=True, seed=0)
    assert torch.equal(y, (data.train_size >= shapes.LARGE).long())
    _, noisy = shapes.task_split("label-noise", data.train_x, data.train_y, data.train_size, train=True, seed=0)
    assert 0.15 < float((noisy != data.train_y).float().mean()) < 0.35
    _, clean = shapes.task_split("label-noise", data.test_x, data.test_y, data.test_size, train=False, seed=0)
    assert torch.equal(clean, data.test_y)
    with pytest.raises(ValueError, match="unknown shapes task"):
        shapes.task_split("rot45", data.test_x, data.test_y, data.test_size, train=False, seed=0)


@pytest.mark.slow
def test_base_is_pretrained_and_cached(cache_dir: Path, data: shapes.ShapesData) -> None:
    base = shapes.load_base(cache_dir)
    assert shapes.accuracy(base, "label-noise", data.test_x, data.test_y) > 0.95  # 10-way shape accuracy, held out
    assert shapes.base_path(cache_dir).exists()
    # transformed images are what the adapters are for: the base does badly on some of them
    x, y = shapes.task_split("invert", data.test_x, data.test_y, data.test_size, train=False, seed=0)
    assert shapes.accuracy(base, "invert", x, y) < 0.7


def test_target_sets_are_subsets_of_the_conv_layers() -> None:
    base = shapes.ShapesCNN()  # load_base's architecture; its layers' names do not depend on the pretrained weights
    convs = {n for n, m in base.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(convs) == 7
    chosen = {}
    for key in shapes.TARGET_SETS:
        model = get_peft_model(copy.deepcopy(base), lora_config(2, 4.0, shapes.TARGET_SETS[key]))
        chosen[key] = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
        assert chosen[key] and chosen[key] <= convs
    assert chosen["all"] == convs and all(chosen[k] < convs for k in chosen if k != "all")
    assert chosen["early"] == {"stem", "stages.0.conv1", "stages.0.conv2"}
    assert chosen["strided"] == {"stages.0.conv1", "stages.0.shortcut", "stages.1.conv1", "stages.1.shortcut"}


@pytest.mark.slow
def test_conv_lora_dw_matches_peft_and_the_merged_model(tiny_zoo: tuple[Path, dict], cache_dir: Path, data: shapes.ShapesData) -> None:
    """Every conv module's dW as read (flattened out × in·kh·kw) is PEFT's delta weight, and adding it to the
    base kernels gives the adapted model's outputs: 3×3 with and without stride, 1×1 shortcuts, the stem."""
    out, _ = tiny_zoo
    seen_kernels = set()
    for i in range(3):
        path = out / f"shapes-cnn-{i:05d}"
        peft_model = PeftModel.from_pretrained(shapes.load_base(cache_dir), str(path))
        peft_model.eval()
        layers = {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
        adapter = read_adapter(path)
        assert sorted(m.name for m in adapter.modules) == sorted(layers)
        merged = shapes.load_base(cache_dir)
        for m in adapter.modules:
            weight = layers[m.name].base_layer.weight
            assert m.kind == "conv" and m.shape == (weight.shape[0], weight[0].numel()) and not m.transposed
            delta = canonicalize(m.A, m.B, m.scale).delta()
            expected = layers[m.name].get_delta_weight("default").detach()
            assert torch.allclose(delta.reshape(weight.shape).to(expected.dtype), expected, atol=1e-6), m.name
            conv = merged.get_submodule(m.name)
            with torch.no_grad():
                conv.weight += delta.reshape(conv.weight.shape).to(conv.weight.dtype)
            seen_kernels.add((tuple(weight.shape[2:]), conv.stride))
        with torch.no_grad():
            got, want = merged(data.test_x[:64]), peft_model(data.test_x[:64])
        assert torch.allclose(got, want, atol=1e-4 * max(1.0, float(want.abs().max())))
    assert {((3, 3), (1, 1)), ((3, 3), (2, 2)), ((1, 1), (2, 2))} <= seen_kernels


@pytest.mark.slow
def test_adapters_score_their_label(tiny_zoo: tuple[Path, dict], cache_dir: Path, data: shapes.ShapesData) -> None:
    out, report = tiny_zoo
    assert report["count"] == 3 and report["built"] == 3 and report["base_model"] == shapes.BASE_MODEL
    with open(out / LABELS_FILE) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["name"] for r in rows] == [f"shapes-cnn-{i:05d}" for i in range(3)]
    for i, row in enumerate(rows):
        planned = planned_attributes("shapes-cnn", SEED, i)
        attrs = json.loads((out / row["name"] / ATTRIBUTES_FILE).read_text())
        for key, value in planned.items():
            assert row[key] == str(value) == str(attrs[key])
        cfg = json.loads((out / row["name"] / "adapter_config.json").read_text())
        assert cfg["r"] == attrs["rank"] and cfg["lora_alpha"] == attrs["alpha"] and cfg["base_model_name_or_path"] == shapes.BASE_MODEL
        targets = shapes.TARGET_SETS[attrs["target_modules"]]
        assert (cfg["target_modules"] == targets) if isinstance(targets, str) else (sorted(cfg["target_modules"]) == sorted(targets))
        loaded = PeftModel.from_pretrained(shapes.load_base(cache_dir), str(out / row["name"]))
        loaded.eval()
        x, _ = shapes.task_split(attrs["task"], data.test_x, data.test_y, data.test_size, train=False, seed=attrs["seed"] + 1)
        # the file reproduces the worker's accuracy (its CPU kernels are pinned, this process's may not be)
        acc = shapes.held_out_accuracy(loaded, data, attrs["task"], attrs["seed"])
        assert acc == pytest.approx(float(row["test_accuracy"]), abs=1.5 / len(x))


@pytest.mark.slow
def test_accuracy_varies_with_attributes(cache_dir: Path, data: shapes.ShapesData) -> None:
    """Weak and strong settings of the same task give clearly different held-out accuracy."""
    base = shapes.load_base(cache_dir)
    common = {"task": "invert", "rank": 4, "alpha": 8.0, "n_train": 256, "target_modules": "all", "seed": 1}
    _, weak = shapes.train_adapter(base, data, {**common, "learning_rate": 1e-4, "steps": 10})
    _, strong = shapes.train_adapter(base, data, {**common, "learning_rate": 1e-2, "steps": 100})
    assert strong > weak + 0.3


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # conv modules through ingest, embed and search, whatever the database
def test_ingest_and_search_find_the_same_task(cli: CLI, cache_dir: Path, data: shapes.ShapesData, tmp_path: Path) -> None:
    """Conv-LoRA adapters ingest with conv modules, embed, and whole-update dW search finds the same task first."""
    base = shapes.load_base(cache_dir)
    rows = ["name,task,test_accuracy"]
    tasks = ("invert", "rot90", "size")
    for t, task in enumerate(tasks):
        for j in range(3):
            attrs = {"task": task, "rank": 2 + 2 * (j % 2), "alpha": 8.0, "learning_rate": 5e-3, "steps": 40, "n_train": 128,
                     "target_modules": "all", "seed": 100 * t + j}  # fmt: skip
            model, acc = shapes.train_adapter(base, data, attrs)
            model.save_pretrained(str(tmp_path / "zoo" / f"{task}-{j}"), save_embedding_layers=False)
            rows.append(f"{task}-{j},{task},{acc}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    rc, results = cli.json_lines("ingest", "--no-embed", str(tmp_path / "zoo"), "--labels", str(tmp_path / "labels.csv"))
    assert rc == 0 and [r["status"] for r in results] == ["ingested"] * 9
    rc, (shown,) = cli.json_lines("show", str(results[0]["adapter_id"]))
    assert shown["base_model"] == shapes.BASE_MODEL and len(shown["modules"]) == 7
    by_name = {m["name"]: m for m in shown["modules"]}
    assert {m["kind"] for m in shown["modules"]} == {"conv"}
    assert by_name["stem"]["shape"] == [16, 9] and by_name["stages.1.conv2"]["shape"] == [64, 576]
    assert by_name["stages.0.shortcut"]["shape"] == [32, 16]
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0 and reports[0]["embedded"] == 9
    task_of = {r["adapter_id"]: re.sub(r"-\d$", "", Path(r["source"]).name) for r in results}
    for method in ("dw", "module"):
        for adapter_id, task in task_of.items():
            rc, (found,) = cli.json_lines("search", str(adapter_id), "-k", "2", "--method", method)
            assert rc == 0 and [task_of[r["adapter_id"]] for r in found["results"]] == [task, task], (method, task)
