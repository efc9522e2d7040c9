"""What `zoo` prints to a newcomer: duplicates named and traced by every ingest path, counts in the right number,
tables with headers, and an empty search said in words (real CLI runs on real PEFT adapters)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import CLI


def ingest_one(cli: CLI, path: Path, *more: str) -> dict:
    rc, (result,) = cli.json_lines("ingest", "--no-embed", str(path), "--base-model", "tiny", *more)
    assert rc == 0 and result["status"] == "ingested", result
    return result


def test_every_ingest_path_names_and_records_the_duplicate(cli: CLI, seed_sources: Path, tmp_path: Path) -> None:
    folder = seed_sources / "zoo" / "w00"
    stored = ingest_one(cli, folder)["adapter_id"]
    exports = {"peft": tmp_path / "w00.zip", "kohya": tmp_path / "w00-kohya.safetensors", "diffusers": tmp_path / "w00-diff.safetensors"}
    for fmt, out in exports.items():
        assert cli("export", str(stored), "--format", fmt, "--out", str(out))[0] == 0

    # the same folder (found by its file hash) and the three exports (found by their canonical form)
    sources = [folder, *exports.values()]
    for source in sources:
        rc, out, _ = cli("ingest", "--no-embed", str(source), "--base-model", "tiny")
        assert rc == 0 and f"{source}: duplicate of #{stored} w00" in out and "0 ingested, 1 duplicate, 0 failed" in out
    # a job's duplicate is recorded once, by the job
    rc, (job,) = cli.json_lines("jobs", "add", str(folder), "--base-model", "tiny")
    assert rc == 0 and cli("worker", "--drain", "--job", str(job["id"]))[0] == 0

    # the adapter's own folder ingested again is not another source of it: the exports are, each once
    assert cli("ingest", "--no-embed", str(exports["kohya"]), "--base-model", "tiny")[0] == 0
    rc, (shown,) = cli.json_lines("show", str(stored))
    assert shown["duplicate_sources"] == [str(s) for s in exports.values()]
    rc, out, _ = cli("show", str(stored))
    assert out.count("(a duplicate of this adapter)") == 3
    rc, listed = cli.json_lines("jobs", "list")
    mine = [j for j in listed[0] if j["created_by"] == "zoo ingest"]
    assert len(mine) == 3 and all(j["counts"]["duplicate"] == 1 and j["state"] == "done" for j in mine)
    rc, out, _ = cli("jobs", "show", str(mine[0]["id"]))
    assert "  1 item: 0 done, 1 duplicate, 0 failed" in out


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_one_adapter_space_then_two_read_as_sentences_and_tables(cli: CLI, seed_sources: Path) -> None:
    labels = str(seed_sources / "labels.csv")
    first = ingest_one(cli, seed_sources / "zoo" / "w00", "--labels", labels)["adapter_id"]
    rc, out, _ = cli("embed")
    assert rc == 0 and "embedded 1 new adapter, 1 in the" in out and "adapters" not in out.split("\n")[0]
    assert "no map file" not in out and "map: fitted a new one, saved to " in out
    rc, out, _ = cli("search", str(first))
    assert rc == 0 and out.strip() == "no other adapter in space tiny to compare w00 with"
    rc, out, _ = cli("list")
    header, row = out.splitlines()
    assert columns(header) == ["id", "name", "format", "rank", "base model", "task", "hash"]
    assert columns(row)[:6] == [str(first), "w00", "peft", "4", "tiny", "qk"]
    assert header.index("task") == row.index("qk")  # aligned

    ingest_one(cli, seed_sources / "zoo" / "w01", "--labels", labels)
    rc, out, _ = cli("embed")
    assert rc == 0 and ", 2 in the" in out
    rc, out, _ = cli("search", str(first))
    lines = out.splitlines()
    assert lines[0].startswith("nearest to w00 in tiny") and columns(lines[1]) == ["score", "id", "name", "task"]
    assert columns(lines[2])[1:] == [str(first + 1), "w01", "qv"] and len(lines) == 3
    assert lines[1].index("task") == lines[2].index("qv")
    rc, out, _ = cli("search", str(first), "--filter", "task=qk")
    assert out.strip() == "no other adapter in space tiny to compare w00 with that has task=qk"
