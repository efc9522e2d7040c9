"""The zoo map: the projection's math (embed/serving/projection.py) and the stored, served map (embed/serving/maps.py)."""

from __future__ import annotations

import csv
import json
import tracemalloc
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from sqlalchemy import event

import embed.serving.maps
import embed.serving.projection
from embed.serving.maps import map_embedder, map_path, read_map, space_map, write_map
from embed.serving.projection import MIN_SKEW, fit, spread_sample
from tests.conftest import CLI
from tests.factories import train_peft_adapter
from tests.test_engine import ingest_and_embed
from zoo.domain.palette import CATEGORIES, MISSING, OTHER, SEQUENTIAL, category_colours, cielab, closest_pair, distance
from zoo.errors import UsageError
from zoo.plots import map_figure
from zoo.store.embedders import register
from zoo.store.embeddings import load_embeddings, store_embeddings
from zoo.store.session import make_engine, session_factory
from zoo.store.spaces import get_space

PARTS = {"first": 8, "later": 6, "more": 4}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """18 real PEFT adapters in three batches (8, 6, 4) with a task, a colour and a test accuracy each."""
    root = tmp_path_factory.mktemp("map-zoo")
    rows = ["name,task,colour,test_accuracy"]
    i = 0
    for part, n in PARTS.items():
        for _ in range(n):
            targets = ("q_proj", "v_proj") if i % 2 else ("q_proj", "k_proj")
            train_peft_adapter(root / part / f"m{i:02d}", seed=300 + i, steps=4, targets=targets)
            rows.append(f"m{i:02d},{'qv' if i % 2 else 'qk'},{'red' if i % 3 == 0 else 'blue'},{0.4 + i / 40}")
            i += 1
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


def stored(cli: CLI) -> tuple[int, Path, np.ndarray, np.ndarray]:
    """(map embedder id, its map file, stored ids, stored vectors) of the space `tiny`."""
    with session_factory(cli.settings.database_url)() as session:
        embedder = map_embedder(session, get_space(session, "tiny").id)
        ids, vectors = load_embeddings(session, embedder)  # type: ignore[arg-type]
        return embedder.id, map_path(cli.settings.data_dir, embedder.id), ids, vectors  # type: ignore[union-attr]


def served(cli: CLI, **kwargs: object) -> dict:
    with session_factory(cli.settings.database_url)() as session:
        return space_map(session, cli.settings.data_dir, "tiny", **kwargs)  # type: ignore[arg-type]


def labels_csv(zoo: Path) -> dict[str, dict[str, str]]:
    with (zoo / "labels.csv").open() as fh:
        return {row["name"]: row for row in csv.DictReader(fh)}


def skewness_sign_holds(xy: np.ndarray, vectors: np.ndarray) -> bool:
    """Every axis whose skewness clearly decides its sign has positive skewness (axes holding next to none
    of the input's variance are float noise, whatever their sign)."""
    s = xy.astype(np.float64)
    m2, m3 = np.mean(s**2, axis=0), np.mean(s**3, axis=0)
    total = np.sum(np.var(vectors.astype(np.float64), axis=0))
    clear = (np.abs(m3) > 2 * MIN_SKEW * np.maximum(m2, 1e-300) ** 1.5) & (m2 > 1e-6 * total)
    return bool(np.all(~clear | (m3 > 0)))


# --- the math ------------------------------------------------------------------------------------


@st.composite
def point_clouds(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids, vectors, a permutation, a random rotation of the input space)."""
    n, d = draw(st.integers(1, 30)), draw(st.integers(2, 8))
    vectors = draw(arrays(np.float32, (n, d), elements=st.floats(-1, 1, width=32)))
    ids = np.array(draw(st.lists(st.integers(1, 10**9), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return ids, vectors, rng.permutation(n), (q * np.sign(np.diag(r))).astype(np.float32)


def pairwise(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)


@settings(max_examples=200, deadline=None)
@given(point_clouds())
def test_the_projection_is_the_pca_and_contracts_distances(cloud: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    ids, vectors, perm, rotation = cloud
    p = fit(ids, vectors)
    xy = p.project(vectors)
    assert np.allclose(p.basis @ p.basis.T, np.eye(2), atol=1e-5)
    centered = vectors.astype(np.float64) - vectors.mean(axis=0, dtype=np.float64)
    s = np.linalg.svd(centered, compute_uv=False)
    assert np.isclose(np.sum(xy.astype(np.float64) ** 2), np.sum(s[:2] ** 2), rtol=1e-4, atol=1e-6)  # the most variance two axes hold
    assert np.all(pairwise(xy) <= pairwise(vectors) + 1e-5)
    assert skewness_sign_holds(xy, vectors)
    # the fitting vectors projected one at a time land on the fit's points
    assert np.allclose(np.concatenate([p.project(v[None, :]) for v in vectors]), xy, atol=1e-6)
    # permuted input: the same fit, bit for bit
    again = fit(ids[perm], vectors[perm])
    assert np.array_equal(again.basis, p.basis) and np.array_equal(again.mean, p.mean) and again.explained == p.explained
    assert np.array_equal(again.project(vectors[perm]), xy[perm])
    # a rotated input space: still an orthogonal projection of the (rotated) input
    rotated = vectors @ rotation
    assert np.all(pairwise(fit(ids, rotated).project(rotated)) <= pairwise(rotated) + 1e-5)


def test_the_sign_rule_survives_rotations_of_skewed_data() -> None:
    rng = np.random.default_rng(7)
    data = (rng.exponential(size=(300, 6)) * np.array([5.0, 2.0, 0.5, 0.2, 0.1, 0.05])).astype(np.float32)
    ids = np.arange(1, 301)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    xy = fit(ids, data).project(data)
    turned = (data @ q).astype(np.float32)
    assert np.allclose(fit(ids, turned).project(turned), xy, atol=1e-4)  # not flipped, nor any axis
    assert skewness_sign_holds(xy, data) and np.all(np.mean(xy**3, axis=0) > 0)


def test_a_large_input_is_fitted_on_its_spread_sample() -> None:
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.arange(1, 501) * 7)
    vectors = rng.standard_normal((500, 5)).astype(np.float32)
    rows = spread_sample(ids, 40)
    assert len(rows) == 40 and np.all(np.diff(ids[rows]) > 0)
    small = fit(ids, vectors, max_fit=40)
    alone = fit(ids[rows], vectors[rows])
    assert np.array_equal(small.basis, alone.basis) and np.array_equal(small.mean, alone.mean)
    perm = rng.permutation(500)
    assert np.array_equal(fit(ids[perm], vectors[perm], max_fit=40).basis, small.basis)
    assert np.array_equal(ids[perm][spread_sample(ids[perm], 40)], ids[rows])


@st.composite
def spiked_clouds(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors): a rank-r signal with two leading scales apart from each other and from the rest, plus
    noise, at dimensions above the fit's block (so the iteration, not one exact pass, finds the axes)."""
    n, d, r = draw(st.integers(3, 300)), draw(st.integers(40, 200)), draw(st.integers(2, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scales = np.concatenate([[4.0, 2.0], rng.uniform(0.05, 1.0, r - 2)])
    directions = np.linalg.qr(rng.standard_normal((d, r)))[0].T
    vectors = (rng.standard_normal((n, r)) * scales) @ directions + 0.05 * rng.standard_normal((n, d))
    vectors += draw(st.sampled_from([0.0, 1.0, 30.0])) * rng.standard_normal(d)  # a mean of any size
    return rng.permutation(np.arange(1, n + 1) * 3), vectors.astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(spiked_clouds())
def test_the_fit_agrees_with_an_exact_eigendecomposition(cloud: tuple[np.ndarray, np.ndarray]) -> None:
    ids, vectors = cloud
    centred = vectors.astype(np.float64) - vectors.mean(axis=0, dtype=np.float64)
    values, vecs = np.linalg.eigh(centred.T @ centred)  # the exact route the fit no longer takes
    values, vecs = values[::-1], vecs[:, ::-1]
    if not values[1] > 1.05 * values[2] or not values[0] > 1.05 * values[1]:
        return  # few points can leave the top two eigenvalues close: then the axes are not defined
    p = fit(ids, vectors)
    cosines = np.abs(np.sum(p.basis.astype(np.float64) * vecs[:, :2].T, axis=1))
    assert np.all(cosines > 1 - 1e-6)
    assert np.allclose(p.explained, values[:2] / values.clip(min=0).sum(), atol=1e-6)
    assert np.allclose(p.basis @ p.basis.T, np.eye(2), atol=1e-5)


def test_a_wide_space_is_fitted_without_a_d_by_d_matrix() -> None:
    n, d = 300, 20_000  # d x d float64 would be 3.2 GB
    rng = np.random.default_rng(11)
    signal = rng.standard_normal((n, 3)) * [3.0, 1.5, 0.5]
    vectors = (signal @ np.linalg.qr(rng.standard_normal((d, 3)))[0].T + 0.01 * rng.standard_normal((n, d))).astype(np.float32)
    ids = np.arange(1, n + 1)
    tracemalloc.start()
    try:
        p = fit(ids, vectors)
        xy = p.project(vectors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 * 2**20  # numpy reports its buffers to tracemalloc; d x d float64 alone is 3.2 GB
    centred = vectors.astype(np.float64) - vectors.mean(axis=0, dtype=np.float64)
    values, u = np.linalg.eigh(centred @ centred.T)  # the exact n x n (Gram) route
    values, u = values[::-1], u[:, ::-1]
    axes = (centred.T @ u[:, :2] / np.sqrt(values[:2])).T
    assert np.all(np.abs(np.sum(p.basis.astype(np.float64) * axes, axis=1)) > 1 - 1e-6)
    assert np.allclose(p.explained, values[:2] / values.clip(min=0).sum(), atol=1e-6)
    assert np.isclose(np.sum(xy.astype(np.float64) ** 2), values[:2].sum(), rtol=1e-5)


def test_the_projection_does_not_depend_on_its_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((500, 64)).astype(np.float32)
    p = fit(np.arange(500), vectors)
    whole = p.project(vectors)
    monkeypatch.setattr(embed.serving.projection, "CHUNK_BYTES", 3 * 64 * 8)  # three rows at a time
    assert np.array_equal(p.project(vectors), whole)


# --- the stored map ------------------------------------------------------------------------------


def test_embed_writes_the_map_and_it_is_the_pca_of_the_stored_vectors(cli: CLI, parts: Path) -> None:
    rc, _ = cli.json_lines("ingest", "--no-embed", str(parts / "first"), "--labels", str(parts / "labels.csv"), "--base-model", "tiny")
    rc, (reports,) = cli.json_lines("embed")
    assert rc == 0 and reports[0]["map"].startswith("fitted (no map file")
    embedder_id, path, ids, vectors = stored(cli)
    m = read_map(path)
    assert m.embedder_id == embedder_id and m.fitted == 8 and np.array_equal(m.ids, ids)
    assert np.array_equal(m.projection.project(vectors), m.xy)
    centered = vectors.astype(np.float64) - vectors.mean(axis=0, dtype=np.float64)
    u, s, _ = np.linalg.svd(centered, full_matrices=False)
    reference = u[:, :2] * s[:2]
    for axis in range(2):  # equal up to the sign of each axis, which the sign rule picks
        sign = np.sign(reference[:, axis] @ m.xy[:, axis])
        assert np.allclose(m.xy[:, axis], sign * reference[:, axis], atol=1e-5)
    assert np.allclose(m.projection.explained, s[:2] ** 2 / np.sum(s**2), atol=1e-5)
    assert skewness_sign_holds(m.xy, vectors)

    found = served(cli)
    assert found["method"] == "module_sketch" and found["embedder_id"] == embedder_id and found["state"] == "loaded"
    assert found["count"] == found["shown"] == 8 and [p["id"] for p in found["points"]] == ids.tolist()
    assert np.allclose([[p["x"], p["y"]] for p in found["points"]], m.xy, atol=1e-6)
    rc, (report,) = cli.json_lines("check")
    assert rc == 0 and any(e.get("map") == str(path) and e["state"] == "ok" for e in report["indexes"])


def test_new_adapters_are_projected_without_moving_old_points_until_the_map_doubles(cli: CLI, parts: Path) -> None:
    ingest_and_embed(cli, parts, "first")
    _, path, _, _ = stored(cli)
    before = read_map(path)
    rc, _ = cli.json_lines("ingest", "--no-embed", str(parts / "later"), "--labels", str(parts / "labels.csv"), "--base-model", "tiny")
    rc, (reports,) = cli.json_lines("embed")
    assert reports[0]["map"] == "updated (6 points projected)"
    after = read_map(path)
    _, _, ids, vectors = stored(cli)
    assert np.array_equal(after.ids, ids) and after.fitted == 8 and np.array_equal(after.projection.basis, before.projection.basis)
    old = np.isin(after.ids, before.ids)
    assert np.array_equal(after.xy[old], before.xy)  # no old point moved
    assert np.array_equal(after.xy[~old], before.projection.project(vectors[~old]))

    rc, (reports,) = cli.json_lines("embed")
    assert reports[0]["map"] == "loaded"
    rc, _ = cli.json_lines("ingest", "--no-embed", str(parts / "more"), "--labels", str(parts / "labels.csv"), "--base-model", "tiny")
    rc, (reports,) = cli.json_lines("embed")  # 18 points, 10 of them since the fit on 8: fitted again
    assert reports[0]["map"] == "fitted again (10 points since the fit outnumber its 8)"
    assert read_map(path).fitted == 18
    rc, (found,) = cli.json_lines("map", "--rebuild")
    assert rc == 0 and found["file"] == "fitted (asked)" and found["count"] == 18


def test_a_damaged_or_foreign_map_file_is_fitted_again_and_never_breaks_a_request(cli: CLI, parts: Path) -> None:
    ingest_and_embed(cli, parts, "first")
    embedder_id, path, _, _ = stored(cli)
    good = read_map(path)
    raw = path.read_bytes()
    damages = {
        "truncated": raw[:100],
        "empty": b"",
        "a flipped byte": raw[:-1] + bytes([raw[-1] ^ 1]),
        "not safetensors": b"\xff" * 64,
    }
    for what, data in damages.items():
        path.write_bytes(data)
        found = served(cli)  # a request answers from the database and writes nothing
        assert found["state"].startswith("fitted from the database (map file"), what
        assert np.allclose([[p["x"], p["y"]] for p in found["points"]], good.xy, atol=1e-6) and path.read_bytes() == data
        rc, (report,) = cli.json_lines("check")
        assert rc == 1 and any(e.get("map") and e["state"] != "ok" for e in report["indexes"]), what
        rc, (fixed,) = cli.json_lines("map")
        assert rc == 0 and fixed["file"].startswith("fitted (map file"), what
        assert np.array_equal(read_map(path).xy, good.xy)
    write_map(path, type(good)(embedder_id + 100, good.version, good.fitted, good.projection, good.ids, good.xy))
    rc, (fixed,) = cli.json_lines("map")
    assert "another database or embedder" in fixed["file"] and read_map(path).embedder_id == embedder_id
    path.write_bytes(raw[:100])
    rc, out, _ = cli("check", "--repair")
    assert rc == 0 and "rebuilt map" in out and read_map(path).embedder_id == embedder_id


def test_points_are_coloured_by_a_label_or_a_metric_in_a_fixed_number_of_queries(cli: CLI, parts: Path, tmp_path: Path) -> None:
    ingest_and_embed(cli, parts, "first")
    ingest_and_embed(cli, parts, "later")
    given_rows = labels_csv(parts)
    by_task = served(cli, color_by="task")
    assert by_task["color_keys"] == ["colour", "task", "metric:test_accuracy"]
    assert all(p["value"] == given_rows[p["name"]]["task"] for p in by_task["points"])
    qk, qv = {"value": "qk", "count": 7, "colour": CATEGORIES[0]}, {"value": "qv", "count": 7, "colour": CATEGORIES[1]}
    assert by_task["legend"] == {"kind": "label", "values": [qk, qv], "missing": 0, "missing_colour": MISSING}
    by_accuracy = served(cli, color_by="metric:test_accuracy")
    assert all(p["value"] == pytest.approx(float(given_rows[p["name"]]["test_accuracy"])) for p in by_accuracy["points"])
    assert by_accuracy["legend"]["min"] == pytest.approx(0.4) and by_accuracy["legend"]["max"] == pytest.approx(0.4 + 13 / 40)
    assert by_accuracy["legend"]["colours"] == list(SEQUENTIAL)
    nothing = served(cli, color_by="flavour")
    assert all(p["value"] is None for p in nothing["points"]) and nothing["legend"]["missing"] == 14

    statements: list[str] = []

    def record(conn: object, cursor: object, statement: str, *rest: object) -> None:
        statements.append(statement)

    engine = make_engine(cli.settings.database_url)
    event.listen(engine, "before_cursor_execute", record)
    try:
        counts = []
        for limit in (3, 14):
            statements.clear()
            served(cli, color_by="task", limit=limit)
            counts.append(len(statements))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert counts[0] == counts[1] <= 8  # no query per point

    plot = tmp_path / "map.png"
    rc, out, _ = cli("map", "--color-by", "metric:test_accuracy", "--plot", str(plot))
    assert rc == 0 and "colour keys: colour, task, metric:test_accuracy" in out and plot.read_bytes()[:4] == b"\x89PNG"
    rc, (found,) = cli.json_lines("map", "--color-by", "task", "--limit", "5")
    assert found["shown"] == 5 and found["count"] == 14 and json.dumps(found)


def test_the_limit_keeps_a_deterministic_spread_and_the_highlighted_ids(cli: CLI, parts: Path) -> None:
    ingest_and_embed(cli, parts, "first")
    ingest_and_embed(cli, parts, "later")
    pick = [p["id"] for p in served(cli, limit=5)["points"]]
    assert len(pick) == 5 and pick == sorted(pick) and pick == [p["id"] for p in served(cli, limit=5)["points"]]
    others = [i for i in range(1, 15) if i not in pick][:2]
    kept = [p["id"] for p in served(cli, limit=5, highlight=others)["points"]]
    assert len(kept) == 5 and set(others) <= set(kept) and set(kept) - set(others) <= set(pick)
    assert len(served(cli, limit=3, highlight=list(range(1, 15)))["points"]) == 3
    with pytest.raises(UsageError, match="limit"):
        served(cli, limit=0)


def test_the_map_shows_the_supervised_w2t_when_there_is_one(cli: CLI, parts: Path) -> None:
    ingest_and_embed(cli, parts, "first")
    sketch_id, _, ids, _ = stored(cli)
    sessions = session_factory(cli.settings.database_url)
    made = {}
    for objective in ("contrastive", "supervised"):
        with sessions.begin() as session:
            e = register(session, get_space(session, "tiny"), "w2t", 8, objective=objective, checkpoint="unused", config={})
            store_embeddings(session, e, ids.tolist(), np.random.default_rng(len(made)).standard_normal((len(ids), 8)).astype(np.float32))
            made[objective] = e.id
        rc, (found,) = cli.json_lines("map")
        want = ("w2t", made["supervised"]) if objective == "supervised" else ("module_sketch", sketch_id)
        assert rc == 0 and (found["method"], found["embedder_id"]) == want and found["count"] == 8
    assert (
        map_path(cli.settings.data_dir, made["supervised"]).exists() and not map_path(cli.settings.data_dir, made["contrastive"]).exists()
    )


def test_the_map_is_the_same_whatever_the_read_chunk(cli: CLI, parts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ingest_and_embed(cli, parts, "first")
    ingest_and_embed(cli, parts, "later")
    _, path, ids, vectors = stored(cli)
    rc, _ = cli.json_lines("map", "--rebuild")  # read 64 MiB at a time: all 14 vectors in one chunk
    whole = read_map(path)
    assert rc == 0 and whole.fitted == 14 and np.array_equal(whole.ids, ids)
    reads: list[int] = []
    iterate = embed.serving.maps.iter_embeddings

    def counted(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for chunk in iterate(*args, **kwargs):  # type: ignore[arg-type]
            reads.append(len(chunk[0]))
            yield chunk

    monkeypatch.setattr(embed.serving.maps, "iter_embeddings", counted)
    monkeypatch.setattr(embed.serving.maps, "READ_BYTES", 3 * 4 * vectors.shape[1])  # three vectors at a time
    rc, (found,) = cli.json_lines("map", "--rebuild")
    assert rc == 0 and found["file"] == "fitted (asked)" and reads == [3, 3, 3, 3, 2]
    small = read_map(path)
    assert np.array_equal(small.ids, whole.ids) and np.array_equal(small.xy, whole.xy)
    assert np.array_equal(small.projection.basis, whole.projection.basis) and small.projection.explained == whole.projection.explained
    monkeypatch.setattr(embed.serving.maps, "MAX_FIT", 5)  # a sample: fitted on 5 vectors loaded by id, all 14 projected
    rc, (found,) = cli.json_lines("map", "--rebuild")
    sampled = read_map(path)
    rows = spread_sample(ids, 5)
    assert rc == 0 and np.array_equal(sampled.projection.basis, fit(ids[rows], vectors[rows]).basis)
    assert np.array_equal(sampled.xy, sampled.projection.project(vectors)) and sampled.fitted == 14


# --- the colours and the plot --------------------------------------------------------------------


def test_the_category_colours_stay_apart_at_16_classes_and_more() -> None:
    """Any first n of the palette (a label's n most common values) are far apart in CIELAB (ΔE*76: 2.3 is just
    noticeable; a pair of one hue's light and dark shades, as in tab20, is about 25), and apart from the greys of
    "other" and "no value", the white background and the black of the highlighted adapter."""
    assert closest_pair(category_colours(10)) > 45
    for n in range(16, len(CATEGORIES) + 1):
        assert closest_pair(category_colours(n)) > 29, n
    for fixed in (OTHER, MISSING, "#ffffff", "#000000"):
        assert min(distance(c, fixed) for c in CATEGORIES) > 25, fixed
    assert category_colours(30)[len(CATEGORIES) :] == [OTHER] * (30 - len(CATEGORIES))


def test_the_metric_scale_reads_high_as_light() -> None:
    """The sequential scale's lightness rises with the value (viridis): no hue wheel where red may mean high."""
    lightness = [cielab(c)[0] for c in SEQUENTIAL]
    assert lightness == sorted(lightness) and lightness[-1] - lightness[0] > 70


def _resource(values: list[str | float | None], legend: dict) -> dict:
    """A map resource (embed/serving/maps.py `space_map`'s shape) with a point per value, on a grid that fills the axes."""
    side = int(len(values) ** 0.5) + 1
    points = [{"id": i, "name": f"a{i}", "x": float(i % side), "y": float(i // side), "value": v} for i, v in enumerate(values)]
    common = {"space": "s", "embedder_id": 1, "method": "sketch", "projection": "pca", "explained": [0.5, 0.2], "state": "loaded"}
    return common | {"count": len(points), "shown": len(points), "points": points, "color_by": "task", "legend": legend, "color_keys": []}


def _boxes(fig: Figure) -> tuple[Bbox, list[Bbox]]:
    """(the points' axes, its legends and colour bars) in display pixels, once drawn."""
    fig.canvas.draw()
    axes, *bars = fig.axes
    keys = [legend.get_window_extent() for legend in [*fig.legends, *filter(None, [axes.get_legend()])]]
    return axes.get_window_extent(), keys + [bar.get_window_extent() for bar in bars]


def test_the_plot_keeps_its_legend_outside_the_points_in_the_palette_colours() -> None:
    """`zoo map --plot` with 18 task values, less common ones past the palette and points without one: the legend
    hides no point (it is outside the axes) and the points are drawn in the legend's colours, as on the web map."""
    names = [f"task-{i:02d}" for i in range(len(CATEGORIES) + 3)]
    values: list[str | float | None] = [n for i, n in enumerate(names) for _ in range(len(names) - i)] + [None] * 5
    colours = category_colours(len(names))
    counts = [{"value": n, "count": len(names) - i, "colour": c} for i, (n, c) in enumerate(zip(names, colours, strict=True))]
    legend = {"kind": "label", "values": counts}
    fig = map_figure(_resource(values, legend | {"missing": 5, "missing_colour": MISSING}))  # type: ignore[arg-type]
    try:
        plot, keys = _boxes(fig)
        assert len(keys) == 1 and not keys[0].overlaps(plot), (keys, plot)
        drawn = {to_hex(c) for dots in fig.axes[0].collections for c in dots.get_facecolors()}
        assert drawn == set(CATEGORIES) | {OTHER, MISSING}
    finally:
        plt.close(fig)


def test_the_plot_of_a_metric_has_a_colour_bar_with_its_min_and_max() -> None:
    values: list[str | float | None] = [0.25 + i / 100 for i in range(40)] + [None] * 3
    legend = {"kind": "metric", "min": 0.25, "max": 0.64, "missing": 3, "colours": list(SEQUENTIAL), "missing_colour": MISSING}
    fig = map_figure(_resource(values, legend))  # type: ignore[arg-type]
    try:
        plot, keys = _boxes(fig)
        assert len(keys) == 2 and not any(k.overlaps(plot) for k in keys), (keys, plot)  # "no value" and the colour bar
        ticks = [t.get_text() for t in fig.axes[1].get_yticklabels()]
        assert ticks[0] == "min 0.25" and ticks[-1] == "max 0.64", ticks
        dots = fig.axes[0].collections[-1]
        low, high = (to_hex(dots.cmap(dots.norm(v))) for v in (0.25, 0.64))
        assert (low, high) == (SEQUENTIAL[0], SEQUENTIAL[-1])
    finally:
        plt.close(fig)


def test_an_unknown_space_is_one_not_found_wherever_it_is_asked_for(cli: CLI, parts: Path) -> None:
    """The map, the query engine, the commands' --space and the base model a command embeds answer an unknown space
    with one error: 404 over HTTP, naming the spaces there are."""
    from embed.serving import resources
    from tests.test_engine import make_engine
    from zoo.errors import SpaceNotFoundError

    ingest_and_embed(cli, parts, "first")
    expected = "no embedding space 'nope'; spaces: tiny"
    with session_factory(cli.settings.database_url)() as session:
        asks = [
            lambda: space_map(session, cli.settings.data_dir, "nope"),
            lambda: make_engine(cli).space(session, "nope"),
            lambda: resources.resolve_space(session, "nope"),
            lambda: resources.resolve_base_model(session, "nope"),
        ]
        for ask in asks:
            with pytest.raises(SpaceNotFoundError) as caught:
                ask()
            assert str(caught.value) == expected and caught.value.http_status == 404
    for command in (("map", "--space", "nope"), ("eval", "--space", "nope"), ("index", "stats", "--space", "nope")):
        rc, _, err = cli(*command)
        assert rc == 2 and expected in err, (command, err)
