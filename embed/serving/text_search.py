"""Search by meaning: a sentence finds adapters by their text, by what their weights predict of them, and by being near
in weight space to what their text found.

Five ranked lists, fused by reciprocal rank fusion (each adapter scores the sum of 1 / (RRF_K + rank) over the lists
it is in):
- full text: the catalog's own search (zoo.store.catalog: every query word in the document), why "text";
- dense text: the query's sentence vector against each adapter's document (name, given labels, tags, author, card:
  zoo.store.text_rows) in one FAISS index per catalog (embed/serving/text_index.py), why "text";
- predicted attributes: each attribute value a supervised W2T predicts for an adapter without that label given, with
  its calibrated probability at least PREDICTED_MIN, scored by the value's sentence similarity times that
  probability, why "predicted task=x (p=0.83)";
- weight-space neighbours of the first SEEDS text hits (the query engine's stored neighbours), why "near #N";
- zero-shot from the base model, only in spaces whose base the service can run (embed/serving/zero_shot.py: a text
  base it ships): adapters whose update responds more to the description's hidden states than to generic text, why
  "zero-shot (response 1.8× generic)".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from embed.serving.text_index import TextIndex, current_index, query_vector
from zoo.errors import UsageError, ZooError
from zoo.limits import DEFAULT_PER_PAGE, MAX_PER_PAGE
from zoo.store.catalog import CatalogPage, catalog_hits, facets_of, kept_ids, ranked_ids, search_catalog
from zoo.store.session import Session

if TYPE_CHECKING:
    from embed.serving.engine import QueryEngine

#: each list fused is at most this long
DEPTH = 100
#: reciprocal rank fusion's constant (its authors' value)
RRF_K = 60
#: a document enters the dense list at least this similar to the query (below, a sentence shares no more with a
#: document than any two English sentences do)
DENSE_MIN = 0.2
#: an attribute value enters the predicted list at least this similar to the query, and within PHRASE_MARGIN of the
#: most similar value of its key (given or predicted): `the qv task` names task=qv, not task=qk, though both say "task"
PHRASE_MIN = 0.3
PHRASE_MARGIN = 0.02
#: with filters, each list is searched this many times as deep before the filters keep some of it
FILTERED_WIDTH = 10
#: text hits whose weight-space neighbours are added, and neighbours per hit
SEEDS = 5
NEIGHBOURS = 5

#: where a query's sentence is encoded, beside the request's own database work
_encoder_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-encoder")


Ranked = list[tuple[int, str]]  # (adapter id, why), best first


def _dense(t: TextIndex, vector: np.ndarray, depth: int) -> Ranked:
    if t.docs.size == 0:
        return []
    scores, ids = t.docs.search(vector[None, :], depth)
    return [(int(i), "text") for s, i in zip(scores[0].tolist(), ids[0].tolist(), strict=True) if i >= 0 and s >= DENSE_MIN]


def _predicted(t: TextIndex, vector: np.ndarray, depth: int) -> Ranked:
    if not len(t.pred_ids):
        return []
    similar = t.phrase_vectors @ vector
    best: dict[str, float] = {}
    for phrase, s in zip(t.phrases, similar.tolist(), strict=True):
        key = phrase.partition("=")[0]
        best[key] = max(best.get(key, -1.0), s)
    # of each key's values only those the query names: the most similar (within PHRASE_MARGIN), if similar enough
    named = np.array(
        [s >= max(PHRASE_MIN, best[p.partition("=")[0]] - PHRASE_MARGIN) for p, s in zip(t.phrases, similar.tolist(), strict=True)]
    )
    keep = t.pred_shown & named[t.pred_phrase]
    rows = np.flatnonzero(keep)
    score = similar[t.pred_phrase[rows]] * t.pred_p[rows]
    top: dict[int, tuple[float, int]] = {}
    for r, s in zip(rows.tolist(), score.tolist(), strict=True):
        i = int(t.pred_ids[r])
        if i not in top or s > top[i][0]:
            top[i] = (s, r)
    ordered = sorted(top.items(), key=lambda kv: (-kv[1][0], kv[0]))[:depth]
    return [(i, f"predicted {t.phrases[int(t.pred_phrase[r])]} (p={float(t.pred_p[r]):.2f})") for i, (_, r) in ordered]


def _neighbours(session: Session, engine: QueryEngine, t: TextIndex, seeds: Sequence[int]) -> Ranked:
    """The weight-space neighbours of the seeds, the first seed's first (by the W2T embedding where the space has a
    predictor, else the module sketch)."""
    from zoo.store.text_rows import space_names

    if not seeds:
        return []
    spaces = space_names(session)
    base_of = t.base_of(seeds)
    found: dict[int, list[tuple[int, float]]] = {}
    for base in sorted(set(base_of.values())):
        if base not in spaces:
            continue
        mine = [s for s in seeds if base_of.get(s) == base]
        method = "w2t" if base in t.predictors else "sketch"
        try:
            found.update(engine.stored_neighbours(session, spaces[base], method, mine, NEIGHBOURS))
        except ZooError:
            continue
    return [(i, f"near #{seed}") for seed in seeds for i, _ in found.get(seed, [])]


def _zero_shot(session: Session, engine: QueryEngine, q: str, depth: int) -> Ranked:
    """The adapters of each space whose base model the service can run (embed/serving/zero_shot.py), by their response to the
    sentence relative to generic text, those above it best first; a space without a loaded module store, or past
    zero_shot.MAX_ADAPTERS, gives none."""
    from embed.serving import zero_shot
    from zoo.store.text_rows import space_names

    found: list[tuple[float, int]] = []
    for base, space in sorted(space_names(session).items()):
        if zero_shot.not_runnable(base) is not None:
            continue
        try:
            store = engine.space(session, space).modules
        except ZooError:
            continue
        if store is None or not 0 < store.stack.size <= zero_shot.MAX_ADAPTERS:
            continue
        ids = np.empty(store.stack.size, np.int64)
        ids[list(store.rows.values())] = list(store.rows.keys())
        scores = zero_shot.scores(store.stack, q)
        found += [(float(s), int(i)) for s, i in zip(scores.tolist(), ids.tolist(), strict=True) if s > 0]
    found.sort(key=lambda si: (-si[0], si[1]))
    return [(i, f"zero-shot (response {np.exp(s):.1f}× generic)") for s, i in found[:depth]]


def _kind(why: str) -> int:
    """The order reasons are told in: the adapter's own text, then what its weights predict or respond to, then its neighbours."""
    return 0 if why == "text" else 1 if why.startswith(("predicted ", "zero-shot ")) else 2


def fuse(lists: Sequence[Ranked]) -> list[tuple[int, float, list[str]]]:
    """Reciprocal rank fusion: (id, score, why) best first, `why` each list's reason, text first, then predicted
    attributes, then neighbours by their share (an adapter's first place in a list counts; ties by id)."""
    score: dict[int, float] = {}
    reasons: dict[int, dict[str, float]] = {}
    for ranked in lists:
        seen: set[int] = set()
        for rank, (adapter_id, why) in enumerate(ranked, start=1):
            if adapter_id in seen:
                continue
            seen.add(adapter_id)
            share = 1.0 / (RRF_K + rank)
            score[adapter_id] = score.get(adapter_id, 0.0) + share
            own = reasons.setdefault(adapter_id, {})
            own[why] = own.get(why, 0.0) + share
    order = sorted(score, key=lambda i: (-score[i], i))
    return [(i, score[i], [w for w, _ in sorted(reasons[i].items(), key=lambda kv: (_kind(kv[0]), -kv[1]))]) for i in order]


@dataclass(frozen=True)
class Lists:
    """A query's five lists (each best first), as the fusion takes them."""

    full_text: Ranked
    dense: Ranked
    predicted: Ranked
    near: Ranked
    zero_shot: Ranked

    def all(self) -> list[Ranked]:
        """The lists in the order they are fused."""
        return [self.full_text, self.dense, self.predicted, self.near, self.zero_shot]


def _kept(session: Session, ranked: Ranked, filters: Mapping[str, str]) -> Ranked:
    """The entries of a list whose adapters the filters keep, at most DEPTH."""
    if not filters:
        return ranked[:DEPTH]
    keep = kept_ids(session, sorted({i for i, _ in ranked}), filters)
    return [(i, why) for i, why in ranked if i in keep][:DEPTH]


def query_lists(session: Session, engine: QueryEngine, q: str, filters: Mapping[str, str]) -> Lists:
    """The lists a search by meaning fuses (see the module's doc). With filters, each list is searched FILTERED_WIDTH
    times as deep and kept to the adapters the filters keep (one indexed look-up of its ids), so a filter costs its
    lists' length, not the catalog's."""
    t = current_index(session, engine)
    encoding = _encoder_thread.submit(query_vector, q)  # while the database searches the full text
    depth = DEPTH * (FILTERED_WIDTH if filters else 1)
    full: Ranked = [(i, "text") for i in ranked_ids(session, q, filters, DEPTH)]
    vector = encoding.result()
    dense = _kept(session, _dense(t, vector, depth), filters)
    predicted = _kept(session, _predicted(t, vector, depth), filters)
    seeds = [i for i, _, _ in fuse([full, dense])[:SEEDS]]
    near = _kept(session, _neighbours(session, engine, t, seeds), filters)
    return Lists(full, dense, predicted, near, _kept(session, _zero_shot(session, engine, q, depth), filters))


def search_by_meaning(
    session: Session,
    engine: QueryEngine,
    q: str | None,
    filters: Mapping[str, str],
    sort: str | None = None,
    page: int = 1,
    per_page: int = DEFAULT_PER_PAGE,
) -> CatalogPage:
    """The catalog page of a search by meaning: the fused ranking of `q` over the adapters the filters keep, each
    result with why it matched; total and facets: the adapters ranked.
    Without query words, or with a sort other than relevance, the catalog's own search."""
    if not (q or "").strip() or sort not in (None, "relevance"):
        return search_catalog(session, q, filters, sort, page, per_page)
    if page < 1:
        raise UsageError(f"page {page}: pages count from 1")
    if not 1 <= per_page <= MAX_PER_PAGE:
        raise UsageError(f"per_page {per_page}: at least 1 and at most {MAX_PER_PAGE}")
    lists = query_lists(session, engine, str(q), filters)
    fused = fuse(lists.all())
    shown = fused[(page - 1) * per_page : page * per_page]
    why = {i: w for i, _, w in shown}
    results = catalog_hits(session, [i for i, _, _ in shown])
    for hit in results:
        hit["why"] = why[hit["id"]]
    return {
        "q": q,
        "filters": dict(filters),
        "sort": "relevance",
        "page": page,
        "per_page": per_page,
        "total": len(fused),
        "approximate": False,
        "results": results,
        "facets": facets_of(session, [i for i, _, _ in fused]),
        "semantic": True,
    }
