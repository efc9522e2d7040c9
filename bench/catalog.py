"""Benchmark: the catalog (search page, GET /api/v1/adapters) at a million adapters on PostgreSQL (or SQLite: --db sqlite:///FILE).

Builds (once, kept in its database) a synthetic catalog in SQL: N adapters over 5 base models, 3 formats, 4
ranks, 500 authors and source directories, each with given labels `task` (50 values), `seed` (1,000) and, for
two in three, `style` (12), and its search document. Then times `search_catalog` in process, as the search page
and the API call it, in three cases: a text query with facets, unfiltered facets (the search page's first view),
and 5 filters (a base model, a format, two labels and a source prefix), p50 and p99 over --repeats runs each, and
says whether facet counts were approximate (zoo/store/catalog.py: facet_exact_rows, FACET_TIMEOUT_MS). `semantic`:
a search by meaning (embed/serving/text_search.py: the sentence encoder, full text and the FAISS text index fused, facets of
the ranked adapters; the catalog has no embedding space, so no expansion through the weights), after its text index
is built once under --data-dir (timed apart: `text_index_build_s`). --cases picks the cases.

    python -m bench.catalog --db postgresql://postgres@127.0.0.1:5432/zoo_bench_catalog --adapters 1000000

Prints a table and, on the last line, one JSON object. Run it on an idle machine: its figures are wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

BASES = ("llama-3-8b", "mistral-7b", "sdxl", "vit-b-16", "qwen2-7b")
FORMATS = ("peft", "kohya", "diffusers")
STYLES = ("anime", "pixel art", "ink", "watercolor", "photo", "3d", "sketch", "oil", "noir", "pastel", "comic", "retro")


def build(url: str, n: int) -> float:
    """The synthetic catalog in a migrated database (kept: rebuilt only when it holds another count). Seconds."""
    from zoo.store.session import make_engine, upgrade

    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        have = conn.execute(text("SELECT count(*) FROM adapter")).scalar_one()
    if have == n:
        return 0.0
    t0 = time.perf_counter()
    if engine.dialect.name == "sqlite":
        _build_sqlite(engine, n)
        engine.dispose()
        return time.perf_counter() - t0
    bases = "ARRAY[" + ",".join(f"'{b}'" for b in BASES) + "]"
    formats = "ARRAY[" + ",".join(f"'{f}'" for f in FORMATS) + "]"
    styles = "ARRAY[" + ",".join(f"'{s}'" for s in STYLES) + "]"
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE adapter RESTART IDENTITY CASCADE"))
        conn.execute(
            text(
                f"""
                INSERT INTO adapter (name, source_uri, source_metadata, base_model, format, rank, canonical_hash, structure_hash,
                                     file_sha256, size_bytes, config, file_metadata, extra_tensors, notes, tags, author, license,
                                     created_at)
                SELECT 'bench-' || i, 'hf://org' || (i % 500) || '/bench-' || i,
                       json_build_object('pipeline_tag', CASE WHEN i % 5 = 2 THEN 'text-to-image' ELSE 'text-generation' END),
                       ({bases})[1 + i % 5], ({formats})[1 + (i / 5) % 3], (ARRAY[4, 8, 16, 64])[1 + (i / 15) % 4],
                       md5(i::text) || md5('c' || i), md5('s' || i) || md5('t' || i), md5('f' || i) || md5('g' || i), 1000 + i,
                       '{{}}', '{{}}', '{{}}', '[]', '["lora"]', 'org' || (i % 500), CASE WHEN i % 2 = 0 THEN 'mit' ELSE 'apache-2.0' END,
                       timestamptz '2024-01-01' + i * interval '1 second'
                FROM generate_series(1, :n) AS i
                """
            ),
            {"n": n},
        )
        conn.execute(
            text(
                f"""
                INSERT INTO label (adapter_id, key, value, source)
                SELECT id, 'task', 'task' || ((id * 7) % 50), 'given' FROM adapter
                UNION ALL SELECT id, 'seed', (id % 1000)::text, 'given' FROM adapter
                UNION ALL SELECT id, 'style', ({styles})[1 + id % 12], 'given' FROM adapter WHERE id % 3 <> 0
                """
            )
        )
        conn.execute(
            text(
                """
                INSERT INTO adapter_text (adapter_id, document)
                SELECT a.id, concat_ws(' ', 'bench', a.id, replace(a.base_model, '-', ' '), a.format,
                                       string_agg(l.key || ' ' || l.value, ' ' ORDER BY l.key), 'lora author', a.author,
                                       'hf org' || (a.id % 500), 'bench', a.id)
                FROM adapter a JOIN label l ON l.adapter_id = a.id GROUP BY a.id
                """
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return time.perf_counter() - t0


def _build_sqlite(engine: Engine, n: int) -> None:
    """The same catalog on SQLite (its documents indexed by the FTS5 table's triggers)."""
    bases, formats, styles = (json.dumps(list(v)) for v in (BASES, FORMATS, STYLES))
    with engine.begin() as conn:
        for table in ("adapter_text", "label", "adapter"):
            conn.execute(text(f"DELETE FROM {table}"))
        conn.execute(
            text(
                f"""
                WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < :n)
                INSERT INTO adapter (id, name, source_uri, source_metadata, base_model, format, rank, canonical_hash, structure_hash,
                                     file_sha256, size_bytes, config, file_metadata, extra_tensors, notes, tags, author, license,
                                     created_at)
                SELECT i, 'bench-' || i, 'hf://org' || (i % 500) || '/bench-' || i,
                       json_object('pipeline_tag', CASE WHEN i % 5 = 2 THEN 'text-to-image' ELSE 'text-generation' END),
                       json_extract('{bases}', '$[' || (i % 5) || ']'), json_extract('{formats}', '$[' || ((i / 5) % 3) || ']'),
                       json_extract('[4, 8, 16, 64]', '$[' || ((i / 15) % 4) || ']'),
                       printf('%064d', i), printf('s%063d', i), printf('f%063d', i), 1000 + i,
                       '{{}}', '{{}}', '{{}}', '[]', '["lora"]', 'org' || (i % 500), CASE WHEN i % 2 = 0 THEN 'mit' ELSE 'apache-2.0' END,
                       datetime('2024-01-01', '+' || i || ' seconds')
                FROM s
                """
            ),
            {"n": n},
        )
        conn.execute(
            text(
                f"""
                INSERT INTO label (adapter_id, key, value, source)
                SELECT id, 'task', 'task' || ((id * 7) % 50), 'given' FROM adapter
                UNION ALL SELECT id, 'seed', CAST(id % 1000 AS TEXT), 'given' FROM adapter
                UNION ALL SELECT id, 'style', json_extract('{styles}', '$[' || (id % 12) || ']'), 'given' FROM adapter WHERE id % 3 <> 0
                """
            )
        )
        conn.execute(
            text(
                """
                INSERT INTO adapter_text (adapter_id, document)
                SELECT a.id, 'bench ' || a.id || ' ' || replace(a.base_model, '-', ' ') || ' ' || a.format || ' '
                             || group_concat(l.key || ' ' || l.value, ' ') || ' lora author ' || a.author || ' hf org' || (a.id % 500)
                             || ' bench ' || a.id
                FROM adapter a JOIN label l ON l.adapter_id = a.id GROUP BY a.id
                """
            )
        )
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))


def percentile(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] * 1e3


def _filters_of(i: int) -> dict[str, str]:
    """Five filters that adapter i (and others like it) matches: base model, format, task, style, source directory."""
    i = i if i % 3 else i + 1  # adapters with a style
    return {
        "base_model": BASES[i % 5],
        "format": FORMATS[(i // 5) % 3],
        "task": f"task{(i * 7) % 50}",
        "style": STYLES[i % 12],
        "source": f"hf://org{i % 500}/",
    }


#: descriptions a search by meaning is timed with
SENTENCES = (
    "watercolor paintings of landscapes",
    "pixel art sprites for a retro game",
    "anime style characters",
    "black ink drawings",
    "noir film look in task 7",
    "photographs of 3d renders",
)
CASES = ("text_and_facets", "unfiltered_facets", "five_filters", "semantic")


def measure(url: str, repeats: int, seed: int = 0, data_dir: str | None = None, which: tuple[str, ...] = CASES) -> dict[str, object]:
    """p50/p99 milliseconds of search_catalog per case (and search_by_meaning for `semantic`), and whether its facets
    were approximate."""
    from zoo.store.catalog import search_catalog
    from zoo.store.session import session_factory

    sessions = session_factory(url)
    rng = random.Random(seed)
    out: dict[str, object] = {}
    search: Callable[[Session, str | None, dict[str, str]], Mapping[str, object]] = search_catalog
    by_meaning = search
    if "semantic" in which:
        from embed.serving import text_index, text_search
        from embed.serving.engine import QueryEngine
        from zoo.store.blobs import BlobStore

        assert data_dir, "the semantic case needs --data-dir"
        engine = QueryEngine(sessions, BlobStore(Path(data_dir) / "blobs"), Path(data_dir))
        with sessions() as session:
            t = time.perf_counter()
            text_index.current_index(session, engine)
            out["text_index_build_s"] = round(time.perf_counter() - t, 1)
            text_index.encode(["warm up"])

        def by_meaning(session: Session, q: str | None, filters: dict[str, str]) -> Mapping[str, object]:
            text_index.query_vector.cache_clear()  # each query encoded: not a page of an earlier one
            return text_search.search_by_meaning(session, engine, q, filters)

        with sessions() as session:  # a served process's first search (statements compiled, pages read) is not timed
            by_meaning(session, "warm up", {})

    cases = {
        # words matching 1 in 5 adapters (llama), 1 in 12 (pixel art), 1 in 50 (task7), 1 in 500 (org12), a handful
        "text_and_facets": lambda: (rng.choice(["llama", "pixel art", "task7", "org12", "bench 4242", "watercolor task3"]), {}),
        "unfiltered_facets": lambda: (None, {}),
        "five_filters": lambda: (None, _filters_of(rng.randrange(1, 1_000_000))),
        "semantic": lambda: (rng.choice(SENTENCES), {}),
    }
    for name, make in cases.items():
        if name not in which:
            continue
        times, approximate = [], 0
        for _ in range(repeats):
            q, filters = make()
            with sessions() as session:
                t = time.perf_counter()
                found = (by_meaning if name == "semantic" else search)(session, q, filters)
                times.append(time.perf_counter() - t)
            approximate += bool(found.get("approximate"))
        out[name] = {"p50_ms": round(percentile(times, 50), 1), "p99_ms": round(percentile(times, 99), 1), "approximate": approximate}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default=os.environ.get("ZOO_BENCH_CATALOG_URL", "postgresql://postgres@127.0.0.1:5432/zoo_bench_catalog"))
    p.add_argument("--adapters", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--data-dir", default="/tmp/zoo_bench_catalog_data", help="where the semantic case's text index is written")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = p.parse_args()
    which = tuple(c for c in args.cases.split(",") if c)
    from sqlalchemy.engine import make_url

    from zoo.store.session import make_engine

    url = make_url(args.db)
    if url.get_backend_name() == "postgresql":
        admin = make_engine(url.set(database="postgres").render_as_string(hide_password=False))
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if not conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": url.database}).first():
                conn.execute(text(f'CREATE DATABASE "{url.database}"'))
        admin.dispose()
    built_s = build(args.db, args.adapters)
    load = os.getloadavg()[0]
    result = {
        "adapters": args.adapters,
        "build_s": round(built_s, 1),
        "load_1min": round(load, 2),
        **measure(args.db, args.repeats, data_dir=args.data_dir, which=which),
    }
    for name in which:
        r = result[name]
        print(f"{name:18s} p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  approximate {r['approximate']}/{args.repeats}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
