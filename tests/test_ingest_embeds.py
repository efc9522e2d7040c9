"""`zoo ingest` ends where a job ends: what it stored is embedded and its relations found (zoo/runners/embed_stage.py,
the stage `zoo worker` runs), so the adapters are searchable with no `zoo embed`; `--no-embed` stops after storing;
the `--json` lines are the same either way; a failed embed stage keeps what was stored and says `zoo embed` finishes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from zoo.cli import main
from zoo.config import Settings
from zoo.store.session import upgrade

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sources(root: Path) -> Path:
    """Four PEFT adapters of TinyLM under root/src, and `rescaled`: a copy of the first with lora_alpha doubled."""
    src = root / "src"
    write_random_peft_adapters(src, 4)
    shutil.copytree(src / "0000", src / "rescaled")
    config = json.loads((src / "rescaled" / "adapter_config.json").read_text())
    (src / "rescaled" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]}))
    return src


def test_ingest_embeds_and_finds_relations(cli: CLI, tmp_path: Path) -> None:
    src = _sources(tmp_path)
    rc, out, err = cli("ingest", str(src), "--base-model", "tiny")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "5 ingested, 0 duplicates, 0 failed"
    assert lines[1] == "embedded: 5 adapters in tiny" and lines[2].startswith("tiny: relations from the weights: 5 adapters scanned")
    ids = {r["name"]: r["id"] for r in json.loads(cli("list", "--json")[1])["results"]}

    # searchable with no `zoo embed`: neighbours by id, the rescaled copy nearest its parent
    rc, out, err = cli("search", str(ids["0000"]), "-k", "3", "--json")
    assert rc == 0, err
    found = json.loads(out)
    assert len(found["results"]) == 3 and found["results"][0]["adapter_id"] == ids["rescaled"]
    # the relation recorded as a worker's batch records it
    rc, out, _ = cli("lineage", str(ids["rescaled"]), "--json")
    parents = json.loads(out)["from_weights"]["parents"]
    assert [(e["adapter"]["id"], e["relation"]) for e in parents] == [(ids["0000"], "rescaled")]
    # nothing left for `zoo embed`: the ingest ended where it would
    rc, out, _ = cli("embed", "--json")
    reports = json.loads(out)
    assert rc == 0 and {r["embedded"] for r in reports} == {0} and reports[0]["relations"]["scanned"] == 0


def _zoo(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`zoo` in a process of its own on an SQLite database under `data`."""
    base = [sys.executable, "-m", "zoo.cli", "--db", f"sqlite:///{data / 'zoo.db'}", "--data-dir", str(data)]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=300)


def _without_timings(lines: list[dict]) -> list[dict]:
    return [{**line, "timings": sorted(line["timings"])} for line in lines]


def test_no_embed_stores_only_and_json_lines_are_the_same(cli: CLI, tmp_path: Path) -> None:
    src = _sources(tmp_path)
    rc, stored = cli.json_lines("ingest", str(src), "--base-model", "tiny", "--no-embed")
    assert rc == 0 and [r["status"] for r in stored] == ["ingested"] * 5
    rc, _, err = cli("search", "1")
    assert rc != 0 and "zoo embed" in err  # not embedded

    # the same sources ingested with the embed stage, by another process into another zoo: the same lines on stdout
    # (the seconds each stage took aside), the embed stage's summary on stderr
    other = tmp_path / "other"
    upgrade(f"sqlite:///{other / 'zoo.db'}")
    done = _zoo(other, "ingest", str(src), "--base-model", "tiny", "--json")
    assert done.returncode == 0, done.stderr
    embedded = [json.loads(line) for line in done.stdout.splitlines()]
    assert _without_timings(embedded) == _without_timings(stored)
    assert "embedded: 5 adapters in tiny" in done.stderr
    cli.capsys.readouterr()
    assert main(["--db", f"sqlite:///{other / 'zoo.db'}", "--data-dir", str(other), "search", "1", "--json"]) == 0
    assert json.loads(cli.capsys.readouterr().out)["results"]


def test_a_failed_embed_stage_keeps_what_was_stored(cli: CLI, settings: Settings, tmp_path: Path) -> None:
    src = _sources(tmp_path)
    settings.data_dir.mkdir(parents=True)
    (settings.data_dir / "index").write_text("a file where the index folder goes")  # the embed stage cannot write its indexes
    rc, out, err = cli("ingest", str(src), "--base-model", "tiny")
    assert rc == 1 and out.splitlines()[0] == "5 ingested, 0 duplicates, 0 failed"
    assert "the adapters are stored, but embedding them failed" in err and "`zoo embed`" in err
    assert json.loads(cli("list", "--json")[1])["total"] == 5
    (settings.data_dir / "index").unlink()
    assert cli("embed")[0] == 0  # finishes it
    rc, out, _ = cli("search", "1", "--json")
    assert rc == 0 and json.loads(out)["results"]


@pytest.mark.parametrize("kept", [0, 2])
def test_the_relation_step_says_what_its_read_budget_left_uncompared(
    cli: CLI, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: int
) -> None:
    """Where an adapter and its neighbours in float64 would pass ZOO_EMBED_CHUNK_BYTES (Llama-3-8B at full size under
    the default budget), the step compares it with fewer neighbours, or none: the report counts those adapters and the
    line says why and what to change (it read "5 adapters scanned, 0 edges found", as if they had been compared). A
    larger budget later scans those adapters again."""
    from zoo.domain.relations import Update
    from zoo.services.relations import COMPARED, detector_bytes
    from zoo.store.adapters import adapters_with_factors
    from zoo.store.blob_backends import open_blob_store
    from zoo.store.session import session_factory

    src = _sources(tmp_path)
    assert cli("ingest", str(src), "--base-model", "tiny", "--no-embed")[0] == 0
    sizes = []
    with session_factory(settings.database_url)() as session:
        for a in adapters_with_factors(session, "tiny"):
            sizes.append(detector_bytes(Update(dict(open_blob_store(settings).get_factors(a.factors_blob)))))
    assert len(sizes) == 5
    monkeypatch.setenv("ZOO_EMBED_CHUNK_BYTES", str((kept + 1) * max(sizes)))  # room for the adapter and `kept` others
    rc, out, err = cli("embed", "--json")
    assert rc == 0, err
    report = json.loads(out)[0]["relations"]
    assert report["scanned"] == 5 and report["budget_cut"] == 5 and report["uncompared"] == (5 if kept == 0 else 0)
    assert report["largest_mb"] == pytest.approx(max(sizes) / 1e6)
    assert report["edges"] == 0 if kept == 0 else report["edges"] > 0  # the rescaled copy is its parent's nearest

    more = write_random_peft_adapters(tmp_path / "more", 3, seed=1)
    rc, out, err = cli("ingest", *map(str, more), "--base-model", "tiny")  # the same budget, in words
    assert rc == 0, err
    said = "3 adapters compared with no neighbour" if kept == 0 else f"3 adapters with fewer than {COMPARED}"
    assert said in out.splitlines()[2] and "(ZOO_EMBED_CHUNK_BYTES, " in out.splitlines()[2]

    rc, out, err = cli("embed", "--json")  # the same budget: nothing more to compare
    assert rc == 0 and json.loads(out)[0]["relations"]["scanned"] == 0, err
    monkeypatch.setenv("ZOO_EMBED_CHUNK_BYTES", str(64 * max(sizes)))  # a larger budget scans the cut adapters again
    rc, out, err = cli("embed", "--json")
    again = json.loads(out)[0]["relations"]
    assert rc == 0 and again["scanned"] == 8 and again["budget_cut"] == 0 and again["edges"] > 0, err  # the copy found
    rc, out, err = cli("embed", "--json")
    assert rc == 0 and json.loads(out)[0]["relations"]["scanned"] == 0, err
