"""The Hub source through the real huggingface_hub client against a local fake Hub (tests/hub_server.py):
`zoo ingest hf://...` pinned to the commit sha, re-ingests answered before any download, new commits as new
versions, `zoo crawl` into a job run by `zoo worker --drain`, hostile repos failing their item only, rate limits,
offline mode from the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from tests.hub_server import FakeRepo, HubServer
from zoo.db.models import Adapter
from zoo.db.session import session_factory

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
    hub.repos["alice/lora-a"] = repo = peft_repo(adapters[0], pipeline_tag="text-generation")
    rc, [out] = cli.json_lines("ingest", "hf://alice/lora-a")
    assert rc == 0 and out["status"] == "ingested", out
    assert out["revision"] == repo.head.sha and out["source"] == "hf://alice/lora-a"
    rc, [shown] = cli.json_lines("show", str(out["adapter_id"]))
    assert shown["source_revision"] == repo.head.sha and shown["source_uri"] == "hf://alice/lora-a"
    assert shown["author"] == "alice" and shown["license"] == "mit"
    assert shown["name"] == "alice/lora-a"
    meta = shown["source_metadata"]
    assert meta["card_base_model"] == [BASE] and meta["base_model_relation"] == "adapter"
    assert meta["datasets"] == ["imdb"] and meta["pipeline_tag"] == "text-generation" and meta["downloads"] == 7
    assert "A tiny adapter" in row(cli, out["adapter_id"]).card
    # only what the format needs was fetched
    assert hub.count("GET", "adapter_model.safetensors") == 1 and hub.count("HEAD", "README.md") == 1
    weights_before = hub.count("GET", "/cdn/")
    rc, [again] = cli.json_lines("ingest", "hf://alice/lora-a")
    assert rc == 0 and again["status"] == "duplicate" and again["adapter_id"] == out["adapter_id"]
    assert any("same revision" in n for n in again["notes"])
    assert hub.count("GET", "/cdn/") == weights_before and hub.count("GET", "/tree/") == 1
