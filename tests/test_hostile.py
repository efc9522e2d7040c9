"""Hostile and broken inputs: each is refused with the file and the reason, and leaves nothing behind
(no rows, no blob, no temporary file), on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import CLI
from tests.factories import train_peft_adapter, write_kohya_file
from zoo.sources.local import expand_paths

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "good"
    train_peft_adapter(out, seed=7, steps=2)
    return out


def rewrite_header(path: Path, change: Callable[[dict], None]) -> None:
    """Rewrite a safetensors file's JSON header in place, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def leftovers(cli: CLI) -> list[Path]:
    data = cli.settings.data_dir
    return sorted(p for p in data.rglob("*") if p.is_file() and p.suffix != ".db" and "zoo.db" not in p.name) if data.exists() else []


def refuse(cli: CLI, source: Path, reason: str) -> dict:
    """Ingest `source`; it must fail with `reason` and the file named, write nothing and leave nothing behind."""
    rc, results = cli.json_lines("ingest", "--no-embed", str(source), "--base-model", "tiny")
    assert rc == 1 and len(results) == 1, results
    (r,) = results
    assert r["status"] == "failed" and reason in r["error"] and str(source) in r["error"], r
    rc, (listing,) = cli.json_lines("list")
    assert listing["total"] == 0, listing
    assert leftovers(cli) == []
    return r


def peft_copy(peft_dir: Path, tmp_path: Path, name: str = "bad") -> Path:
    out = tmp_path / name
    shutil.copytree(peft_dir, out)
    return out


def zipped(peft_dir: Path, out: Path, prefix: str = "", extra: int = 0) -> Path:
    """The PEFT directory as a zip, its members under `prefix`, with `extra` small files beside them."""
    with zipfile.ZipFile(out, "w") as zf:
        for name in ("adapter_config.json", WEIGHTS):
            zf.write(peft_dir / name, prefix + name)
        for i in range(extra):
            zf.writestr(f"notes/{i}.txt", "x")
    return out


def edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "adapter_config.json").read_text())
    cfg.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensors(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(directory / WEIGHTS))
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS))


CONFIG_CASES = [
    ({"r": "four"}, "r must be a positive finite number"),
    ({"r": None}, "rank mismatch"),  # r defaults to 8, the tensors have rank 4
    ({"lora_alpha": [1]}, "lora_alpha must be a finite number"),
    ({"rank_pattern": {"([": 4}}, "is not a valid regex"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must map module-name patterns"),
    ({"alpha_pattern": {"q_proj": -1}}, "alpha_pattern must be a positive finite number"),
    ({"base_model_name_or_path": "b" * 300}, "base model name of 300 characters"),
    ({"task_type": "t" * 80}, "task_type must be a string of at most 64"),
]


@pytest.mark.parametrize(("changes", "reason"), CONFIG_CASES, ids=[c[1][:30] for c in CONFIG_CASES])
def test_hostile_configs_are_refused(cli: CLI, peft_dir: Path, tmp_path: Path, changes: dict, reason: str) -> None:
    bad = peft_copy(peft_dir, tmp_path)
    edit_config(bad, **changes)
    if "base_model_name_or_path" in changes:  # the file's own base model, not --base-model
        rc, (r,) = cli.json_lines("ingest", "--no-embed", str(bad))
        assert rc == 1 and r["status"] == "failed" and reason in r["error"]
        assert leftovers(cli) == []
        return
    refuse(cli, bad, reason)


def test_a_backtracking_rank_pattern_is_refused_in_bounded_time(cli: CLI, peft_dir: Path, tmp_path: Path) -> None:
    bad = peft_copy(peft_dir, tmp_path)
    name = "base_model.model." + "a" * 40 + "!"
    edit_tensors(bad, lambda t: t.update({f"{name}.lora_A.weight": torch.randn(4, 16), f"{name}.lora_B.weight": torch.randn(16, 4)}))
    edit_config(bad, rank_pattern={"(a|aa)+": 4})
    refuse(cli, bad, "takes too long to match")


def test_hostile_tensors_are_refused(cli: CLI, peft_dir: Path, tmp_path: Path) -> None:
    cases: list[tuple[Callable[[dict[str, torch.Tensor]], None], str]] = [
        (lambda t: t.update({next(k for k in t if "lora_A" in k): torch.tensor(1.0)}), "factors must be matrices"),
        (lambda t: t.update({"base_model.model." + "m" * 600 + ".lora_A.weight": torch.randn(4, 16),
                             "base_model.model." + "m" * 600 + ".lora_B.weight": torch.randn(16, 4)}), "longer than 512"),
        (lambda t: t.update({"base_model.model.layers.0." + "t" * 200 + ".lora_A.weight": torch.randn(4, 16),
                             "base_model.model.layers.0." + "t" * 200 + ".lora_B.weight": torch.randn(16, 4)}),
         "type name longer than 128"),
        (lambda t: t.update({"base_model.model.layers.99999999999.q_proj.lora_A.weight": torch.randn(4, 16),
                             "base_model.model.layers.99999999999.q_proj.lora_B.weight": torch.randn(16, 4)}), "claims layer"),
        (lambda t: t.update({next(k for k in t if "lora_B" in k): torch.full((16, 4), float("nan"))}), "contains NaN or Inf"),
    ]  # fmt: skip
    for i, (change, reason) in enumerate(cases):
        bad = peft_copy(peft_dir, tmp_path, f"bad{i}")
        edit_tensors(bad, change)
        refuse(cli, bad, reason)


def test_hostile_safetensors_headers_are_refused(cli: CLI, tmp_path: Path) -> None:
    def first_tensor(h: dict) -> dict:
        return h[next(k for k in h if k != "__metadata__")]

    cases: list[tuple[Callable[[dict], None], str]] = [
        (lambda h: first_tensor(h).update(data_offsets=None), "no valid data_offsets"),
        (lambda h: first_tensor(h).update(shape=[2**20, 2**20]), "does not fill"),
        (lambda h: first_tensor(h).update(dtype="F4096"), "unknown dtype"),
        (lambda h: first_tensor(h).update(shape="big"), "no valid shape"),
        (lambda h: first_tensor(h).update(data_offsets=[0, 10**12]), "truncated"),
        (lambda h: h.update(__metadata__={"a": 1}), "__metadata__"),
    ]
    for i, (change, reason) in enumerate(cases):
        path = tmp_path / f"k{i}.safetensors"
        write_kohya_file(path, seed=i)
        rewrite_header(path, change)
        refuse(cli, path, reason)


def test_hostile_kohya_files_are_refused(cli: CLI, tmp_path: Path) -> None:
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    cases: list[tuple[dict[str, torch.Tensor], str]] = [
        ({f"{stem}.alpha": torch.zeros(0)}, "must hold one number"),
        ({f"{stem}.alpha": torch.tensor(-2.0)}, "must be a finite number ≥ 0"),
        # a tiny file that claims a huge rank: 60,000 components of a 1×1 update
        ({f"{stem}.lora_down.weight": torch.randn(60_000, 1), f"{stem}.lora_up.weight": torch.randn(1, 60_000)}, "exceeds the limit"),
        ({f"{stem}.lora_down.weight": torch.randn(3, 2), f"{stem}.lora_up.weight": torch.randn(1, 3)}, "exceeds both sides"),
        ({f"m{i}.lora_down.weight": torch.ones(1, 2) for i in range(4100)}
         | {f"m{i}.lora_up.weight": torch.ones(2, 1) for i in range(4100)}, "4102 modules exceed the limit of 4096"),
    ]  # fmt: skip
    for i, (tensors, reason) in enumerate(cases):
        path = tmp_path / f"k{i}.safetensors"
        good = write_kohya_file(tmp_path / f"base{i}.safetensors", seed=i, conv=False)
        save_file({**good, **tensors}, str(path), metadata={"ss_sd_model_name": "sd"})
        (tmp_path / f"base{i}.safetensors").unlink()
        refuse(cli, path, reason)


def test_pickles_with_code_sizes_and_unexpected_errors(cli: CLI, peft_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a .bin pickle that would run a command when unpickled
    bad = peft_copy(peft_dir, tmp_path, "pickle")
    (bad / WEIGHTS).unlink()

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"x": Evil()}, str(bad / "adapter_model.bin"), _use_new_zipfile_serialization=True)
    refuse(cli, bad, "not a weights-only torch file")
    assert not (tmp_path / "pwned").exists()
    # a file over the size cap
    monkeypatch.setenv("ZOO_MAX_FILE_BYTES", "100")
    refuse(cli, peft_copy(peft_dir, tmp_path, "big"), "exceeds the limit of 100 bytes")
    refuse(cli, zipped(peft_dir, tmp_path / "big.zip"), "exceeds the limit of 100 bytes")  # zipped: the same limit, before reading
    monkeypatch.delenv("ZOO_MAX_FILE_BYTES")
    # zips that are not one PEFT directory: parent paths, too many members, a truncated archive
    refuse(cli, zipped(peft_dir, tmp_path / "up.zip", prefix="../"), "unsafe member")
    refuse(cli, zipped(peft_dir, tmp_path / "many.zip", extra=20), "a zip of 22 files")
    (tmp_path / "cut.zip").write_bytes(zipped(peft_dir, tmp_path / "whole.zip").read_bytes()[:-64])
    refuse(cli, tmp_path / "cut.zip", "not a readable zip")
    # an exception type nothing anticipates, raised inside the math by the library: a failed item named
    # with the type, the batch goes on, and the exit status is 1
    real_qr = torch.linalg.qr

    def flaky_qr(*args, **kwargs):  # type: ignore[no-untyped-def]
        if flaky_qr.calls == 0:  # type: ignore[attr-defined]
            flaky_qr.calls += 1  # type: ignore[attr-defined]
            raise KeyError("surprise")
        return real_qr(*args, **kwargs)

    flaky_qr.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.linalg, "qr", flaky_qr)
    both = tmp_path / "both"
    shutil.copytree(peft_dir, both / "a")
    train_peft_adapter(both / "b", seed=8, steps=2)
    rc, results = cli.json_lines("ingest", "--no-embed", str(both), "--base-model", "tiny")
    assert rc == 1 and [r["status"] for r in results] == ["failed", "ingested"]
    assert "KeyError" in results[0]["error"] and str(both / "a") in results[0]["error"]


def test_shapes_that_conflict_with_the_space_are_refused(cli: CLI, peft_dir: Path, tmp_path: Path) -> None:
    rc, _ = cli.json_lines("ingest", str(peft_dir), "--base-model", "tiny")  # and embedded
    assert rc == 0
    bad = peft_copy(peft_dir, tmp_path)
    name = next(k for k in load_file(str(bad / WEIGHTS)) if k.endswith("q_proj.lora_A.weight"))
    edit_tensors(bad, lambda t: t.update({name: torch.randn(4, 32)}))
    rc, (r,) = cli.json_lines("ingest", "--no-embed", str(bad), "--base-model", "tiny")
    assert rc == 1 and r["status"] == "failed" and "in the space of base model 'tiny'" in r["error"]
    rc, (listed,) = cli.json_lines("list")
    assert listed["total"] == 1
    rc, (reports,) = cli.json_lines("embed")  # the space still embeds
    assert rc == 0


def test_symlink_loops_are_searched_once(tmp_path: Path, peft_dir: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(peft_dir, root / "a" / "adapter")
    (root / "a" / "loop").symlink_to(root)
    (root / "self").symlink_to(root / "a")
    found = expand_paths([root])
    assert [p for p, _ in found] == [root / "a" / "adapter"]


def test_labels_match_by_relative_path_and_ambiguous_names_are_refused(cli: CLI, peft_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "zoo"
    shutil.copytree(peft_dir, root / "a" / "x")
    train_peft_adapter(root / "b" / "x", seed=9, steps=2)
    (tmp_path / "bare.csv").write_text("name,task\nx,t1\n")
    rc, _, err = cli("ingest", "--no-embed", str(root), "--labels", str(tmp_path / "bare.csv"), "--base-model", "tiny")
    assert rc == 2 and "matches 2 sources" in err and "relative path" in err
    assert leftovers(cli) == []
    (tmp_path / "paths.csv").write_text("name,task\na/x,t1\nb/x,t2\n")
    rc, results = cli.json_lines("ingest", "--no-embed", str(root), "--labels", str(tmp_path / "paths.csv"), "--base-model", "tiny")
    assert rc == 0 and [r["status"] for r in results] == ["ingested", "ingested"]
    tasks = {}
    for r in results:
        rc, (shown,) = cli.json_lines("show", str(r["adapter_id"]))
        tasks[r["source"]] = shown["labels"]["task"]
    assert tasks == {str(root / "a" / "x"): "t1", str(root / "b" / "x"): "t2"}
