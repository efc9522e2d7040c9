"""The schema comes from the migrations, matches the models, and migrates both ways."""

from __future__ import annotations

import ast
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from zoo.store.models import Adapter, Base, on_dialect
from zoo.store.search_text import search_document
from zoo.store.session import current_revision, downgrade, head_revision, make_engine, session_factory, upgrade


def test_models_match_migrations(db_url: str) -> None:
    with make_engine(db_url).connect() as conn:
        opts = {"compare_type": True, "include_object": on_dialect(conn.dialect.name)}
        diffs = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    assert diffs == []


def test_downgrade_and_upgrade(db_url: str) -> None:
    assert current_revision(db_url) == head_revision(db_url)
    downgrade(db_url, "base")
    assert "adapter" not in inspect(make_engine(db_url)).get_table_names()
    upgrade(db_url)
    assert {"adapter", "module"} <= set(inspect(make_engine(db_url)).get_table_names())


def test_upgrade_keeps_rows_of_tables_it_rebuilds(db_url: str) -> None:
    """SQLite rebuilds a table to alter it: with foreign keys on, dropping the old copy would delete its children."""
    downgrade(db_url, "0007")
    with make_engine(db_url).begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO adapter (id, name, source_uri, base_model, format, canonical_hash, structure_hash, file_sha256, size_bytes,"
            " config, file_metadata, extra_tensors, notes) VALUES (1, 'a', '/a', 'b', 'peft', 'h', 's', 'f', 1, '{}', '{}', '{}', '[]')"
        )
        conn.exec_driver_sql(
            "INSERT INTO module (adapter_id, name, module_type, kind, out_features, in_features, transposed, singular_values,"
            " spectral_norm, frobenius_norm, stable_rank, effective_rank) VALUES (1, 'm', 'q', 'linear', 2, 2, false, '[1.0]', 1, 1, 1, 1)"
        )
        conn.exec_driver_sql("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'task', 't', 'given')")
    upgrade(db_url)
    with make_engine(db_url).connect() as conn:
        counts = [conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() for t in ("adapter", "module", "label")]
    assert counts == [1, 1, 1]


def test_0010_adds_probe_values_and_takes_them_away(db_url: str) -> None:
    """Adapters stored before 0010 keep their rows with no probe values (their factors are read when they are
    near-duplicate candidates); new values round-trip; the downgrade drops the column and keeps the rows."""

    def columns() -> set[str]:
        return {c["name"] for c in inspect(make_engine(db_url)).get_columns("adapter")}

    downgrade(db_url, "0009")
    assert "dw_probes" not in columns()
    with make_engine(db_url).begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO adapter (id, name, source_uri, base_model, format, canonical_hash, structure_hash, file_sha256, size_bytes,"
            " config, file_metadata, extra_tensors, notes) VALUES (1, 'a', '/a', 'b', 'peft', 'h', 's', 'f', 1, '{}', '{}', '{}', '[]')"
        )
    upgrade(db_url)
    assert "dw_probes" in columns()
    raw = [0.1, -2.5e-300, 3.0, 1e300, -0.0, 5.0, 6.0, 7.125]
    with session_factory(db_url)() as s, s.begin():
        assert s.get(Adapter, 1).dw_probes is None
        s.add(Adapter(id=2, name="b", source_uri="/b", base_model="b", format="peft", canonical_hash="h2", structure_hash="s",
                      file_sha256="f2", size_bytes=1, dw_probes=raw))  # fmt: skip
    with session_factory(db_url)() as s:
        assert s.get(Adapter, 2).dw_probes == raw
    downgrade(db_url, "0009")
    assert "dw_probes" not in columns()
    with make_engine(db_url).connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM adapter").scalar() == 2
    upgrade(db_url)


def test_migrations_import_nothing_live() -> None:
    """An old migration never changes when live code does: no file in migrations/versions imports zoo, embed or webapp;
    what one needs of the code of its day is copied into it."""
    versions = Path(__file__).resolve().parents[1] / "migrations" / "versions"
    files = sorted(versions.glob("*.py"))
    assert len(files) > 10
    live = {"zoo", "embed", "webapp"}
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}: {name}" for name in names if name.split(".")[0] in live]
    assert found == []


def test_0005_backfills_search_documents(db_url: str) -> None:
    """Adapters stored before 0005 get the search document of their name, base model, format, given labels, tags, source
    URI and card: the live document of the same fields (its author and source metadata came with 0008)."""
    downgrade(db_url, "0004")
    with make_engine(db_url).begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO adapter (id, name, source_uri, base_model, format, canonical_hash, structure_hash, file_sha256, size_bytes,"
            " config, file_metadata, extra_tensors, notes, tags, card) VALUES (1, 'Digits-ViT_00012', '/zoo/a', 'org/Base-1', 'peft',"
            " 'h', 's', 'f', 1, '{}', '{}', '{}', '[]', '[\"Café\", \"x-y\"]', 'A card: naïve')"
        )
        conn.exec_driver_sql("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'task', 'even', 'given')")
        conn.exec_driver_sql("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'task', 'odd', 'predicted')")
    upgrade(db_url)
    with make_engine(db_url).connect() as conn:
        documents = conn.exec_driver_sql("SELECT adapter_id, document FROM adapter_text").all()
    expected = "digits vit 00012 org base 1 peft task even cafe x y zoo a a card naive"
    assert expected == search_document(
        "Digits-ViT_00012", "org/Base-1", "peft", "/zoo/a", ["Café", "x-y"], "A card: naïve", {"task": "even"}
    )
    assert [tuple(d) for d in documents] == [(1, expected)]
