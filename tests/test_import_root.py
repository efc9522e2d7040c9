"""ZOO_IMPORT_ROOT: every file walked under the import root resolves inside it. A symlink inside
the root to a file or directory outside it (or a PEFT directory holding one) is refused with its reason, never walked
or read: when the job is made, and again when a worker reads the item (a link swapped in since)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.factories import write_kohya_file, write_random_peft_adapters
from webapp import create_app
from zoo.runners.worker import WorkerOptions, work
from zoo.sources.local import expand_paths, expand_under
from zoo.store.jobs import create_job
from zoo.store.session import session_factory


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """root/zoo holds one adapter of its own (a), and links out: a directory (away), a weight file (file.safetensors),
    a PEFT directory whose weights are a link (b); and a link back inside (again -> a), which is fine."""
    base = tmp_path_factory.mktemp("import-root")
    root, outside = base / "root", base / "outside"
    a, far, b_src = write_random_peft_adapters(base / "made", 3, seed=5)
    shutil.copytree(a, root / "zoo" / "a")
    shutil.copytree(far, outside / "secret")
    write_kohya_file(outside / "loose.safetensors", seed=3)
    (root / "zoo" / "away").symlink_to(outside, target_is_directory=True)
    (root / "zoo" / "file.safetensors").symlink_to(outside / "loose.safetensors")
    (root / "zoo" / "b").mkdir()
    shutil.copy(b_src / "adapter_config.json", root / "zoo" / "b")
    shutil.copy(b_src / "adapter_model.safetensors", outside / "b_weights.safetensors")
    (root / "zoo" / "b" / "adapter_model.safetensors").symlink_to(outside / "b_weights.safetensors")
    (root / "zoo" / "inner").mkdir()
    (root / "zoo" / "inner" / "again").symlink_to(root / "zoo" / "a", target_is_directory=True)
    return root.resolve(), outside.resolve()


def test_a_walk_under_the_root_never_leaves_it(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    found, refused = expand_under(root, [root / "zoo"])
    assert [p for p, _ in found] == [root / "zoo" / "a", root / "zoo" / "inner" / "again"]
    assert all(p.resolve().is_relative_to(root) for p, _ in found)
    assert sorted(p.name for p, _ in refused) == ["away", "b", "file.safetensors"]
    reasons = dict((p.name, r) for p, r in refused)
    assert all("outside the import root" in r for r in reasons.values())
    assert "adapter_model.safetensors" in reasons["b"] and str(outside) not in " ".join(reasons.values())  # the target is not told
    assert expand_paths([root / "zoo"], root) == found
    # a named link out is refused too; without a root (the operator's own `zoo ingest`), links are followed as before
    assert [p.name for p, _ in expand_under(root, [root / "zoo" / "away"])[1]] == ["away"]
    assert (root / "zoo" / "away" / "secret") in [p for p, _ in expand_paths([root / "zoo"])]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_worker_checks_the_item_again_when_it_reads_it(tree: tuple[Path, Path], db_url: str, tmp_path: Path) -> None:
    root, outside = tree
    swapped = tmp_path / "root"
    shutil.copytree(root / "zoo" / "a", swapped / "x")
    sessions = session_factory(db_url)
    with sessions.begin() as session:
        job = create_job(session, [str(swapped / "x")], {"base_model": "tiny", "import_root": str(swapped)})
        job_id = job.id
    shutil.rmtree(swapped / "x")
    (swapped / "x").symlink_to(outside / "secret", target_is_directory=True)  # after the job was made
    from zoo.config import Settings

    settings = Settings(data_dir=tmp_path / "data", database_url=db_url)
    (outcome,) = [o for o in work(settings, WorkerOptions(job_id=job_id, drain=True), threading.Event()) if o is not None]
    assert outcome.state == "failed" and "outside the import root" in (outcome.reason or "") and outcome.adapter_id is None
    from sqlalchemy import func, select

    from zoo.store.models import Adapter

    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Adapter)) == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_post_ingest_of_a_tree_with_links_out_ingests_only_what_is_inside(tree: tuple[Path, Path], db_url: str, tmp_path: Path) -> None:
    root, _ = tree
    app = create_app({"ZOO_DATABASE_URL": db_url, "ZOO_DATA_DIR": str(tmp_path / "data"), "ZOO_IMPORT_ROOT": str(root), "TESTING": True})
    from zoo.store import tokens

    with session_factory(db_url).begin() as session:
        _, token = tokens.create_token(session, "roots", "write")
    client = app.test_client()
    r = client.post("/api/v1/ingest", json={"paths": ["zoo"], "base_model": "tiny"}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 202, r.json
    for _ in range(400):
        job = client.get(f"/api/v1/jobs/{r.json['id']}").json
        if job["state"] == "done":
            break
        time.sleep(0.05)
    states = {Path(i["source"]).name: (i["state"], i.get("reason") or "") for i in job["items"]}
    assert job["state"] == "done", job
    assert {k: s for k, (s, _) in states.items()} == {
        "a": "done",
        "again": "duplicate",
        "away": "failed",
        "b": "failed",
        "file.safetensors": "failed",
    }
    assert all("outside the import root" in states[k][1] for k in ("away", "b", "file.safetensors"))
    listed = client.get("/api/v1/adapters").json
    assert listed["total"] == 1
