"""The Hub source through the real huggingface_hub client against a local fake Hub (tests/hub_server.py):
`zoo ingest hf://...` pinned to the commit sha, re-ingests answered before any download, new commits as new
versions, `zoo crawl` into a job run by `zoo worker --drain`, hostile repos failing their item only, rate limits,
offline mode from the cache."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI
from tests.factories import write_kohya_file, write_random_peft_adapters
from tests.hub_server import TOKEN, FakeRepo, HubServer
from zoo.store.models import Adapter
from zoo.store.session import session_factory

BASE = "org/tiny-base"
CARD = b"---\nlicense: mit\nbase_model: org/tiny-base\ndatasets:\n- imdb\ntags:\n- lora\n---\n# A tiny adapter\n"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_random_peft_adapters(tmp_path_factory.mktemp("hub_adapters"), 4)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("ZOO_HUB_MAX_WAIT_S", "5")
        yield server


def row(cli: CLI, adapter_id: int) -> Adapter:
    with session_factory(cli.settings.database_url)() as session:
        found = session.get(Adapter, adapter_id)
        assert found is not None
        return found


def peft_repo(path: Path, **kw: object) -> FakeRepo:
    kw.setdefault("card_data", {"license": "mit", "base_model": BASE, "datasets": ["imdb"]})
    kw.setdefault("tags", ["peft", "lora", f"base_model:adapter:{BASE}", "license:mit"])
    return FakeRepo.from_dir(path, {"README.md": CARD}, **kw)


def test_ingest_pins_the_sha_and_reingest_downloads_nothing(cli: CLI, hub: HubServer, adapters: list[Path]) -> None:
    # a NUL in the metadata (PostgreSQL refuses it in text and JSON) is dropped
    hub.repos["alice/lora-a"] = repo = peft_repo(adapters[0], pipeline_tag="text-\x00generation")
    rc, [out] = cli.json_lines("ingest", "--no-embed", "hf://alice/lora-a")
    assert rc == 0 and out["status"] == "ingested", out
    assert out["revision"] == repo.head.sha and out["source"] == "hf://alice/lora-a"
    rc, [shown] = cli.json_lines("show", str(out["adapter_id"]))
    assert shown["source_revision"] == repo.head.sha and shown["source_uri"] == "hf://alice/lora-a"
    assert shown["author"] == "alice" and shown["license"] == "mit"
    assert shown["base_model"] == BASE  # the card's, where the adapter's config names none
    assert shown["name"] == "alice/lora-a"
    meta = shown["source_metadata"]
    assert meta["card_base_model"] == [BASE] and meta["base_model_relation"] == "adapter"
    assert meta["datasets"] == ["imdb"] and meta["pipeline_tag"] == "text-generation" and meta["downloads"] == 7
    assert "A tiny adapter" in row(cli, out["adapter_id"]).card
    # only what the format needs was fetched
    assert hub.count("GET", "adapter_model.safetensors") == 1 and hub.count("HEAD", "README.md") == 1
    weights_before = hub.count("GET", "/cdn/")
    rc, [again] = cli.json_lines("ingest", "--no-embed", "hf://alice/lora-a")
    assert rc == 0 and again["status"] == "duplicate" and again["adapter_id"] == out["adapter_id"]
    assert any("same revision" in n for n in again["notes"])
    assert hub.count("GET", "/cdn/") == weights_before and hub.count("GET", "/tree/") == 1


def test_new_commit_is_a_new_version_linked_to_the_old(cli: CLI, hub: HubServer, adapters: list[Path]) -> None:
    hub.repos["alice/lora-a"] = repo = peft_repo(adapters[0])
    rc, [first] = cli.json_lines("ingest", "--no-embed", "hf://alice/lora-a")
    old_sha = repo.head.sha
    new_sha = repo.commit({**FakeRepo.from_dir(adapters[1]).head.files, "README.md": CARD})
    rc, [second] = cli.json_lines("ingest", "--no-embed", "hf://alice/lora-a")
    assert rc == 0 and second["status"] == "ingested" and second["revision"] == new_sha != old_sha
    assert row(cli, second["adapter_id"]).previous_version_id == first["adapter_id"]
    rc, [lineage] = cli.json_lines("lineage", str(second["adapter_id"]))
    assert [v["id"] for v in lineage["versions"]["older"]] == [first["adapter_id"]]
    # the old commit stays reachable by its sha, and is already stored
    rc, [pinned] = cli.json_lines("ingest", "--no-embed", f"hf://alice/lora-a@{old_sha}")
    assert pinned["status"] == "duplicate" and pinned["adapter_id"] == first["adapter_id"] and pinned["revision"] == old_sha


def test_crawl_queues_every_page_and_the_worker_runs_them(cli: CLI, hub: HubServer, adapters: list[Path]) -> None:
    for i, rid in enumerate(("alice/a", "bob/b", "carol/c")):
        hub.repos[rid] = peft_repo(adapters[i])
    hub.repos["dave/gone"] = peft_repo(adapters[3], gone=True)  # listed, then 404
    hub.repos["erin/other-base"] = peft_repo(adapters[3], tags=["peft", "base_model:adapter:org/other"])
    rc, [job] = cli.json_lines("crawl", "--base-model", BASE)
    assert rc == 0 and sorted(job["sources"]) == ["hf://alice/a", "hf://bob/b", "hf://carol/c", "hf://dave/gone"]
    assert hub.count("GET", "/api/models") >= 2  # two pages of two
    rc, [only] = cli.json_lines("crawl", "--base-model", BASE, "--author", "bob", "--library", "peft", "--limit", "5")
    assert only["sources"] == ["hf://bob/b"]
    rc, [summary] = cli.json_lines("worker", "--drain", "--job", str(job["id"]))
    assert rc == 0 and summary["done"] == 3 and summary["failed"] == 1, summary
    rc, [added] = cli.json_lines("jobs", "add", "hf://alice/a", "hf://bob/b@main")  # Hub sources are queued as given
    rc, [shown] = cli.json_lines("jobs", "show", str(added["id"]))
    assert [i["source"] for i in shown["items"]] == ["hf://alice/a", "hf://bob/b@main"]
    assert cli("jobs", "add", "hf://not a repo")[0] != 0
    rc, [shown] = cli.json_lines("jobs", "show", str(job["id"]))
    [failed] = [i for i in shown["items"] if i["state"] == "failed"]
    assert failed["source"] == "hf://dave/gone" and failed["reason"].startswith("hf://dave/gone: no such repo")


class RunsCode:
    """A pickle that would run a command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_hostile_repos_fail_their_item_and_never_the_batch(
    cli: CLI, hub: HubServer, adapters: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    files = FakeRepo.from_dir(adapters[0]).head.files
    config, weights = files["adapter_config.json"], files["adapter_model.safetensors"]
    write_kohya_file(tmp_path / "style.safetensors", seed=3)
    hub.repos |= {
        "ok/peft": peft_repo(adapters[1]),
        "ok/kohya": FakeRepo.of_files({"style.safetensors": (tmp_path / "style.safetensors").read_bytes(), "README.md": CARD}),
        "ok/nested": FakeRepo.of_files({"sub/adapter_config.json": config, "sub/adapter_model.safetensors": weights}),
        "bad/huge": FakeRepo.of_files(files, declared_sizes={"adapter_model.safetensors": 5 << 30}),
        "bad/pickle": FakeRepo.of_files({"adapter_config.json": config, "adapter_model.bin": pickle.dumps({"w": RunsCode(marker)})}),
        "bad/format": FakeRepo.of_files({"adapter_config.json": config, "adapter_model.safetensors": b"\x08" + bytes(7) + b"{notjson"}),
        "bad/empty": FakeRepo.of_files({"README.md": CARD, "config.json": b"{}"}),
        "bad/gated": peft_repo(adapters[2], gated=True),
        "bad/private": peft_repo(adapters[2], private=True),
        "bad/changed": FakeRepo.of_files(files, served={"adapter_model.safetensors": weights[:-8] + b"\x00" * 8}),
        "bad/shorter": FakeRepo.of_files(files, served={"adapter_model.safetensors": weights[:-8]}),
    }
    reasons = {
        "hf://bad/huge": "over the limit",
        "hf://bad/pickle": "adapter_model.bin",
        "hf://bad/format": "adapter_model.safetensors",
        "hf://bad/empty": "no adapter to read",
        "hf://bad/gated": "gated repo",
        "hf://bad/private": "no such repo",
        "hf://bad/changed": "changed on the Hub",
        "hf://bad/shorter": "download failed",
        "hf://ok/peft@no-such-branch": "no revision 'no-such-branch'",
    }
    sources = ["hf://ok/peft", "hf://ok/kohya", "hf://ok/nested/sub", *reasons]
    rc, results = cli.json_lines("ingest", "--no-embed", *sources)
    assert rc == 1 and [r["source"].split("@")[0] for r in results] == [s.split("@")[0] for s in sources]
    by_source = dict(zip(sources, results, strict=True))
    for source in sources[:3]:
        assert by_source[source]["status"] == "ingested", by_source[source]
    for source, reason in reasons.items():
        r = by_source[source]
        assert r["status"] == "failed" and r["error"].startswith(source.split("@")[0]) and reason in r["error"], r
    assert not marker.exists()
    assert hub.count("GET", "bad--huge") == 0 and hub.count("HEAD", "bad/huge/resolve") == 0  # refused before downloading
    rc, listed = cli.json_lines("list")
    assert listed[0]["total"] == 3
    # the changed file was dropped from the cache: once the Hub serves the listed bytes, the item goes through
    hub.repos["bad/changed"].served.clear()
    rc, [fixed] = cli.json_lines("ingest", "--no-embed", "hf://bad/changed")
    assert fixed["status"] in ("ingested", "duplicate") and fixed["revision"] == hub.repos["bad/changed"].head.sha
    # with the token, the gated repo can be read
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    rc, [gated] = cli.json_lines("ingest", "--no-embed", "hf://bad/gated")
    assert gated["status"] == "ingested", gated


def test_a_malformed_source_is_a_usage_error(cli: CLI, hub: HubServer) -> None:
    for bad in ("hf://just-one", "hf://a/b/../c", "hf://a b/c", "hf://a/b@bad rev"):
        rc, _, err = cli("ingest", "--no-embed", bad)
        assert rc == 2 and bad in err


def test_a_429_storm_is_waited_out_and_an_endless_one_fails_in_bounded_time(
    cli: CLI, hub: HubServer, adapters: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.repos["alice/lora-a"] = peft_repo(adapters[0])
    hub.storm, hub.retry_after = 3, "0"
    rc, [out] = cli.json_lines("ingest", "--no-embed", "hf://alice/lora-a")
    assert rc == 0 and out["status"] == "ingested" and hub.storm == 0
    hub.repos["bob/lora-b"] = peft_repo(adapters[1])
    monkeypatch.setenv("ZOO_HUB_MAX_WAIT_S", "2")
    hub.storm, hub.retry_after = -1, "1"
    start = time.monotonic()
    rc, [out] = cli.json_lines("ingest", "--no-embed", "hf://bob/lora-b")
    assert time.monotonic() - start < 10
    assert rc == 1 and "429" in out["error"] and "ZOO_HUB_MAX_WAIT_S" in out["error"] and out["error"].startswith("hf://bob/lora-b")


@pytest.mark.slow  # a `zoo` process, importing torch
def test_offline_mode_ingests_from_the_cache(tmp_path: Path, hub: HubServer, adapters: list[Path]) -> None:
    from zoo.cli import main
    from zoo.store.session import upgrade

    hub.repos["alice/lora-a"] = repo = peft_repo(adapters[0])
    online, offline = f"sqlite:///{tmp_path / 'online.db'}", f"sqlite:///{tmp_path / 'offline.db'}"
    upgrade(online)
    upgrade(offline)
    assert main(["--db", online, "--data-dir", str(tmp_path / "d1"), "ingest", "--no-embed", "hf://alice/lora-a", "--json"]) == 0
    seen = len(hub.requests)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "zoo.cli", "--db", offline, "--data-dir", str(tmp_path / "d2"), "ingest", "--no-embed", "--json"]
    done = subprocess.run([*cmd, "hf://alice/lora-a", "hf://nobody/uncached"], env=env, capture_output=True, text=True, timeout=120)
    cached, uncached = (json.loads(line) for line in done.stdout.splitlines())
    assert cached["status"] == "ingested" and cached["revision"] == repo.head.sha, (cached, done.stderr)
    assert (
        uncached["status"] == "failed" and "HF_HUB_OFFLINE=1" in uncached["error"] and uncached["error"].startswith("hf://nobody/uncached")
    )
    assert done.returncode == 1 and len(hub.requests) == seen


def test_a_commit_pushed_after_resolving_does_not_change_what_is_downloaded(hub: HubServer, adapters: list[Path]) -> None:
    from zoo.sources import hub as source

    hub.repos["alice/lora-a"] = repo = peft_repo(adapters[0])
    resolved = source.resolve("hf://alice/lora-a")
    repo.commit(FakeRepo.from_dir(adapters[1]).head.files)
    path, origin = source.download(resolved)
    assert origin.revision == resolved.sha != repo.head.sha
    assert (path / "adapter_model.safetensors").read_bytes() == (adapters[0] / "adapter_model.safetensors").read_bytes()
