"""The zoo map: a 2-D projection (embed/serving/projection.py) of one embedder's vectors, stored and served.

Which embedder: the space's supervised W2T when it has one, else its module sketch (`map_embedder`).

File: `DATA/map/embedder-N.safetensors`: ids (int64, ascending), xy (float32), the projection's mean
and basis, and a metadata map (embedder id, the space version it covers, the points it was fitted
with, the variance share of each axis, a SHA-256 of all of it), replaced whole with
`zoo.files.replace_durably`.

`update_map` runs where index files are brought up to date (`zoo embed`, `zoo train`, `zoo map`,
`zoo check --repair`), never in a request. It fits the map when the file is missing, unreadable,
written for another embedder or database, or when asked (`rebuild`); otherwise it projects only the
vectors written since the file's version with the stored basis, so no point moves. **Refit rule**: when
the points added since the fit outnumber those it was fitted with (the map more than doubled), it is
fitted again: refits are rare (amortized O(1) per point) and the picture only changes after the zoo
has.

Memory does not grow with the zoo beyond the points themselves (an id and two floats each): a fit
loads only its sample (at most `MAX_FIT` vectors, chosen by `spread_sample` over the ids), and every
vector is projected chunk by chunk (`READ_BYTES` at a time) as it is read, when fitted and when caught up.

`space_map` is the resource a page draws: it reads the file (once per file and space version),
projects in memory what was embedded since. A map file this node lacks (a new node's empty data dir: derived
files are per-node caches) is fitted from the database and kept, with the seconds it took logged; one that is
bad is answered from the database's vectors (fitted in memory, not saved) while there are at most `FIT_IN_REQUEST`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

import numpy as np

from embed.serving.projection import MAX_FIT, Projection, fit, spread_sample
from embed.serving.search_methods import SKETCH, W2T
from zoo.domain.palette import MISSING, SEQUENTIAL, category_colours
from zoo.errors import NotReadyError, UsageError
from zoo.files import read_derived, write_derived
from zoo.labels import TASK_KEY
from zoo.limits import DEFAULT_MAP_POINTS, MAX_MAP_POINTS
from zoo.store.embedders import serving_embedders
from zoo.store.embeddings import deleted_since, embedding_ids, iter_embeddings, load_embeddings, stored_count
from zoo.store.label_reads import given_label_keys, given_label_values, measured_metric_names, measured_metric_values
from zoo.store.models import Embedder
from zoo.store.session import Session
from zoo.store.space_adapters import adapter_names
from zoo.store.spaces import get_space, space_version

#: a request fits a missing or bad map in memory while the embedder has at most this many vectors
log = logging.getLogger(__name__)

FIT_IN_REQUEST = 100_000
#: `color_by` of a measured metric (split "test"); any other key is a given label
METRIC = "metric:"
#: maps kept in memory by `current_map` (per file and space version)
CACHED_MAPS = 4
#: bytes of vectors read from the database at a time when a map is fitted or caught up
READ_BYTES = 64 << 20


def map_path(data_dir: Path, embedder_id: int) -> Path:
    return Path(data_dir) / "map" / f"embedder-{embedder_id}.safetensors"


def map_embedder(session: Session, space_id: int) -> Embedder | None:
    """The embedder a space's map shows: its supervised W2T, else its module sketch."""
    serving = serving_embedders(session, space_id)
    w2t = serving.get(W2T)
    return w2t if w2t is not None and w2t.objective != "contrastive" else serving.get(SKETCH)


@dataclass(frozen=True)
class ZooMap:
    """Points (ids ascending, xy) of one embedder at a space version, and the projection that made them."""

    embedder_id: int
    version: int
    fitted: int  # points when the projection was fitted
    projection: Projection
    ids: np.ndarray
    xy: np.ndarray

    @property
    def count(self) -> int:
        return len(self.ids)

    def without(self, ids: np.ndarray, version: int) -> ZooMap:
        """The map without the points of these ids, at `version`."""
        keep = ~np.isin(self.ids, ids)
        return replace(self, version=version, ids=self.ids[keep], xy=self.xy[keep])

    def with_points(self, ids: np.ndarray, xy: np.ndarray, version: int) -> ZooMap:
        """The map with these points added (or replacing those of the same ids), at `version`."""
        old = ~np.isin(self.ids, ids)
        all_ids, all_xy = np.concatenate([self.ids[old], ids]), np.concatenate([self.xy[old], xy])
        order = np.argsort(all_ids, kind="stable")
        return replace(self, version=version, ids=all_ids[order], xy=all_xy[order])


# --- the file ------------------------------------------------------------------------------------


def write_map(path: Path, m: ZooMap) -> None:
    tensors: dict[str, np.ndarray] = {
        "ids": np.asarray(m.ids, np.int64),
        "xy": np.asarray(m.xy, np.float32),
        "mean": np.asarray(m.projection.mean, np.float32),
        "basis": np.asarray(m.projection.basis, np.float32),
    }
    meta = {"embedder_id": m.embedder_id, "version": m.version, "fitted": m.fitted, "explained": list(m.projection.explained)}
    write_derived(path, tensors, meta)


def read_map(path: Path) -> ZooMap:
    """The map file; ValueError when it is missing, unreadable or disagrees with its checksum."""
    tensors, meta = read_derived(path, "map")
    try:
        ids, xy, mean, basis = tensors["ids"], tensors["xy"], tensors["mean"], tensors["basis"]
        explained = (float(meta["explained"][0]), float(meta["explained"][1]))
        m = ZooMap(int(meta["embedder_id"]), int(meta["version"]), int(meta["fitted"]), Projection(mean, basis, explained), ids, xy)
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(f"map file {path} disagrees with itself (its metadata)") from None
    if xy.shape != (len(ids), 2) or basis.shape != (2, len(mean)):
        raise ValueError(f"map file {path} disagrees with itself (shapes)")
    return m


def load_consistent_map(session: Session, path: Path, embedder: Embedder, version: int) -> tuple[ZooMap, str]:
    """The map file without the adapters deleted after its version (their tombstones) and with the points
    embedded after it, and what changed ("" nothing); ValueError when it cannot be made to agree with the
    database."""
    m = read_map(path)
    if m.embedder_id != embedder.id or m.version > version or len(m.projection.mean) != embedder.dim:
        raise ValueError(f"map file {path} was written for another database or embedder")
    since = m.version
    gone = deleted_since(session, embedder.space_id, since)
    ids, xy = _projected(session, embedder, m.projection, after_version=since)
    dropped = int(np.isin(m.ids, gone).sum())
    if dropped:
        m = m.without(gone, version)
    if len(ids):
        m = m.with_points(ids, xy, version)
    stored = stored_count(session, embedder.id)
    if m.count != stored:
        raise ValueError(f"map file {path} holds {m.count} points, the database {stored} vectors")
    changes = ([f"{dropped} deleted points dropped"] if dropped else []) + ([f"{len(ids)} points projected"] if len(ids) else [])
    return m, ", ".join(changes)


def _read_batch(embedder: Embedder) -> int:
    """Vectors read from the database at a time: `READ_BYTES` of float32."""
    return max(1, READ_BYTES // (4 * max(embedder.dim, 1)))


def _projected(
    session: Session, embedder: Embedder, projection: Projection, after_version: int = -1, ids: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, xy) of the embedder's vectors (those of `ids`, else those written after `after_version`), projected
    chunk by chunk as they are read: one chunk of vectors in memory at a time."""
    found, points = [np.zeros(0, np.int64)], [np.zeros((0, 2), np.float32)]
    for chunk_ids, vectors in iter_embeddings(session, embedder, after_version, ids=ids, batch=_read_batch(embedder)):
        found.append(chunk_ids)
        points.append(projection.project(vectors))
    return np.concatenate(found), np.concatenate(points)


def _fitted(session: Session, embedder: Embedder, version: int) -> ZooMap:
    """Fit on the spread sample of the ids (at most MAX_FIT vectors loaded), then project every vector as it is read."""
    ids = embedding_ids(session, embedder)
    sample_ids, sample = load_embeddings(session, embedder, ids=ids[spread_sample(ids, MAX_FIT)])
    projection = fit(sample_ids, sample)
    del sample
    ids, xy = _projected(session, embedder, projection, ids=ids)
    return ZooMap(embedder.id, version, len(ids), projection, ids, xy)


def update_map(session: Session, data_dir: Path, embedder: Embedder, rebuild: bool = False) -> tuple[ZooMap, str]:
    """Bring the embedder's map file up to the database: project the points embedded since it was saved,
    or fit it (asked, none yet, unreadable, another embedder's, or outgrown: see the module doc). Returns
    (map, how)."""
    version = space_version(session, embedder.space_id)
    path = map_path(data_dir, embedder.id)
    how = "fitted (asked)"
    if not rebuild:
        try:
            m, changed = load_consistent_map(session, path, embedder, version)
        except ValueError as exc:
            how = f"fitted ({exc})"
        else:
            if m.count - m.fitted <= m.fitted:
                if changed:
                    write_map(path, m)
                return m, f"updated ({changed})" if changed else "loaded"
            how = f"fitted again ({m.count - m.fitted} points since the fit outnumber its {m.fitted})"
    m = _fitted(session, embedder, version)
    write_map(path, m)
    return m, how


def refresh_map(session: Session, data_dir: Path, space_id: int, rebuild: bool = False) -> str:
    """`update_map` for the space's map embedder; how it went."""
    embedder = map_embedder(session, space_id)
    return update_map(session, data_dir, embedder, rebuild)[1] if embedder is not None else "none (no embeddings)"


def map_state(session: Session, data_dir: Path, embedder: Embedder) -> str:
    """ "ok", or why the embedder's map file does not agree with the database (for `zoo check`)."""
    try:
        load_consistent_map(session, map_path(data_dir, embedder.id), embedder, space_version(session, embedder.space_id))
    except ValueError as exc:
        return str(exc)
    return "ok"


# --- the resource --------------------------------------------------------------------------------


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells one version of a file from another (None: there is none)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


_CACHE: dict[tuple, tuple[ZooMap, str]] = {}
_CACHE_LOCK = threading.Lock()


def current_map(session: Session, data_dir: Path, embedder: Embedder) -> tuple[ZooMap, str]:
    """The embedder's map at the database's version, and how it was had. Writes nothing but a map file this node lacks."""
    version = space_version(session, embedder.space_id)
    path = map_path(data_dir, embedder.id)
    stamp = _stamp(path)
    key = (str(path.resolve()), stamp, embedder.id, version)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    try:
        m, changed = load_consistent_map(session, path, embedder, version)
        state = "loaded" + (f" ({changed} in memory since it was saved)" if changed else "")
    except ValueError as exc:
        if stamp is None:  # not in this node's cache: fitted here and kept
            started = time.perf_counter()
            m, _ = update_map(session, data_dir, embedder)
            state = f"fitted on this node from the database in {time.perf_counter() - started:.2f} s"
            log.info("embedder %d: map of %d points %s (%s)", embedder.id, m.count, state, path)
        elif stored_count(session, embedder.id) > FIT_IN_REQUEST:
            raise NotReadyError(f"{exc}: run `zoo map` to fit it") from None
        else:
            m, state = _fitted(session, embedder, version), f"fitted from the database ({exc}); run `zoo map` to save it"
    with _CACHE_LOCK:
        while len(_CACHE) >= CACHED_MAPS:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (m, state)
    return m, state


class MapPoint(TypedDict):
    id: int
    name: str
    x: float
    y: float
    value: str | float | None  # the point's label value or metric (None: it has none)


class MetricLegend(TypedDict):
    """The range of a metric over the shown points that have it, and the colour scale it is drawn in."""

    kind: Literal["metric"]
    min: float | None
    max: float | None
    missing: int  # shown points without it
    colours: list[str]  # the scale's stops, "#rrggbb", from min to max (zoo/domain/palette.py SEQUENTIAL)
    missing_colour: str  # of a point without it


class LabelCount(TypedDict):
    value: str
    count: int  # shown points with this value
    colour: str  # "#rrggbb" the points are drawn in (zoo/domain/palette.py: the same on the page and in a plot)


class LabelLegend(TypedDict):
    """A label's values among the shown points, most common first, each with its colour."""

    kind: Literal["label"]
    values: list[LabelCount]
    missing: int  # shown points without it
    missing_colour: str  # of a point without it


class MapResource(TypedDict):
    """The map resource (space_map)."""

    space: str
    embedder_id: int
    method: str
    projection: str
    explained: list[float]
    state: str
    count: int
    shown: int
    points: list[MapPoint]
    color_by: str | None
    legend: MetricLegend | LabelLegend | None
    color_keys: list[str]
    file: NotRequired[str]  # `zoo map`: the map file it brought up to date


def space_map(
    session: Session,
    data_dir: Path,
    space_name: str,
    color_by: str | None = None,
    limit: int = DEFAULT_MAP_POINTS,
    highlight: Sequence[int] = (),
) -> MapResource:
    """The map resource: {space, embedder_id, method, projection, explained, state, count (points in the
    map), shown, points [{id, name, x, y, value}], color_by, legend, color_keys}. At most `limit` points:
    the `highlight` ids, then a deterministic spread of the rest (embed/serving/projection.py `spread_sample`).
    `value` is the point's given label `color_by`, or its measured test metric for `metric:<name>`; without
    `color_by` the points are coloured by their task where they have one ("" colours nothing); `color_keys`
    lists the keys the shown points can be coloured by."""
    if not 1 <= limit <= MAX_MAP_POINTS:
        raise UsageError(f"limit must be between 1 and {MAX_MAP_POINTS}, got {limit}")
    space = get_space(session, space_name)
    embedder = map_embedder(session, space.id)
    if embedder is None:
        raise NotReadyError(f"space {space.name} has no embeddings yet: run `zoo embed --space {space.name}`")
    m, state = current_map(session, data_dir, embedder)
    rows = spread_sample(m.ids, limit, np.asarray(highlight, np.int64))
    ids = m.ids[rows].tolist()
    names: dict[int, str] = {}
    keys: list[str] = []
    metric: dict[int, float] = {}
    labels: dict[int, str] = {}
    if ids:
        names = adapter_names(session, ids)
        keys = given_label_keys(session, ids)
        keys += sorted(METRIC + k for k in measured_metric_names(session, ids))
        if color_by is None:  # not asked: the task where the points have one ("" asks for no colouring)
            color_by = TASK_KEY if TASK_KEY in keys else ""
        if color_by.startswith(METRIC):
            metric = measured_metric_values(session, color_by[len(METRIC) :], ids)
        elif color_by:
            labels = given_label_values(session, color_by, ids)
    values: Mapping[int, str | float] = metric or labels
    points: list[MapPoint] = [  # a deleted adapter's point stays in the file until a refit: it has no name and is left out
        {"id": i, "name": names[i], "x": round(x, 6), "y": round(y, 6), "value": values.get(i)}
        for i, (x, y) in zip(ids, m.xy[rows].tolist(), strict=True)
        if i in names
    ]
    return {
        "space": space.name,
        "embedder_id": embedder.id,
        "method": embedder.method,
        "projection": "pca",
        "explained": list(m.projection.explained),
        "state": state,
        "count": m.count,
        "shown": len(points),
        "points": points,
        "color_by": color_by or None,
        "legend": _legend(color_by, metric, labels, len(points)),
        "color_keys": keys,
    }


def _legend(color_by: str | None, metric: dict[int, float], labels: dict[int, str], shown: int) -> MetricLegend | LabelLegend | None:
    """Labels: each value with its count among the shown points and its colour, most common first (the palette's
    first colours, the farthest apart, go to the most points); metrics: the range and the colour scale."""
    if not color_by:
        return None
    if color_by.startswith(METRIC):
        numbers = list(metric.values())
        low, high, missing = min(numbers, default=None), max(numbers, default=None), shown - len(metric)
        return {"kind": "metric", "min": low, "max": high, "missing": missing, "colours": list(SEQUENTIAL), "missing_colour": MISSING}
    counts = sorted(Counter(labels.values()).items(), key=lambda kv: (-kv[1], kv[0]))
    values: list[LabelCount] = [
        {"value": v, "count": c, "colour": colour} for (v, c), colour in zip(counts, category_colours(len(counts)), strict=True)
    ]
    return {"kind": "label", "values": values, "missing": shown - len(labels), "missing_colour": MISSING}
