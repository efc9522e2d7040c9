"""input_gram search's first stage: the input-Gram sketch index `zoo embed` writes (embed/serving/search_methods.py GRAM), against real
PEFT files, a real database and the real query engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from sqlalchemy import select

from embed.serving import engine as engine_module
from embed.serving.engine import QueryEngine
from embed.serving.results import Query
from embed.serving.search_methods import GRAM, SKETCH
from tests.conftest import CLI
from tests.factories import TinyLM
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter, Embedder
from zoo.store.session import session_factory

#: adapters close to the query in dW (its update with a little noise on B): more than the small pool below
DECOYS = 8
#: first-stage candidates per index in these tests (the engine's CANDIDATES): fewer than the decoys
POOL = 4


def write_zoo(root: Path) -> None:
    """PEFT files of TinyLM's q and v projections (4 modules, 16 × 16, rank 4): `query`; `reheaded`, the query's update
    with its output side re-drawn (B → Q·B per module, Q a random orthogonal matrix: dW → Q·dW, the input Gram
    unchanged); DECOYS near copies of the query's dW (B plus 10 % noise), nearer it than `reheaded` in dW but not in the
    input Gram; and 4 unrelated adapters."""
    model = get_peft_model(TinyLM(seed=0), LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(0)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    query = {n: torch.randn(p.shape, generator=gen) for n, p in lora.items()}

    def save(name: str, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(values[n])
        model.save_pretrained(str(root / name))

    save("query", query)
    rotations = {n: torch.linalg.qr(torch.randn(v.shape[0], v.shape[0], generator=gen))[0] for n, v in query.items() if "lora_B" in n}
    save("reheaded", {n: rotations[n] @ v if n in rotations else v for n, v in query.items()})
    for i in range(DECOYS):
        noise = {n: 0.1 * v.norm() / v.numel() ** 0.5 * torch.randn(v.shape, generator=gen) for n, v in query.items() if "lora_B" in n}
        save(f"decoy{i}", {n: v + noise[n] if n in noise else v for n, v in query.items()})
    for i in range(4):
        save(f"other{i}", {n: torch.randn(v.shape, generator=gen) for n, v in query.items()})


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gram-zoo")
    write_zoo(root)
    return root


def ingest_and_embed(cli: CLI, zoo: Path) -> list[dict]:
    rc, _ = cli.json_lines("ingest", "--no-embed", str(zoo), "--base-model", "tiny")
    assert rc == 0
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0
    return reports


def ids_by_name(cli: CLI) -> dict[str, int]:
    with session_factory(cli.settings.database_url)() as session:
        return {str(n): int(i) for i, n in session.execute(select(Adapter.id, Adapter.name))}


def new_engine(cli: CLI) -> QueryEngine:
    return QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)


def nearest(cli: CLI, query_id: int, method: str = "input_gram") -> dict:
    with session_factory(cli.settings.database_url)() as session:
        return dict(new_engine(cli).similar(session, "tiny", Query("query", query_id), 3, method=method))


def test_input_gram_search_finds_a_reheaded_copy_that_module_sketch_candidates_miss(
    cli: CLI, zoo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index `zoo embed` writes gives input_gram search the re-headed copy at rank 1; a space embedded before it
    (no input-Gram embedder) answers from the module sketch's candidates, says so, and gets it at its next embed."""
    monkeypatch.setattr(engine_module, "CANDIDATES", POOL)
    reports = ingest_and_embed(cli, zoo)
    gram = next(r for r in reports if r["method"] == GRAM)
    assert gram["embedded"] == gram["total"] == DECOYS + 6 and gram["index"] == "built"
    assert (cli.settings.data_dir / "index" / f"embedder-{gram['embedder_id']}.index").exists()
    ids = ids_by_name(cli)
    engine = new_engine(cli)
    with session_factory(cli.settings.database_url)() as session:
        index = engine.space(session, "tiny").embedders[GRAM].index
        found = index.search(index.vectors(np.array([ids["query"]])), 2)[1][0].tolist()
        module = engine.similar(session, "tiny", Query("query", ids["query"]), POOL + 1, method="module")
    assert set(found) == {ids["query"], ids["reheaded"]}  # its input-Gram sketch is the query's
    # the module sketch's nearest are the decoys: a first stage from it alone never sees the re-headed copy
    assert ids["reheaded"] not in [r["adapter_id"] for r in module["results"]] and GRAM not in module["index_states"]
    by_gram = nearest(cli, ids["query"])
    assert by_gram["module_stage"] == "exact (module store)" and by_gram["index_states"][GRAM] == "loaded"
    assert by_gram["results"][0]["adapter_id"] == ids["reheaded"]
    assert by_gram["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)  # the same input Gram, exactly
    assert {r["adapter_id"] for r in by_gram["results"][1:]} <= {ids[f"decoy{i}"] for i in range(DECOYS)}

    with session_factory(cli.settings.database_url)() as session, session.begin():  # the space as it was before
        session.execute(select(Embedder).where(Embedder.method == GRAM)).scalar_one().active = False
    old = nearest(cli, ids["query"])
    assert old["index_states"][SKETCH] == "loaded"
    assert old["index_states"][GRAM].startswith("not built") and "zoo embed" in old["index_states"][GRAM]
    assert old["results"][0]["adapter_id"] != ids["reheaded"]  # the module sketch's candidates, as before
    (again,) = [r for r in cli.json_lines("embed")[1][0] if r["method"] == GRAM]
    assert again["embedded"] == DECOYS + 6 and again["embedder_id"] != gram["embedder_id"]
    renewed = nearest(cli, ids["query"])
    assert renewed["index_states"][GRAM] == "loaded" and renewed["results"][0]["adapter_id"] == ids["reheaded"]


def test_without_a_module_store_the_input_gram_comes_from_its_sketches(cli: CLI, zoo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOO_MODULE_STORE_BYTES", "1000")
    reports = ingest_and_embed(cli, zoo)
    assert reports[0]["module_store"].startswith("none (")
    ids = ids_by_name(cli)
    found = nearest(cli, ids["query"])
    assert found["module_stage"] == "input-Gram sketches (no module store)"
    assert found["results"][0]["adapter_id"] == ids["reheaded"] and found["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_hybrid_over_the_input_gram_takes_its_candidates_from_the_input_gram_index_where_the_space_has_one() -> None:
    from embed.serving.search_methods import W2T, stage_kinds
    from zoo.domain.methods import SearchScore

    new, old = {SKETCH: 1, GRAM: 2, W2T: 3}, {SKETCH: 1, W2T: 3}
    assert stage_kinds(SearchScore("input_gram", 0.0), new) == (GRAM, SKETCH)
    assert stage_kinds(SearchScore("input_gram", 0.3), new) == (GRAM, SKETCH, W2T)
    assert stage_kinds(SearchScore("input_gram", 0.3), old) == (SKETCH, W2T)
    assert stage_kinds(SearchScore("module", 0.3), new) == stage_kinds(SearchScore("dw", 0.0), new)[:1] + (W2T,) == (SKETCH, W2T)
    assert stage_kinds(SearchScore("input_gram", 1.0), new) == (W2T,)
