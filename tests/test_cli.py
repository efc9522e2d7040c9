"""The `zoo` command end to end: init, ingest (JSON lines, exit codes), list, show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import CLI
from tests.factories import train_peft_adapter, write_kohya_file
from zoo.cli import main


def test_ingest_list_show(cli: CLI, tmp_path: Path) -> None:
    zoo_dir = tmp_path / "zoo"
    train_peft_adapter(zoo_dir / "a", seed=0)
    train_peft_adapter(zoo_dir / "nested" / "b", seed=1)
    write_kohya_file(zoo_dir / "k.safetensors")
    rc, results = cli.json_lines("ingest", "--no-embed", str(zoo_dir), "--base-model", "tiny-lm")
    assert rc == 0
    assert [r["status"] for r in results] == ["ingested"] * 3
    assert {Path(r["source"]).name for r in results} == {"a", "b", "k.safetensors"}
    assert all(set(r) >= {"source", "status", "adapter_id", "canonical_hash", "error"} for r in results)

    rc, (listing,) = cli.json_lines("list")
    assert rc == 0 and [a["name"] for a in listing["results"]] == ["b", "k", "a"]  # newest first
    rc, (shown,) = cli.json_lines("show", str(results[0]["adapter_id"]))
    assert rc == 0
    assert shown["canonical_hash"] == results[0]["canonical_hash"]
    assert shown["base_model"] == "tiny-lm"
    assert len(shown["modules"]) == 4 and all(m["singular_values"] for m in shown["modules"])

    rc, out, _ = cli("show", str(results[0]["adapter_id"]), "--plot", str(tmp_path / "s.png"))
    assert rc == 0 and "layers.0.q_proj" in out and "canonical_hash" in out
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, _ = cli("list")
    assert rc == 0 and "tiny-lm" in out


def test_batch_goes_on_past_failures_and_exits_1(cli: CLI, tmp_path: Path) -> None:
    train_peft_adapter(tmp_path / "good")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 3)
    rc, results = cli.json_lines(
        "ingest", "--no-embed", str(tmp_path / "bad.safetensors"), str(tmp_path / "missing"), str(tmp_path / "good")
    )
    assert rc == 1
    assert [r["status"] for r in results] == ["failed", "failed", "ingested"]
    assert results[0]["error"].startswith(str(tmp_path / "bad.safetensors"))
    rc, out, _ = cli("ingest", "--no-embed", str(tmp_path / "good"), str(tmp_path / "missing"))
    assert rc == 1
    assert "0 ingested, 1 duplicate, 1 failed" in out and "missing: no such file or directory" in out


def test_commands_refuse_an_uninitialized_database(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["--db", f"sqlite:///{tmp_path / 'fresh.db'}", "--data-dir", str(tmp_path), "list"])
    assert rc == 2
    assert "run `zoo init`" in capsys.readouterr().err


def test_init_then_show_missing_adapter(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "home"))
    monkeypatch.delenv("ZOO_DATABASE_URL", raising=False)
    assert main(["init"]) == 0
    assert (tmp_path / "home" / "zoo.db").exists()
    assert main(["init"]) == 0  # idempotent
    assert main(["show", "99"]) == 2
    assert "no adapter with id 99" in capsys.readouterr().err


def test_help_runs_as_a_command() -> None:
    out = subprocess.run([sys.executable, "-m", "zoo.cli", "ingest", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--base-model" in out and "--json" in out


def test_unreachable_database_is_a_clear_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["--db", "postgresql://nobody:s3cret-pw@127.0.0.1:1/none", "--data-dir", str(tmp_path), "list"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot use the database" in err and "ZOO_DATABASE_URL" in err
    assert "s3cret-pw" not in err and "nobody:***@127.0.0.1:1/none" in err  # the password is never printed
