"""The shapes-lineage recipe: roots trained by PEFT and children made from them, each child's recorded relation and
parameter true of its saved file, the build deterministic and resumable, and labels.csv ingestible."""

from __future__ import annotations

import copy
import csv
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from tests.conftest import CLI
from zoo.domain.canonical import canonicalize
from zoo.domain.relations import FactorSummary, Update, find_relations
from zoo.errors import UsageError, ZooError
from zoo.formats import LoraModule, read_adapter
from zoo.reference import shapes
from zoo.reference.build import ATTRIBUTES_FILE, LABELS_FILE, make_zoo, plan_zoo
from zoo.reference.lineage import COMBINATIONS, PRECISIONS, TRANSFORMS, Mix, kind_of

RECIPE = "shapes-lineage"
#: seed 4's first 24 members at this mix have every relation, combination and variant, a root of the same task and
#: hyperparameters as another (a sibling), and few training steps
SEED, COUNT = 4, 24
MIX = Mix(root=0.3, transform=0.25, merge=0.3, continuation=0.15)
WEIGHTS = "adapter_model.safetensors"
Row = dict[str, str]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lineage-cache")
    shapes.load_base(path)
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, dict[str, Row]]:
    out = tmp_path_factory.mktemp("zoo") / "lineage"
    report = make_zoo(out, RECIPE, COUNT, seed=SEED, workers=2, cache_dir=cache_dir, progress=False, mix=MIX)
    assert report["built"] == COUNT
    with open(out / LABELS_FILE) as fh:
        return out, {r["name"]: r for r in csv.DictReader(fh)}


def of(rows: dict[str, Row], relation: str) -> list[Row]:
    return [r for r in rows.values() if r["relation"] == relation]


def parents(row: Row) -> list[str]:
    return row["parents"].split(";")


def modules(path: Path) -> dict[str, LoraModule]:
    return {m.name: m for m in read_adapter(path).modules}


def delta(m: LoraModule) -> torch.Tensor:
    return m.scale * (m.B.double() @ m.A.double())


def test_the_plan_has_every_kind_in_its_share_and_does_not_depend_on_the_count() -> None:
    plan = plan_zoo(RECIPE, 0, 60)
    assert plan_zoo(RECIPE, 0, 30) == dict(list(plan.items())[:30])
    kinds = Counter(kind_of(m) for m in plan.values())
    assert kinds["root"] == pytest.approx(18, abs=2) and kinds["transform"] == pytest.approx(18, abs=2)
    assert kinds["merge"] == pytest.approx(12, abs=3) and kinds["continuation"] == pytest.approx(12, abs=2)
    assert {m["relation"] for m in plan.values()} == {"root", *TRANSFORMS, "merge", "continuation"}
    names = list(plan)
    for i, m in enumerate(plan.values()):
        if m["relation"] == "root":
            assert m["parents"] is None
            continue
        ps = m["parents"].split(";")
        assert all(names.index(p) < i and plan[p]["relation"] == "root" for p in ps)
        if m["relation"] == "merge":
            assert 2 <= len(ps) <= 3 and len(m["weights"].split(";")) == len(ps)
            assert len({plan[p]["target_modules"] for p in ps}) == 1
    with pytest.raises(UsageError, match="unknown kind"):
        Mix.parse("roots=0.5")
    assert Mix.parse("merge=0.5, continuation=0") == Mix(merge=0.5, continuation=0.0)
    with pytest.raises(UsageError, match="for lineage recipes"):
        plan_zoo("shapes-cnn", 0, 3, Mix())


@pytest.mark.slow
def test_labels_record_every_member_as_its_file_is(zoo: tuple[Path, dict[str, Row]]) -> None:
    out, rows = zoo
    assert list(rows) == list(plan_zoo(RECIPE, SEED, COUNT, MIX))
    columns = ("relation", "parents", "task", "rank", "alpha", "scale", "precision", "kept_rank", "sparsity")
    assert set(columns) | {"combination", "weights", "density", "variant", "test_accuracy"} <= set(next(iter(rows.values())))
    assert {r["relation"] for r in rows.values()} == {"root", *TRANSFORMS, "merge", "continuation"}
    assert {r["combination"] for r in of(rows, "merge")} == set(COMBINATIONS)
    assert {r["variant"] for r in of(rows, "continuation")} == {"same-task", "other-task", "other-lr"}
    for name, row in rows.items():
        config = json.loads((out / name / "adapter_config.json").read_text())
        assert config["r"] == int(row["rank"]) and config["lora_alpha"] == pytest.approx(float(row["alpha"]))
        assert config["base_model_name_or_path"] == shapes.BASE_MODEL
        assert 0.0 <= float(row["test_accuracy"]) <= 1.0
        assert json.loads((out / name / ATTRIBUTES_FILE).read_text())["relation"] == row["relation"]
    roots = of(rows, "root")  # an unrelated root of the same task and hyperparameters: similar, not related
    same = ("task", "rank", "alpha", "learning_rate", "steps", "n_train", "target_modules")
    assert any(all(a[k] == b[k] for k in same) and a["seed"] != b["seed"] for a in roots for b in roots if a is not b)


@pytest.mark.slow
def test_each_transform_is_true_of_its_file(zoo: tuple[Path, dict[str, Row]]) -> None:
    out, rows = zoo
    for row in (r for r in rows.values() if r["relation"] in TRANSFORMS):
        (parent,) = parents(row)
        child, mother = modules(out / row["name"]), modules(out / parent)
        assert child.keys() == mother.keys()
        for name, m in child.items():
            p = mother[name]
            if row["relation"] == "rescaled":  # the same factors, alpha times the factor
                assert torch.equal(m.A, p.A) and torch.equal(m.B, p.B)
                assert torch.allclose(delta(m), float(row["scale"]) * delta(p), rtol=1e-6, atol=0)
            elif row["relation"] == "cast":  # every entry is the parent's rounded to the precision
                dtype = PRECISIONS[row["precision"]]
                for x, y in ((m.A, p.A), (m.B, p.B)):
                    assert torch.equal(x, x.to(dtype).float()) and torch.equal(x, y.to(dtype).float())
                assert not torch.equal(m.B, p.B)
            elif row["relation"] == "truncated":  # rank k, the top k of the parent's SVD
                k = int(row["kept_rank"])
                assert m.A.shape[0] == m.B.shape[1] == k == int(row["rank"])
                U, S, Vh = torch.linalg.svd(delta(p), full_matrices=False)
                best = (U[:, :k] * S[:k]) @ Vh[:k]
                assert torch.allclose(delta(m), best, atol=1e-5 * float(S[0]))
            else:  # pruned: the smallest share of each factor's entries set to zero (the parent's zeros among them)
                for x, y in ((m.A, p.A), (m.B, p.B)):
                    zeros = x == 0
                    assert int(zeros.sum()) == max(round(float(row["sparsity"]) * x.numel()), int((y == 0).sum()))
                    assert torch.equal(x[~zeros], y[~zeros])
                    assert float(y[zeros].abs().max()) <= float(y[~zeros].abs().min())


@pytest.mark.slow
def test_each_merge_is_what_peft_makes_of_its_parents(zoo: tuple[Path, dict[str, Row]], cache_dir: Path) -> None:
    out, rows = zoo
    base = shapes.load_base(cache_dir)
    for row in of(rows, "merge"):
        ps = parents(row)
        assert len({rows[p]["target_modules"] for p in ps}) == 1
        assert row["task"].split("+") == list(dict.fromkeys(rows[p]["task"] for p in ps))
        model = PeftModel.from_pretrained(copy.deepcopy(base), str(out / ps[0]), adapter_name="p0")
        for i, p in enumerate(ps[1:], start=1):
            model.load_adapter(str(out / p), adapter_name=f"p{i}")
        torch.manual_seed(int(row["seed"]))
        density = float(row["density"]) if row["density"] else None
        weights = [float(w) for w in row["weights"].split(";")]
        svd_rank = int(row["rank"]) if row["combination"] == "svd" else None
        model.add_weighted_adapter([f"p{i}" for i in range(len(ps))], weights, "m", row["combination"], svd_rank=svd_rank, density=density)
        want = {k.replace(".m.", "."): v for k, v in model.state_dict().items() if ".m." in k}
        got = load_file(str(out / row["name"] / WEIGHTS))
        assert got.keys() == want.keys()
        for key, value in got.items():
            if row["combination"] == "svd":  # the build's SVD ran on pinned kernels, this process's may not
                assert torch.allclose(value, want[key], rtol=1e-4, atol=1e-6), (row["name"], key)
            else:
                assert torch.equal(value, want[key]), (row["name"], row["combination"], key)
        assert LoraConfig.from_pretrained(str(out / row["name"])).r == int(row["rank"])


@pytest.mark.slow
def test_each_continuation_trained_its_parent_further(zoo: tuple[Path, dict[str, Row]]) -> None:
    out, rows = zoo
    for row in of(rows, "continuation"):
        (parent,) = parents(row)
        p = rows[parent]
        assert p["relation"] == "root" and row["target_modules"] == p["target_modules"] and row["rank"] == p["rank"]
        assert (row["task"] != p["task"]) == (row["variant"] == "other-task")
        assert (row["learning_rate"] != p["learning_rate"]) == (row["variant"] == "other-lr")
        child, mother = modules(out / row["name"]), modules(out / parent)
        assert child.keys() == mother.keys()
        moved = [float((delta(m) - delta(mother[n])).norm() / delta(mother[n]).norm()) for n, m in child.items()]
        assert min(moved) > 1e-3  # every module moved on from where the parent stopped


@pytest.mark.slow
def test_a_childs_accuracy_is_measured_as_a_roots(zoo: tuple[Path, dict[str, Row]], cache_dir: Path) -> None:
    out, rows = zoo
    data = shapes.load_data()
    for row in (of(rows, "rescaled")[0], of(rows, "root")[0]):
        model = PeftModel.from_pretrained(shapes.load_base(cache_dir), str(out / row["name"]))
        model.eval()
        acc = shapes.held_out_accuracy(model, data, row["task"], int(row["seed"]))
        assert acc == pytest.approx(float(row["test_accuracy"]), abs=2e-3)  # one near-tie may flip (pinned kernels)


@pytest.mark.slow
def test_same_seed_same_bytes_and_resume(zoo: tuple[Path, dict[str, Row]], cache_dir: Path, tmp_path: Path) -> None:
    """A smaller build of the same seed, serial, writes the same bytes; a larger count resumes it."""
    out, rows = zoo
    again = tmp_path / "again"
    assert make_zoo(again, RECIPE, 6, seed=SEED, workers=1, cache_dir=cache_dir, progress=False, mix=MIX)["built"] == 6
    report = make_zoo(again, RECIPE, 8, seed=SEED, workers=1, cache_dir=cache_dir, progress=False, mix=MIX)
    assert (report["built"], report["skipped"]) == (2, 6)
    for name in list(rows)[:8]:
        assert (again / name / WEIGHTS).read_bytes() == (out / name / WEIGHTS).read_bytes(), name
    with pytest.raises(ZooError, match="other settings"):
        make_zoo(again, RECIPE, 8, seed=SEED + 1, workers=1, cache_dir=cache_dir, progress=False, mix=MIX)


@pytest.mark.slow
def test_find_relations_finds_a_rescaled_child_of_its_parent(zoo: tuple[Path, dict[str, Row]]) -> None:
    out, rows = zoo
    names = list(rows)

    def update(name: str, raw: bool = False) -> Update:
        mods = modules(out / name)
        factors = {n: canonicalize(m.A, m.B, m.scale) for n, m in mods.items()}
        return Update(factors, FactorSummary.of(mods, factors) if raw else None, names.index(name))

    for row in of(rows, "rescaled"):
        (parent,) = parents(row)
        candidates = [update(n) for n in names if n != row["name"] and rows[n]["relation"] == "root"]
        found = {e.parent: e for e in find_relations(update(row["name"], raw=True), candidates).transforms}
        edge = found[names.index(parent)]
        assert edge.relation == "rescaled" and edge.scale == pytest.approx(float(row["scale"]), rel=1e-4)


@pytest.mark.slow
def test_labels_csv_ingests(cli: CLI, zoo: tuple[Path, dict[str, Row]]) -> None:
    """Every member is stored but an fp16 cast: within the canonical hash's duplicate tolerance of its parent."""
    out, rows = zoo
    rc, results = cli.json_lines("ingest", "--no-embed", str(out), "--labels", str(out / LABELS_FILE))
    fp16 = {r["name"] for r in of(rows, "cast") if r["precision"] == "fp16"}
    assert rc == 0 and fp16
    assert [r["status"] for r in results] == ["duplicate" if n in fp16 else "ingested" for n in rows]
    merge = of(rows, "merge")[0]
    adapter_id = next(r["adapter_id"] for r in results if Path(r["source"]).name == merge["name"])
    rc, (shown,) = cli.json_lines("show", str(adapter_id))
    labels = shown["labels"]
    assert labels["relation"] == "merge" and labels["parents"] == merge["parents"] and labels["combination"] == merge["combination"]
    assert "scale" not in labels and shown["measurements"]["test_accuracy"] == pytest.approx(float(merge["test_accuracy"]))
