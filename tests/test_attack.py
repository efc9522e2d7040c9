"""The service attacked as issue 30 did it, each attack bounded in time, with a cheap probe (GET /api/v1/health)
asserted fast throughout: slow-loris, a 100-id predict flood, a filter flood and a wide-module upload against a real
`zoo serve`, and the bounded pool, filter caps and memory budget they rely on, unit by unit. Timing bounds are
generous (a busy 2-core CI machine): each attack made the probe time out before issue 30."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from webapp.context import BusyError, CallPool
from zoo import deadline
from zoo.deadline import TimeLimitError


def test_the_pool_refuses_past_its_queue_and_a_timed_out_call_stops() -> None:
    pool = CallPool(workers=1, queue=1, time_limit_s=0.5)
    release = threading.Event()
    steps: list[int] = []

    def loop() -> int:  # a long loop that checks its deadline, as the predict loop does
        for i in range(10_000):
            deadline.check()
            steps.append(i)
            time.sleep(0.01)
        return 0

    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(_outcome(pool, loop))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(BusyError) as busy:  # one running, one waiting: the third is refused at once
        pool.run(lambda: release.wait(5))
    assert time.monotonic() - t0 < 0.5 and busy.value.retry_after >= 1
    for t in threads:
        t.join(timeout=10)
    assert [type(r) for r in results] == [TimeLimitError, TimeLimitError]
    count = len(steps)
    time.sleep(0.3)
    assert len(steps) == count, "a timed-out call went on working"
    assert pool.running == 0
    assert pool.run(lambda: 7) == 7  # every slot came back


def _outcome(pool: CallPool, fn: object) -> object:
    try:
        return pool.run(fn)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        return exc


def test_a_filter_flood_is_refused_and_the_largest_allowed_costs_filters_not_their_square(db_url: str) -> None:
    """150 filters took 14.7 s on SQLite and gave a 500 on PostgreSQL (65,535 bind parameters): now past MAX_FILTERS
    they are a usage error (400), and the catalog's statements grow linearly with the filters they hold."""
    from sqlalchemy.dialects import postgresql

    from tests.test_catalog import catalog, synthetic_zoo
    from zoo.db.catalog import _facets_statement
    from zoo.db.repository import MAX_FILTERS, parse_filters
    from zoo.errors import UsageError

    with pytest.raises(UsageError, match="at most"):
        parse_filters([f"k{i}=v" for i in range(MAX_FILTERS + 1)])

    def params(n: int) -> int:
        filters = {"base_model": "tiny", "rank": "8", **{f"k{i}": f"v{i}" for i in range(n - 2)}}
        return len(_facets_statement("postgresql", [["alpha"]], filters).compile(dialect=postgresql.dialect()).params)

    assert params(2 * 16) < 2.5 * params(16) and params(MAX_FILTERS) < 1000  # was quadratic: 150 filters, 65,535+
    specs = synthetic_zoo(db_url)
    filters = {"task": "odd", "base_model": "tiny", **{f"k{i}": "x" for i in range(MAX_FILTERS - 3)}, "seed": "3"}
    t0 = time.perf_counter()
    found = catalog(db_url, "beta", filters)
    assert time.perf_counter() - t0 < 5 and found["total"] == 0 and len(specs) == 57
    found = catalog(db_url, None, {"task": "odd", "seed": "3", "base_model": "tiny"})
    want = [s for s in specs if s["labels"]["task"] == "odd" and s["labels"]["seed"] == "3" and s["base_model"] == "tiny"]
    assert found["total"] == len(want)


def test_a_module_wider_than_the_limit_is_refused_from_its_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8M-wide rank-1 module took a worker from 652 MB to 1.73 GB for good: now a tensor wider than
    ZOO_MAX_MODULE_WIDTH is refused, naming the file, the tensor and the limit, before any tensor is built."""
    import torch
    from safetensors.torch import save_file

    from zoo.errors import InputError
    from zoo.formats import read_adapter, safe_load

    monkeypatch.setenv("ZOO_MAX_MODULE_WIDTH", "4096")
    path = tmp_path / "wide.safetensors"
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({f"{stem}.lora_down.weight": torch.ones(1, 5000).half(), f"{stem}.lora_up.weight": torch.ones(64, 1).half()}, str(path))
    built: list[str] = []
    monkeypatch.setattr(safe_load.torch, "frombuffer", lambda *a, **k: built.append("tensor"))  # type: ignore[attr-defined]
    with pytest.raises(InputError, match=r"wide\.safetensors: tensor .*lora_down\.weight.* 5,000 wide, past the limit of 4,096"):
        read_adapter(path)
    assert not built
    monkeypatch.undo()
    monkeypatch.setenv("ZOO_MAX_MODULE_WIDTH", "8192")
    assert read_adapter(path).modules[0].shape == (64, 5000)
