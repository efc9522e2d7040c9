"""Relations found from the weights, stored and served: real PEFT adapters (a parent, its copy with alpha
changed, its bf16 cast, its magnitude-pruned copy, a merge made by PEFT's add_weighted_adapter, unrelated ones)
ingested through `zoo ingest`, scanned by `zoo embed`'s relation step, shown by `zoo lineage`, the API and the adapter
page, filtered in the catalog."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from sqlalchemy import delete, func, select, update

from embed.serving.adapter_resource import delete_adapter
from embed.serving.engine import QueryEngine
from embed.serving.results import Query
from embed.serving.search_methods import SKETCH, W2T
from tests.conftest import CLI
from tests.factories import TinyLM
from webapp import create_app
from zoo.config import Settings
from zoo.domain.module_sample import module_bytes
from zoo.domain.relations import DETECTOR
from zoo.services import relation_rows, relations
from zoo.services.factor_cache import FactorCache, detector_bytes
from zoo.store.blobs import BlobStore
from zoo.store.embedders import serving_embedders
from zoo.store.embeddings import load_embeddings
from zoo.store.models import Adapter, AdapterRelation, RelationScan
from zoo.store.relations import EdgeRow, write_scan
from zoo.store.session import session_factory
from zoo.store.spaces import get_space

WEIGHTS = "adapter_model.safetensors"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters of TinyLM written by save_pretrained: p (a parent), its copy with lora_alpha doubled (`rescaled`),
    its bf16 cast (`cast`), its copy with the PRUNED share of each tensor zeroed (`pruned`), p resumed on another
    task (`continued`: A drifted a little, B learnt anew), q1 and q2 and their `merge` by add_weighted_adapter (cat,
    weights 0.7 and 0.5), and u1, u2 (unrelated); `ties`: q1 and u1 merged by TIES at density 0.5 (weights 0.6, 0.9),
    which prunes A and B apart; `pmerge`: p and q2 merged by cat (0.8, 0.4); `svdmerge`: q2 and u2 by svd (0.6, 0.8);
    `linmerge`: q1 and u2 by linear (0.5, 0.7).
    Factors are random (A of Kaiming scale, B smaller): real PEFT files without training."""
    root = tmp_path_factory.mktemp("relations")
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = get_peft_model(TinyLM(seed=0), LoraConfig(**config), adapter_name="p")
    names = ["q1", "q2", "u1", "u2"]
    for name in names:
        model.add_adapter(name, LoraConfig(**config))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.25 if "lora_A" in name else 0.1))
    model.add_weighted_adapter(["q1", "q2"], [0.7, 0.5], "merge", combination_type="cat")
    model.add_weighted_adapter(["q1", "u1"], [0.6, 0.9], "ties", combination_type="ties", density=0.5)
    model.add_weighted_adapter(["p", "q2"], [0.8, 0.4], "pmerge", combination_type="cat")
    model.add_weighted_adapter(["q2", "u2"], [0.6, 0.8], "svdmerge", combination_type="svd")
    model.add_weighted_adapter(["q1", "u2"], [0.5, 0.7], "linmerge", combination_type="linear")
    out = {}
    for name in ["p", *names, "merge", "ties", "pmerge", "svdmerge", "linmerge"]:
        model.save_pretrained(str(root / "saved"), selected_adapters=[name])  # under saved/<name> (not the default adapter)
        out[name] = shutil.copytree(root / "saved" / name, root / name)
    out["rescaled"] = _copy(out["p"], root / "rescaled", alpha=16)
    out["cast"] = _copy(out["p"], root / "cast", dtype=torch.bfloat16)
    out["pruned"] = _copy(out["p"], root / "pruned", prune=PRUNED)
    out["continued"] = _resumed(out["p"], root / "continued", gen)
    return out


def _resumed(src: Path, dest: Path, gen: torch.Generator) -> Path:
    """A copy of a PEFT directory as if resumed on another task: A drifted 5 %, B grown mostly in new directions (twice
    its size), so that dW's cosine with the parent's is well under the 0.5 a same-task continuation keeps."""
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / WEIGHTS))
    for k, v in tensors.items():
        noise = torch.randn(v.shape, generator=gen) * v.std()
        grown = v + (0.05 if "lora_A" in k else 2.0) * noise
        tensors[k] = grown.contiguous()
    save_file(tensors, str(dest / WEIGHTS))
    return dest


#: the share of each tensor's entries the pruned copy sets to zero (the smallest in magnitude)
PRUNED = 0.2


def _copy(src: Path, dest: Path, alpha: int | None = None, dtype: torch.dtype | None = None, prune: float = 0.0) -> Path:
    """A copy of a PEFT directory with lora_alpha changed, its tensors cast to `dtype` and back, or the `prune` share
    of each tensor's entries of least magnitude set to zero."""
    shutil.copytree(src, dest)
    if alpha is not None:
        config = json.loads((dest / "adapter_config.json").read_text())
        (dest / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
    tensors = load_file(str(dest / WEIGHTS))
    if dtype is not None:
        tensors = {k: v.to(dtype).float() for k, v in tensors.items()}
    if prune:
        tensors = {k: torch.where(v.abs() < v.abs().flatten().quantile(prune), 0.0, v) for k, v in tensors.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / WEIGHTS))
    return dest


#: given tasks: the parent and the merge's parents (and u1) are labelled; their copies, the merge and u2 are not
TASKS = {"p": "alpha", "q1": "beta", "q2": "gamma", "u1": "beta"}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A labels CSV of TASKS; p also has a style, and a `rank` label (the name of a fact its copies' files state)."""
    path = tmp_path_factory.mktemp("tasks") / "labels.csv"
    extra = {"p": ",dotted,4"}
    path.write_text("name,task,style,rank\n" + "".join(f"{name},{task}{extra.get(name, ',,')}\n" for name, task in TASKS.items()))
    return path


def ingest(cli: CLI, sources: dict[str, Path], *names: str, labels: Path | None = None) -> dict[str, int]:
    given = ("--labels", str(labels)) if labels else ()
    rc, lines = cli.json_lines("ingest", "--no-embed", *(str(sources[n]) for n in names), "--base-model", "tiny", *given)
    assert rc == 0, lines
    return {n: line["adapter_id"] for n, line in zip(names, lines, strict=True)}


def embed(cli: CLI) -> dict:
    rc, out, err = cli("embed", "--json")
    assert rc == 0, err
    return json.loads(out)[0]["relations"]


def edges(settings: Settings) -> dict[tuple[int, int, str], AdapterRelation]:
    with session_factory(settings.database_url)() as session:
        return {(r.child_id, r.parent_id, r.relation): r for r in session.scalars(select(AdapterRelation))}


def test_relations_are_found_stored_and_served(cli: CLI, settings: Settings, sources: dict[str, Path], tasks: Path) -> None:
    ids = ingest(cli, sources, "p", "q1", "q2", "u1", "u2", "rescaled", "cast", "pruned", "merge", "continued", labels=tasks)
    report = embed(cli)
    assert report["scanned"] == 10 and report["failed"] == 0, report
    found = edges(settings)
    p, rescaled, cast, merge = ids["p"], ids["rescaled"], ids["cast"], ids["merge"]
    edge = found[(rescaled, p, "rescaled")]
    assert edge.parameters["scale"] == pytest.approx(2.0, rel=1e-4) and edge.confidence > 0.9
    assert edge.evidence["relative_residual"] < 1e-4 and edge.detector
    edge = found[(cast, p, "cast")]
    assert edge.parameters["precision"] == "bf16"
    edge = found[(ids["pruned"], p, "pruned")]  # from the zeros ingest summarized (the raw A and B are gone)
    assert edge.parameters["sparsity"] == pytest.approx(PRUNED, abs=0.01) and edge.parameters["scale"] == pytest.approx(1.0, abs=0.05)
    parents = {k[1]: e for k, e in found.items() if k[0] == merge and k[2] == "merge"}
    assert set(parents) == {ids["q1"], ids["q2"]}
    assert parents[ids["q1"]].parameters["weight"] == pytest.approx(0.7, abs=0.05)
    assert parents[ids["q2"]].parameters["weight"] == pytest.approx(0.5, abs=0.05)
    assert {e.parameters["combination"] for e in parents.values()} == {"cat"}
    edge = found[(ids["continued"], p, "continuation")]  # its dW points elsewhere; its rows are p's
    assert edge.evidence["shared_rows"] > 0.9 and edge.evidence["module_cosine"] < 0.5
    assert [k for k in found if k[0] == ids["continued"]] == [(ids["continued"], p, "continuation")]  # one origin
    unrelated = {ids["u1"], ids["u2"]}
    assert not [k for k in found if {k[0], k[1]} & unrelated]
    copies = {p, rescaled, cast, ids["pruned"]}
    assert not [k for k in found if {k[0], k[1]} & copies and {k[0], k[1]} & {ids["q1"], ids["q2"], merge}]

    # served: zoo lineage (text and --json), the API, the adapter page, the catalog's filters
    rc, out, _ = cli("lineage", str(merge))
    assert rc == 0 and "from the weights:" in out and f"derives from #{ids['q1']}" in out and "merge (weight 0.7" in out
    rc, out, _ = cli("lineage", str(p), "--json")
    weights = json.loads(out)["from_weights"]
    children = {(rescaled, "rescaled"), (cast, "cast"), (ids["pruned"], "pruned")}
    assert {(e["adapter"]["id"], e["relation"]) for e in weights["children"]} >= children
    rc, lines = cli.json_lines("list", "--filter", "relation=merge")
    assert [r["id"] for r in lines[0]["results"]] == [merge]
    rc, lines = cli.json_lines("list", "--filter", f"derived_from={p}")
    assert {r["id"] for r in lines[0]["results"]} == {rescaled, cast, ids["pruned"], ids["continued"]}
    client = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir), "TESTING": True}).test_client()
    weights = client.get(f"/api/v1/adapters/{merge}/lineage").get_json()["from_weights"]
    assert {(e["adapter"]["id"], e["relation"]) for e in weights["parents"]} == {(ids["q1"], "merge"), (ids["q2"], "merge")}
    assert weights["scan"]["error"] is None and weights["disagreement"] is None
    assert client.get(f"/api/v1/adapters/{ids['q1']}/lineage").get_json()["from_weights"]["children"][0]["adapter"]["id"] == merge
    with session_factory(settings.database_url)() as session, session.begin():  # as a Hub card states it
        session.execute(update(Adapter).where(Adapter.id == merge).values(source_metadata={"base_model_relation": "adapter"}))
    weights = client.get(f"/api/v1/adapters/{merge}/lineage").get_json()["from_weights"]
    assert weights["card_relation"] == "adapter" and "the weights say 'merge'" in weights["disagreement"]
    page = client.get(f"/adapters/{merge}").get_data(as_text=True)
    assert "disagrees with the card" in page
    assert "From the weights" in page and f'href="/adapters/{ids["q1"]}"' in page
    found_merges = client.get("/api/v1/adapters", query_string={"filter": ["relation=merge", "base_model=tiny"]}).get_json()
    assert [r["id"] for r in found_merges["results"]] == [merge] and found_merges["total"] == 1
    derived = client.get("/api/v1/adapters", query_string={"filter": f"derived_from={p}"}).get_json()
    assert {r["id"] for r in derived["results"]} == {rescaled, cast, ids["pruned"], ids["continued"]}
    assert client.get("/api/v1/adapters", query_string={"filter": "relation=cousin"}).status_code == 400

    # graph imputation: the unlabelled inherit their relatives' given tasks (no embedder trained), with links to them
    inherited = client.get(f"/api/v1/adapters/{cast}").get_json()["from_lineage"]
    assert set(inherited["attributes"]) == {"task", "style"}  # never `rank`: its own file says it
    task = inherited["attributes"]["task"]
    assert task["kind"] == "copy" and [(v["value"], v["score"]) for v in task["values"]] == [("alpha", pytest.approx(1.0, abs=0.05))]
    assert [(s["adapter"]["id"], s["relation"], s["direction"]) for s in task["values"][0]["sources"]] == [(p, "cast", "parent")]
    task = client.get(f"/api/v1/adapters/{merge}").get_json()["from_lineage"]["attributes"]["task"]
    assert task["kind"] == "merge" and task["complete"] and [v["value"] for v in task["values"]] == ["beta", "gamma"]  # weights 0.7, 0.5
    assert [v["score"] for v in task["values"]] == pytest.approx([0.7 / 1.2, 0.5 / 1.2], abs=0.05)
    assert client.get(f"/api/v1/adapters/{p}").get_json()["from_lineage"]["attributes"] == {}  # it has a given task
    alone = client.get(f"/api/v1/adapters/{ids['u2']}").get_json()["from_lineage"]
    assert alone["edges"] == 0 and alone["attributes"] == {}
    page = client.get(f"/adapters/{merge}").get_data(as_text=True)
    part = page.split("From lineage")[1].split('class="lineage"')[0]
    assert "all of" in part and f'href="/adapters/{ids["q1"]}"' in part and f'href="/adapters/{ids["q2"]}"' in part
    assert "From lineage" not in client.get(f"/adapters/{ids['u2']}").get_data(as_text=True)

    # idempotent: embedding again scans nothing; a scan again (a new detector) rewrites the same edges
    assert embed(cli)["scanned"] == 0
    with session_factory(settings.database_url)() as session, session.begin():
        session.execute(delete(RelationScan))
    assert embed(cli)["scanned"] == 10
    assert edges(settings).keys() == found.keys()
    assert ingest(cli, sources, "p", "merge") == {"p": p, "merge": merge}  # duplicates: nothing new
    assert edges(settings).keys() == found.keys()

    # deleting a parent deletes its edges (and nothing points at nothing)
    delete_adapter(session_factory(settings.database_url), ids["q1"])
    with session_factory(settings.database_url)() as session:
        left = session.scalar(select(func.count()).select_from(AdapterRelation).where(AdapterRelation.parent_id == ids["q1"]))
        assert left == 0 and session.get(Adapter, ids["q1"]) is None


def test_a_sample_of_the_modules_finds_what_the_whole_finds(
    cli: CLI, settings: Settings, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a sample budget that holds two of a rank-4 adapter's four modules, every adapter is compared on a sample: the
    step finds the same edges (a rescale, a cast, a pruned copy, a merge and its weights, a continuation) as comparing
    whole adapters, and each edge says how many modules it was found on."""
    ids = ingest(cli, sources, "p", "q1", "q2", "u1", "u2", "rescaled", "cast", "pruned", "merge", "continued")
    factors = dict(BlobStore(settings.blob_dir).get_factors(_blob_of(settings, ids["p"])))
    monkeypatch.setenv("ZOO_RELATION_SAMPLE_BYTES", str(2 * max(module_bytes(f) for f in factors.values())))
    assert embed(cli)["scanned"] == 10
    sampled = edges(settings)
    monkeypatch.delenv("ZOO_RELATION_SAMPLE_BYTES")
    with session_factory(settings.database_url)() as session, session.begin():
        session.execute(delete(RelationScan))
    assert embed(cli)["scanned"] == 10
    whole = edges(settings)
    assert len(whole) >= 8 and sampled.keys() == whole.keys()
    compared = {(e.evidence["modules_compared"], e.evidence["modules"]) for e in sampled.values()}
    assert (2.0, 4.0) in compared and compared <= {(1.0, 4.0), (2.0, 4.0)}  # the cat merge's rank 8: one module
    assert not [e for e in whole.values() if "modules_compared" in e.evidence]
    merge = [e for k, e in sampled.items() if k[0] == ids["merge"] and k[1] == ids["q1"]][0]
    assert merge.parameters["weight"] == pytest.approx(0.7, abs=0.05)
    key = (ids["pruned"], ids["p"], "pruned")  # its bound scaled to the sample's share of the energy
    assert sampled[key].evidence["residual_over_bound"] == pytest.approx(whole[key].evidence["residual_over_bound"], rel=0.3)

    # the cache holds each sample once: a neighbour asked for again as a query is the one held, its bytes counted once
    sessions = session_factory(settings.database_url)
    cache = FactorCache(sessions, BlobStore(settings.blob_dir), 1 << 30, sample_budget=2 * max(module_bytes(f) for f in factors.values()))
    first = cache.query(ids["p"])
    assert first is not None and first.whole_modules == 4 and len(first.factors) == 2
    near = cache.get([ids["rescaled"], ids["cast"]], cache.samples[ids["p"]])
    assert cache.query(ids["rescaled"]) is near[0] and cache.query(ids["p"]) is first
    assert len(cache.loaded) == 3 and cache.held == sum(size for _, size in cache.loaded.values()) == 3 * detector_bytes(first)
    delete_adapter(sessions, ids["u2"])  # deleted before its scan: no query, and left out of a neighbourhood
    assert cache.query(ids["u2"]) is None and [u.id for u in cache.get([ids["u2"], ids["cast"]], cache.samples[ids["p"]])] == [ids["cast"]]


def _blob_of(settings: Settings, adapter_id: int) -> str:
    with session_factory(settings.database_url)() as session:
        return str(session.get(Adapter, adapter_id).factors_blob)


def test_a_ties_merge_is_found_from_the_factors_as_saved(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """No sum of the parents' dW is a TIES merge's: it is found in the factors as its file had them, which ingest keeps
    (the gauge in the blob); the merge's parents are among its raw-factor neighbours."""
    ids = ingest(cli, sources, "q1", "q2", "u1", "u2", "p", "ties")
    report = embed(cli)
    assert report["scanned"] == 6 and report["failed"] == 0, report
    parents = {k[1]: e for k, e in edges(settings).items() if k[0] == ids["ties"] and k[2] == "merge"}
    assert set(parents) == {ids["q1"], ids["u1"]}
    assert parents[ids["q1"]].parameters["weight"] == pytest.approx(0.6, abs=0.05)
    assert parents[ids["u1"]].parameters["weight"] == pytest.approx(0.9, abs=0.05)
    edge = parents[ids["q1"]]
    assert edge.parameters["combination"] == "ties" and edge.evidence["density"] == pytest.approx(0.5, abs=0.05)
    assert edge.evidence["relative_residual"] < 1e-4 and edge.confidence > 0.9
    rc, out, _ = cli("lineage", str(ids["ties"]))
    assert rc == 0 and "ties" in out and f"derives from #{ids['u1']}" in out


@pytest.mark.parametrize(
    ("name", "parents", "combination"), [("svdmerge", {"q2": 0.6, "u2": 0.8}, "svd"), ("linmerge", {"q1": 0.5, "u2": 0.7}, "linear")]
)
def test_svd_and_linear_merges_are_found_through_ingest_and_embed(
    cli: CLI, settings: Settings, sources: dict[str, Path], name: str, parents: dict[str, float], combination: str
) -> None:
    """The step's merge test, whatever it leaves out as cheap to rule out (the svd fit's residual where it cannot be
    chosen, the pair blocks it keeps), finds PEFT's own svd and linear merges among other adapters, with their weights."""
    ids = ingest(cli, sources, "q1", "q2", "u1", "u2", "p", "merge", name)
    report = embed(cli)
    assert report["scanned"] == 7 and report["failed"] == 0, report
    found = {k[1]: e for k, e in edges(settings).items() if k[0] == ids[name] and k[2] == "merge"}
    assert set(found) == {ids[p] for p in parents}, found
    for parent, weight in parents.items():
        edge = found[ids[parent]]
        assert edge.parameters["combination"] == combination and edge.parameters["weight"] == pytest.approx(weight, abs=0.05)
        assert edge.evidence["relative_residual"] < 1e-3 and edge.confidence > 0.5


def test_a_parent_stored_after_its_child_is_found(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """Both directions: the merge and the copy come first, their parents after, each batch embedded on its own."""
    first = ingest(cli, sources, "merge", "rescaled", "u1")
    embed(cli)
    assert edges(settings) == {}
    then = ingest(cli, sources, "q1", "q2", "p")
    embed(cli)
    found = edges(settings)
    copy = found[(then["p"], first["rescaled"], "rescaled")]  # the weights do not say which came first: the older is the parent
    assert copy.parameters["scale"] == pytest.approx(0.5, rel=1e-4)
    assert {k[1] for k in found if k[0] == first["merge"] and k[2] == "merge"} == {then["q1"], then["q2"]}


def test_a_worker_finds_relations_right_after_ingest(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """The workers' path: a job's adapters are embedded in batches, each batch scanned at once (the space exists)."""
    ingest(cli, sources, "u1")
    embed(cli)
    assert cli("jobs", "add", str(sources["p"]), str(sources["rescaled"]), "--base-model", "tiny")[0] == 0
    assert cli("worker", "--drain")[0] == 0
    assert [k[2] for k in edges(settings)] == ["rescaled"]


def test_a_failed_scan_is_recorded_and_reported_and_loses_nothing(
    cli: CLI, settings: Settings, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = ingest(cli, sources, "p", "rescaled")

    def broken(query, candidates):  # noqa: ANN001, ANN202
        raise ValueError("broken detector")

    monkeypatch.setattr(relations, "find_relations", broken)
    report = embed(cli)
    assert report["failed"] == 2 and report["errors"][0] == f"adapter {ids['p']}: ValueError: broken detector"
    rc, out, _ = cli("lineage", str(ids["p"]))
    assert rc == 0 and "last scan failed: ValueError: broken detector" in out
    monkeypatch.undo()
    assert embed(cli)["scanned"] == 2  # tried again, and found
    assert (ids["rescaled"], ids["p"], "rescaled") in edges(settings)

    def down(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("index unreadable")

    later = ingest(cli, sources, "cast", "q1")
    monkeypatch.setattr(QueryEngine, "stored_neighbours", down)  # the batch's search: each of its adapters fails
    report = embed(cli)
    assert report["failed"] == 2 and sorted(report["errors"]) == sorted(f"adapter {i}: OSError: index unreadable" for i in later.values())
    monkeypatch.undo()
    assert embed(cli)["scanned"] == 2 and (later["cast"], ids["p"], "cast") in edges(settings)


def test_a_scan_reads_each_blob_once_and_holds_at_most_its_budget(
    cli: CLI, settings: Settings, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent embedded after its merge: its scan compares it with its neighbours, then tests the merge again
    against the merge's own neighbours, which are mostly the same adapters; each adapter's factors are read from the
    blob store once per adapter scanned. Past the budget a scan's factors cache drops the least recently asked for,
    never those asked for now."""
    ids = ingest(cli, sources, "merge", "q2", "p", "rescaled", "cast")
    embed(cli)
    ids |= ingest(cli, sources, "q1")
    embed(cli)
    found = {k[1] for k in edges(settings) if k[0] == ids["merge"] and k[2] == "merge"}
    assert found == {ids["q1"], ids["q2"]}  # by the merge test again, when q1 came
    sessions = session_factory(settings.database_url)
    with sessions.begin() as session:  # q1 as just embedded: scanned by no detector yet
        session.execute(delete(AdapterRelation))
        session.execute(delete(RelationScan).where(RelationScan.adapter_id == ids["q1"]))
        blob_of = dict(session.execute(select(Adapter.id, Adapter.factors_blob)).all())
    reads: list[str] = []
    get_factors = BlobStore.get_factors
    monkeypatch.setattr(BlobStore, "get_factors", lambda store, digest: reads.append(digest) or get_factors(store, digest))
    blobs = BlobStore(settings.blob_dir)
    report = relations.scan_space(QueryEngine(sessions, blobs, settings.data_dir), sessions, blobs, "tiny", [ids["q1"]])
    assert report["scanned"] == 1 and {k[1] for k in edges(settings) if k[0] == ids["merge"]} == found
    assert len(reads) > len(found) and Counter(reads) <= Counter(blob_of.values()), (reads, blob_of)  # none read twice

    monkeypatch.undo()
    one = detector_bytes(FactorCache(sessions, BlobStore(settings.blob_dir), 1 << 40).get([ids["p"]])[0])
    cache = FactorCache(sessions, BlobStore(settings.blob_dir), 2 * one)  # every adapter here has p's shapes
    first = cache.get([ids["p"], ids["q1"]])
    assert [u.id for u in first] == [ids["p"], ids["q1"]] and cache.held == 2 * one
    assert [u.id for u in cache.get([ids["q2"]])] == [ids["q2"]]
    assert list(cache.loaded) == [(ids["q1"], None), (ids["q2"], None)] and cache.held == 2 * one  # p, the least recent, dropped
    assert cache.get([ids["q1"]])[0] is first[1]  # kept: not read again
    everything = [ids[n] for n in ("p", "q1", "q2", "rescaled")]
    assert [u.id for u in cache.get(everything)] == everything and cache.held == 4 * one  # this call's are never dropped
    assert [u.id for u in cache.get([ids["cast"], 10**6])] == [ids["cast"]]  # one not stored is left out
    assert list(cache.loaded) == [(ids["rescaled"], None), (ids["cast"], None)] and cache.held == 2 * one


def test_a_merge_names_the_source_of_a_cast_it_was_found_with(
    cli: CLI, settings: Settings, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge whose neighbourhood held a bf16 cast of its parent and not the parent itself (a zoo of many relatives,
    as the lineage recipe's 3-parent merges) names the cast, within its rounding. When the cast is then found to be a
    copy of the parent, the merge is fitted again and names the parent; and from then on a neighbourhood holding the
    cast holds its source too."""
    ids = ingest(cli, sources, "p", "q2", "u1", "cast", "pmerge")
    embed(cli)
    assert {k[1] for k in edges(settings) if k[0] == ids["pmerge"] and k[2] == "merge"} == {ids["p"], ids["q2"]}
    assert (ids["cast"], ids["p"], "cast") in edges(settings)
    sessions = session_factory(settings.database_url)
    with sessions.begin() as session:  # as a scan that had the cast and not p among the merge's neighbours stored it
        session.execute(delete(AdapterRelation))
        session.execute(delete(RelationScan).where(RelationScan.adapter_id == ids["cast"]))
    factors = FactorCache(sessions, BlobStore(settings.blob_dir), 1 << 40)
    merge, *parents = factors.get([ids["pmerge"], ids["cast"], ids["q2"]])
    found = relations.find_relations(merge, parents).merge
    assert found is not None and set(found.parents) == {ids["cast"], ids["q2"]}
    with sessions.begin() as session:
        write_scan(session, ids["pmerge"], relation_rows.merge_rows(found, ids["pmerge"]), DETECTOR, 0)
    blobs = BlobStore(settings.blob_dir)
    engine = QueryEngine(sessions, blobs, settings.data_dir)
    assert relations.scan_space(engine, sessions, blobs, "tiny", [ids["cast"]])["scanned"] == 1
    renamed = {k[1]: e for k, e in edges(settings).items() if k[0] == ids["pmerge"] and k[2] == "merge"}
    assert renamed.keys() == {ids["p"], ids["q2"]}
    assert renamed[ids["p"]].parameters["weight"] == pytest.approx(0.8, abs=0.01)
    assert renamed[ids["q2"]].parameters["weight"] == pytest.approx(0.4, abs=0.01)

    monkeypatch.setattr(relations, "NEIGHBOURS", 1)  # a neighbourhood of one: the cast's source comes with it
    monkeypatch.setattr(relations, "RAW_NEIGHBOURS", 0)
    scan = relations.RelationScan(engine, sessions, "tiny", 0, False, factors)
    for adapter in ("pmerge", "u1", "q2"):
        near = [i for i, _ in scan.neighbours(ids[adapter])]
        assert ids["cast"] not in near or ids["p"] in near, (adapter, near)
    assert ids["p"] not in [i for i, _ in scan.neighbours(ids["p"])]  # p is the source of its nearest: not its own neighbour


def _continuation(child: int, parent: int, shared: float) -> EdgeRow:
    return {
        "child_id": child,
        "parent_id": parent,
        "relation": "continuation",
        "parameters": {"direction_confidence": 1.0},
        "evidence": {"module_cosine": 0.1, "shared_rows": shared},
        "confidence": 1.0,
    }


def test_an_adapter_keeps_one_origin_whatever_the_order_edges_come_in(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """As stored: of its continuation parents a child keeps the one it shares most rows with, a transform or merge
    found for it drops them, and a scan by a new detector replaces the older one's edges around the adapter."""
    ids = ingest(cli, sources, "p", "q1", "q2", "u1", "u2")
    c, p1, p2, p3, q = ids["u2"], ids["p"], ids["q1"], ids["q2"], ids["u1"]
    sessions = session_factory(settings.database_url)

    def scan(adapter: int, *rows: EdgeRow, detector: str = DETECTOR) -> set[tuple[int, int, str]]:
        with sessions.begin() as session:
            write_scan(session, adapter, rows, detector, 1)
        return set(edges(settings))

    assert scan(p1, _continuation(c, p1, 0.8)) == {(c, p1, "continuation")}
    assert scan(p2, _continuation(c, p2, 0.9)) == {(c, p2, "continuation")}  # nearer: replaces
    assert scan(p3, _continuation(c, p3, 0.7)) == {(c, p2, "continuation")}  # farther: refused
    merge = {**_continuation(c, p1, 0.0), "relation": "merge", "parameters": {"weight": 1.0, "combination": "cat", "parents": 2}}
    assert scan(c, merge, {**merge, "parent_id": q}) == {(c, p1, "merge"), (c, q, "merge")}  # a merge explains c
    assert scan(p3, _continuation(c, p3, 0.99)) == {(c, p1, "merge"), (c, q, "merge")}
    assert scan(p1, _continuation(p1, c, 0.99)) == {(c, p1, "merge"), (c, q, "merge")}  # nor the pair the other way
    assert scan(p3, _continuation(p3, p2, 0.9)) == {(c, p1, "merge"), (c, q, "merge"), (p3, p2, "continuation")}
    assert scan(p2, detector="provenance-next") == {(c, p1, "merge"), (c, q, "merge")}  # the older detector's edge around p2


def test_neighbours_sketches_come_from_the_engine_as_stored(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """The step tells copies among a neighbourhood by their module sketches, read from the engine's index in memory
    (`stored_vectors`, not the database): they are the stored vectors, a rescaled copy's parallel to its source's, and
    an id the index does not hold is left out."""
    ids = ingest(cli, sources, "p", "rescaled", "q1")
    embed(cli)
    sessions = session_factory(settings.database_url)
    engine = QueryEngine(sessions, BlobStore(settings.blob_dir), settings.data_dir)
    wanted = [ids["p"], ids["rescaled"], ids["q1"]]
    with sessions() as session:
        held = engine.stored_vectors(session, "tiny", SKETCH, [*wanted, 10**6])
        space = get_space(session, "tiny")
        found, stored = load_embeddings(session, serving_embedders(session, space.id)[SKETCH], ids=np.array(wanted))
    assert sorted(held) == sorted(wanted)
    for i, vector in zip(found.tolist(), stored, strict=True):
        np.testing.assert_allclose(held[i], vector / np.linalg.norm(vector), atol=1e-3)  # the index keeps unit vectors
    assert held[ids["p"]] @ held[ids["rescaled"]] > 1 - 1e-4 > held[ids["p"]] @ held[ids["q1"]]
    assert engine.stored_vectors(session, "tiny", W2T, wanted) == {}  # no W2T trained: nothing held


def test_stored_neighbours_rank_as_the_search_does(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """The step's batched search (`stored_neighbours`, one index search for many adapters) gives each adapter what
    `similar` ranks for it alone, by module sketches and by raw factors; an id the index does not hold is left out."""
    ids = ingest(cli, sources, "p", "rescaled", "q1", "q2", "merge", "u1", "u2")
    embed(cli)
    sessions = session_factory(settings.database_url)
    engine = QueryEngine(sessions, BlobStore(settings.blob_dir), settings.data_dir)
    wanted = sorted(ids.values())
    with sessions() as session:
        for method in ("sketch", "raw"):
            batched = engine.stored_neighbours(session, "tiny", method, [*wanted, 10**6], 4)
            assert sorted(batched) == wanted
            for i in wanted:
                alone = engine.similar(session, "tiny", Query(str(i), adapter_id=i), 4, method=method)["results"]
                assert [n for n, _ in batched[i]] == [h["adapter_id"] for h in alone], (method, i)
                np.testing.assert_allclose([s for _, s in batched[i]], [h["score"] for h in alone], rtol=1e-6)
                assert i not in dict(batched[i])


def _edge_table(settings: Settings) -> dict[tuple[int, int, str], tuple[dict, float]]:
    return {k: (e.parameters, e.confidence) for k, e in edges(settings).items()}


def test_a_step_in_batches_stores_what_one_adapter_at_a_time_does(
    cli: CLI, settings: Settings, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merges and a copy stored before their parents, then the parents and more relatives (a cast, a pruned copy, a
    continuation, unrelated ones): scanned in batches of several, across a batch's edge, the step stores the edges,
    parameters and confidences that scanning one adapter at a time does, the merges found by testing them again."""
    first = ingest(cli, sources, "merge", "pmerge", "rescaled", "ties")
    embed(cli)
    then = ingest(cli, sources, "q1", "q2", "p", "u1", "cast", "pruned", "continued")
    embed(cli)
    sessions = session_factory(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    tables = {}
    for batch in (1, 3, len(then)):
        with sessions.begin() as session:  # the later adapters as just embedded: the earlier ones scanned before them
            session.execute(delete(AdapterRelation))
            session.execute(delete(RelationScan).where(RelationScan.adapter_id.in_(then.values())))
        monkeypatch.setattr(relations, "BATCH", batch)
        report = relations.scan_space(QueryEngine(sessions, blobs, settings.data_dir), sessions, blobs, "tiny", then.values())
        assert report["scanned"] == len(then) and report["failed"] == 0, report
        tables[batch] = _edge_table(settings)
    assert tables[3] == tables[1] and tables[len(then)] == tables[1]
    found = tables[1]
    assert {k[1] for k in found if k[0] == first["merge"] and k[2] == "merge"} == {then["q1"], then["q2"]}  # tested again
    assert {k[1] for k in found if k[0] == first["pmerge"] and k[2] == "merge"} == {first["rescaled"], then["q2"]}  # the older copy
    family = {then["p"], first["rescaled"]}  # p and its copy with alpha changed, the older of them the parent
    assert (then["p"], first["rescaled"], "rescaled") in found and (then["pruned"], then["p"], "pruned") in found
    assert {k[2] for k in found if k[0] == then["cast"] and k[1] in family} & {"cast", "rescaled"}
    continued = {k[1] for k in found if k[0] == then["continued"] and k[2] == "continuation"}
    assert continued and continued <= family


def test_a_batch_keeps_the_copy_edges_as_its_scans_store_them(cli: CLI, settings: Settings, sources: dict[str, Path]) -> None:
    """A batch reads the stored copy edges of its neighbourhoods once, then keeps them as each of its scans stores its
    edges (another detector's edges around the adapter deleted, the new copies written): after every store, what the
    batch holds is what a fresh read of the database gives."""
    ids = ingest(cli, sources, "p", "rescaled", "cast", "u1", "u2")
    embed(cli)
    p, rescaled, cast, u1, u2 = (ids[n] for n in ("p", "rescaled", "cast", "u1", "u2"))
    sessions = session_factory(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    engine = QueryEngine(sessions, blobs, settings.data_dir)
    copy = {"parameters": {"scale": 1.0, "steps": []}, "evidence": {}, "confidence": 1.0}
    with sessions.begin() as session:  # edges of an older detector around u1 and u2
        write_scan(session, u2, [{"child_id": u2, "parent_id": u1, "relation": "identical", **copy}], "provenance-old", 0)
        write_scan(session, u1, [{"child_id": u1, "parent_id": rescaled, "relation": "cast", **copy}], "provenance-old", 0)

    def fresh() -> dict[int, dict[int, str]]:
        view = relations.RelationScan(engine, sessions, "tiny", 0, False, FactorCache(sessions, blobs, 1 << 30))
        view.read_copies(list(ids.values()))
        return view.copies

    scan = relations.RelationScan(engine, sessions, "tiny", 0, False, FactorCache(sessions, blobs, 1 << 30))
    scan.read_copies(list(ids.values()))
    assert scan.copies[u2] == {u1: "provenance-old"} and scan.copies[u1] == {rescaled: "provenance-old"}
    for adapter, rows in (
        (u1, [{"child_id": u2, "parent_id": cast, "relation": "rescaled", **copy}]),  # drops both old edges, adds one
        (p, []),
        (cast, [{"child_id": u1, "parent_id": cast, "relation": "identical", **copy}]),
    ):
        with sessions.begin() as session:
            write_scan(session, adapter, rows, DETECTOR, 1)
        scan.stored(adapter, rows)
        assert scan.copies == fresh(), adapter
    assert scan.copies[u2] == {cast: DETECTOR} and scan.copies[u1] == {cast: DETECTOR}


def test_the_step_collects_cycles_rarely_and_restores_the_collector() -> None:
    """The step raises the collector's first threshold while it runs (its kept pair blocks are many small objects) and
    gives back the one it found, whatever happens inside."""
    import gc

    before = gc.get_threshold()
    with pytest.raises(RuntimeError), relations.rare_collections():
        assert gc.get_threshold()[0] >= relations.GC_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
        raise RuntimeError("a scan failed")
    assert gc.get_threshold() == before
