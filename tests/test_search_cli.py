"""zoo embed / search / train / predict / index against real databases and real PEFT adapters (the seeded zoo's sources,
tests/conftest.py seed_sources: w00..w11, tasks qk and qv, a test_accuracy each)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from embed.serving.exact_search import brute_force
from tests.conftest import CLI
from tests.test_engine import stored_factors
from webapp import create_app
from zoo.domain.channels import channel_similarity_matrix
from zoo.domain.exact_scores import EXACT_SCORES


def ingest(cli: CLI, seed_sources: Path) -> list[dict]:
    rc, results = cli.json_lines(
        "ingest", "--no-embed", str(seed_sources / "zoo"), "--labels", str(seed_sources / "labels.csv"), "--base-model", "tiny"
    )
    assert rc == 0
    return results


def test_embed_search_and_index(cli: CLI, seed_sources: Path) -> None:
    results = ingest(cli, seed_sources)
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0 and reports[0]["method"] == "module_sketch" and reports[0]["embedded"] == 12 and reports[0]["total"] == 12
    assert reports[0]["index_kind"] == "flat" and reports[0]["module_store"] == "built"
    rc, (again,) = cli.json_lines("embed")
    assert again[0]["embedded"] == 0 and again[0]["index"] == "loaded" and again[0]["module_store"] == "loaded"

    first = results[0]["adapter_id"]
    rc, (found,) = cli.json_lines("search", str(first), "-k", "5")
    assert rc == 0 and found["method"] == "module" and len(found["results"]) == 5
    assert found["module_stage"] == "exact (module store)" and found["index_states"] == {"module_sketch": "loaded"}
    assert first not in [r["adapter_id"] for r in found["results"]]
    scores = [r["score"] for r in found["results"]]
    assert scores == sorted(scores, reverse=True)
    # searching by id loads no torch, peft or matplotlib: start-up is most of a command's time
    code = (
        "import sys; from zoo.cli import main; "
        f"rc = main(['--db', {cli.settings.database_url!r}, '--data-dir', {str(cli.settings.data_dir)!r}, 'search', '{first}', '--json']); "
        "print(rc, sorted(m for m in ('torch', 'peft', 'matplotlib', 'transformers', 'sklearn') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 []"
    # the same adapter given as a path (read, canonicalized, not stored) is found to be it, and answered as it
    rc, (by_path,) = cli.json_lines("search", str(seed_sources / "zoo" / "w00"), "-k", "3")
    assert by_path["stored_as"] == {"adapter_id": first, "name": "w00"}
    rc, (by_id,) = cli.json_lines("search", str(first), "-k", "3")
    assert by_path["results"] == by_id["results"] and first not in [r["adapter_id"] for r in by_path["results"]]
    rc, (filtered,) = cli.json_lines("search", str(first), "-k", "1000", "--filter", "task=qv")
    rc, (everything,) = cli.json_lines("search", str(first), "-k", "1000")
    want = {r["adapter_id"] for r in everything["results"] if r["labels"].get("task") == "qv"}
    assert want and {r["adapter_id"] for r in filtered["results"]} == want  # every match comes back, nothing else

    # FAISS agrees with a brute-force numpy search over the stored sketch embeddings
    from embed.serving.resources import resolve_space
    from zoo.store.embedders import active_embedder
    from zoo.store.embeddings import load_embeddings
    from zoo.store.session import session_factory

    with session_factory(cli.settings.database_url)() as session:
        embedder = active_embedder(session, resolve_space(session, None), method="module_sketch")
        ids, vectors = load_embeddings(session, embedder)
    rc, (sk,) = cli.json_lines("search", str(first), "-k", "4", "--method", "sketch")
    row = int(np.nonzero(ids == first)[0][0])
    _, ref = brute_force(ids, vectors, vectors[row : row + 1], 5)
    assert [r["adapter_id"] for r in sk["results"]] == [i for i in ref[0].tolist() if i != first][:4]

    rc, (stats,) = cli.json_lines("index", "stats")
    sketch_stats = next(e for e in stats["embedders"] if e["method"] == "module_sketch")
    assert sketch_stats["count"] == 12 and sketch_stats["recall@10_vs_exact"] == 1.0 and sketch_stats["state"] == "loaded"
    # an index file that disagrees with the database is detected without reading vectors, the query is
    # answered from the database's vectors and says so; `zoo index` brings the file back
    path = cli.settings.data_dir / "index" / f"embedder-{sketch_stats['embedder_id']}.index"
    path.write_bytes(b"not a faiss index")
    rc, (again,) = cli.json_lines("search", str(first), "-k", "5")
    assert rc == 0 and [r["adapter_id"] for r in again["results"]] == [r["adapter_id"] for r in found["results"]]
    state = again["index_states"]["module_sketch"]
    assert state.startswith("answered from the database") and "zoo index rebuild" in state
    rc, (stats,) = cli.json_lines("index", "stats")
    sketch_stats = next(e for e in stats["embedders"] if e["method"] == "module_sketch")
    assert sketch_stats["state"].startswith("rebuilt (the file disagreed")
    rc, (stats,) = cli.json_lines("index", "rebuild")
    assert {e["state"] for e in stats["embedders"]} == {"rebuilt (asked)"} and stats["module_store"] == "built"
    assert {e["method"]: e["count"] for e in stats["embedders"]} == {"module_sketch": 12, "raw_factors": 12, "input_gram_sketch": 12}


def test_train_predict(cli: CLI, seed_sources: Path, tmp_path: Path) -> None:
    ingest(cli, seed_sources)
    rc, (info,) = cli.json_lines("train", "--epochs", "2", "--members", "2")
    assert rc == 0 and info["heads"] == ["task"] and info["regression"] == ["test_accuracy"]
    assert len(info["epochs"]) == 2 and set(info["predictors"]) == {"task", "test_accuracy"}
    assert info["embedded"] == {"w2t": 12, "module_sketch": 12, "raw_factors": 12, "input_gram_sketch": 12}
    assert Path(info["checkpoint"], "model.safetensors").exists()
    rc, (pred,) = cli.json_lines("predict", str(seed_sources / "outside" / "new"))
    assert rc == 0 and pred["stored_as"] is None
    probs = [c["probability"] for c in pred["attributes"]["task"]]
    assert {c["value"] for c in pred["attributes"]["task"]} == {"qk", "qv"} and sum(probs) == pytest.approx(1.0, abs=1e-4)
    m = pred["metrics"]["test_accuracy"]
    assert m["low"] <= m["value"] <= m["high"] and m["method"] == info["predictors"]["test_accuracy"]
    assert pred["predictors"] == info["predictors"] and pred["search"] == info["choices"]["search"]["chosen"]
    # twelve labelled adapters are too few for W2T to win clearly: search stays exact, predictions are kNNs
    assert info["choices"]["search"]["chosen"] in EXACT_SCORES
    assert all(info["predictors"][k].startswith("knn ") for k in ("task", "test_accuracy"))
    from embed.selection.metrics import knn_regress
    from zoo.domain.methods import KnnPredictor
    from zoo.domain.similarity import dw_cosine_matrix, module_cosine_matrix
    from zoo.domain.sizes import update_profile
    from zoo.store.models import Label, Measurement
    from zoo.store.session import session_factory as sessions_of

    with sessions_of(cli.settings.database_url)() as session:
        accuracy = dict(session.execute(select(Measurement.adapter_id, Measurement.value)).all())
        tasks = dict(session.execute(select(Label.adapter_id, Label.value).where(Label.key == "task")).all())
    others = sorted(i for i in accuracy if i != 3)
    from embed.w2t.ensemble import W2TEnsemble
    from zoo.domain.channels import factor_stack

    emb = W2TEnsemble.load(Path(info["checkpoint"]))
    scores = {
        "dw": dw_cosine_matrix,
        "module": module_cosine_matrix,
        "input_gram": lambda q, g: channel_similarity_matrix(q, g, "input_gram"),
        # a channel metric fitted on the labelled adapters (embed/selection/fitted.py), from the factors in r×r blocks
        **{name: lambda q, g, m=m: m.between(factor_stack(g), factor_stack(q)) for name, m in emb.channel_metrics.items()},
    }
    rc, (by_id,) = cli.json_lines("predict", "3")
    knn = KnnPredictor.parse(info["predictors"]["test_accuracy"])
    query, gallery = stored_factors(cli, [3]), stored_factors(cli, others)
    sim = scores[knn.similarity.name](query, gallery)
    # a kNN that reads update profiles (weighing by size, or following the trend with the checkpoint's slope) gets them
    # from the factors; the estimate is clipped to the range seen in training
    reads_size = knn.width is not None or knn.trend
    sizes = tuple(np.array([update_profile(f.S for f in fs.values()) for fs in side]) for side in (query, gallery)) if reads_size else None
    slope = emb.trend_slopes["test_accuracy"] if knn.trend else None
    want = knn_regress(sim, np.array([accuracy[i] for i in others]), knn.k, knn.temperature, sizes, knn.width, slope)
    assert by_id["metrics"]["test_accuracy"]["value"] == pytest.approx(emb.clip("test_accuracy", want)[0], abs=1e-5)  # itself left out
    knn = KnnPredictor.parse(info["predictors"]["task"])
    sim = scores[knn.similarity.name](stored_factors(cli, [3]), stored_factors(cli, others))
    top = np.argsort(-sim[0])[: knn.k]
    votes = {t: sum(max(sim[0][j], 0) + 1e-6 for j in top if tasks[others[j]] == t) for t in ("qk", "qv")}
    assert by_id["attributes"]["task"][0]["value"] == max(votes, key=votes.get)
    # the served probabilities are the vote's shares calibrated as fit out of fold, with the neighbours counted
    from embed.selection.calibration import is_sure

    classes = emb.config.categorical["task"]
    shares = np.array([votes.get(c, 0.0) for c in classes])
    want_p = emb.calibrated("task", shares / shares.sum(), own_label_left_out=True)  # adapter 3 is labelled: its label left out
    served = {c["value"]: c for c in by_id["attributes"]["task"]}
    assert all(served[c]["probability"] == pytest.approx(want_p[i], abs=1e-6) for i, c in enumerate(classes))
    assert all(served[c]["neighbours"] == sum(tasks[others[j]] == c for j in top) for c in classes)
    confidence = by_id["confidence"]["task"]
    winner = by_id["attributes"]["task"][0]
    assert confidence["neighbours"] == len(top) and confidence["agreeing"] == winner["neighbours"] and confidence["calibrated"]
    assert confidence["sure"] == is_sure(winner["probability"], winner["neighbours"], len(top), emb.calibration["task"].sure_from)
    assert confidence["given"] == tasks[3] and confidence["agrees"] == (winner["value"] == tasks[3])
    # the file of a stored adapter is that adapter: the same answer, which says so
    rc, (as_file,) = cli.json_lines("predict", str(seed_sources / "zoo" / "w03"))
    rc, (as_stored,) = cli.json_lines("predict", str(as_file["stored_as"]["adapter_id"]))
    assert as_file["stored_as"]["name"] == "w03" and as_stored["stored_as"] is None
    assert as_file["attributes"] == as_stored["attributes"] and as_file["metrics"] == as_stored["metrics"]
    assert max(c["probability"] for c in by_id["attributes"]["task"]) < 1.0  # never certain on 11 labelled adapters
    rc, (found,) = cli.json_lines("search", "1", "-k", "3", "--method", "w2t")
    assert rc == 0 and len(found["results"]) == 3
    # with a supervised W2T trained, search defaults to the hybrid; a stored adapter given by path is searched as it
    rc, (hybrid,) = cli.json_lines("search", str(seed_sources / "zoo" / "w03"), "-k", "3")
    assert rc == 0 and hybrid["method"] == "hybrid" and len(hybrid["embedder_ids"]) == 2
    assert hybrid["stored_as"]["name"] == "w03" and "w03" not in [r["name"] for r in hybrid["results"]]
    rc, (by_stored_id,) = cli.json_lines("search", str(hybrid["stored_as"]["adapter_id"]), "-k", "3")
    assert hybrid["results"] == by_stored_id["results"]

    # beside the embedding's predictions, what a stored adapter inherits along its edges; a file has no edges
    new_file = cli("predict", str(seed_sources / "outside" / "new"))[1]
    assert pred["from_lineage"] is None and "from lineage: none (a file is not stored" in new_file
    copy = shutil.copytree(seed_sources / "zoo" / "w03", tmp_path / "w03-alpha")
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]}))
    rc, (stored,) = cli.json_lines("ingest", str(copy), "--base-model", "tiny")  # unlabelled; embedded, found a rescaled copy of w03
    rc, (copied,) = cli.json_lines("predict", str(stored["adapter_id"]))
    task = copied["from_lineage"]["attributes"]["task"]
    (source,) = task["values"][0]["sources"]
    assert source["adapter"]["name"] == "w03" and [v["value"] for v in task["values"]] == [tasks[source["adapter"]["id"]]] == ["qv"]
    rc, out, _ = cli("predict", str(stored["adapter_id"]))
    assert rc == 0 and f"task             qv >99%  (rescaled of #{source['adapter']['id']} w03)" in out
    app = create_app({"ZOO_DATABASE_URL": cli.settings.database_url, "ZOO_DATA_DIR": str(cli.settings.data_dir), "TESTING": True})
    (served,) = app.test_client().post("/api/v1/predict/attributes", json={"adapter_id": stored["adapter_id"]}).get_json()["predictions"]
    assert served["from_lineage"] == copied["from_lineage"] and served["attributes"] == copied["attributes"]
    served_fusion(cli, Path(info["checkpoint"]), scores["dw"], emb.channel_metrics["metric:search"], sorted(accuracy))


def served_fusion(cli: CLI, checkpoint: Path, dw, metric, labelled: list[int]) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint whose search is the channel metric with its top re-ordered by its fusion with dW
    (zoo/domain/fusion.py) is served so: `zoo search` ranks the candidates by the metric, and its first five by the
    fusion, each query's scores put on their own scale among the labelled adapters, the query itself left out."""
    from embed.serving.search_methods import served_search
    from embed.serving.space_state import load_w2t
    from embed.w2t.checkpoint import META, checkpoint_meta
    from zoo.domain.channels import factor_stack
    from zoo.domain.fusion import fused
    from zoo.domain.methods import SearchScore
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    with session_factory(cli.settings.database_url)() as session:
        everything = sorted(session.scalars(select(Adapter.id)))
    search = SearchScore("metric:search", 0.0, 0.0, 5, "fused:search")
    meta = json.loads((checkpoint / META).read_text())
    (checkpoint / META).write_text(json.dumps({**meta, "search": search.name}))
    for cached in (checkpoint_meta, served_search, load_w2t):
        cached.cache_clear()
    reordered = 0
    for query in sorted(labelled):
        rc, (found,) = cli.json_lines("search", str(query), "-k", str(len(everything) - 1))
        assert rc == 0 and found["method"] == "hybrid"
        gallery = [i for i in everything if i != query]
        reference = [gallery.index(i) for i in labelled if i != query]  # the labelled adapters but the query
        q, g = stored_factors(cli, [query]), stored_factors(cli, gallery)
        d, m = dw(q, g), metric.between(factor_stack(g), factor_stack(q))
        keys = search.ranking(m, np.zeros_like(m), rerank_exact=fused(d, m, d[:, reference], m[:, reference]))[0]
        at = [gallery.index(r["adapter_id"]) for r in found["results"]]
        assert sorted(at) == list(range(len(gallery))) and all(
            keys[i] >= keys[j] - 1e-9 for i, j in zip(at, at[1:], strict=False)
        )  # ties in any order
        # the same float32 factors' products, blocked otherwise by the engine than here (BLAS kernels differ by CPU)
        assert [r["score"] for r in found["results"]] == pytest.approx([float(m[0, j]) for j in at], abs=1e-6)
        order = np.argsort(-keys, kind="stable")
        reordered += order.tolist() != np.argsort(-m[0], kind="stable").tolist()
    assert reordered  # the fusion put a neighbour that stands out in dW first somewhere


def test_search_by_input_gram(cli: CLI, seed_sources: Path) -> None:
    """`zoo search --method input_gram` ranks the others by the input Gram cosine computed from their stored factors,
    and the API's similar takes the method too."""
    ingest(cli, seed_sources)
    assert cli("embed")[0] == 0
    rc, (found,) = cli.json_lines("search", "1", "-k", "5", "--method", "input_gram")
    assert rc == 0 and found["method"] == "input_gram"
    others = list(range(2, 13))
    want = channel_similarity_matrix(stored_factors(cli, [1]), stored_factors(cli, others), "input_gram")[0]
    order = [others[j] for j in np.argsort(-want, kind="stable")[:5]]
    assert [r["adapter_id"] for r in found["results"]] == order
    assert [r["score"] for r in found["results"]] == pytest.approx(sorted(want, reverse=True)[:5], abs=1e-5)
    app = create_app({"ZOO_DATABASE_URL": cli.settings.database_url, "ZOO_DATA_DIR": str(cli.settings.data_dir), "TESTING": True})
    served = app.test_client().get("/api/v1/adapters/1/similar?k=5&method=input_gram").get_json()
    assert [r["adapter_id"] for r in served["results"]] == order


def test_search_errors(cli: CLI, seed_sources: Path) -> None:
    rc, _, err = cli("search", "1")
    assert rc == 2 and "no adapter with id 1" in err
    ingest(cli, seed_sources)
    rc, _, err = cli("search", "1")
    assert rc == 2 and "run `zoo embed`" in err
    rc, _, _ = cli("embed")
    rc, _, err = cli("search", "1", "-k", "1001")
    assert rc == 2 and "k must be between 1 and 1000" in err
    rc, _, err = cli("search", "1", "--method", "nope")
    assert rc == 2 and "unknown search method" in err
    for k in ("0", "-3"):
        rc, _, err = cli("search", "1", "-k", k)
        assert rc == 2 and "k must be between 1 and 1000" in err
    rc, _, err = cli("predict", "1")
    assert rc == 2 and "has no supervised W2T embedder: run `zoo train" in err
