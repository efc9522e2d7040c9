"""An adapter's lineage: the tree of base models it derives from (as its source and stored adapters describe
them), its versions, and the other adapters of its base model, author and source. One plain dict, read with
indexed look-ups only (primary key, source URI, author, base model), so it costs the same in a zoo of a million.

A model's description is `card_base_model` (the base models its card names) and `base_model_relation` (adapter,
finetune, merge, quantized), as a Hub source stores them in an adapter's `source_metadata`. A base model is
described by the newest stored adapter whose source is `hf://<base model>`, else by the entry for it in the
adapter's own `source_metadata["base_model_tree"]` ({model id: description}) when its source recorded one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Select, SQLColumnExpression, func, literal_column, select
from sqlalchemy.orm import Session, aliased

from zoo.errors import NotFoundError
from zoo.store.models import Adapter, named_base_model
from zoo.store.relations import from_weights
from zoo.store.rows import columns

#: a Hub source's URI prefix: the stored adapter of Hub model `owner/name` has the source `hf://owner/name`
HUB_PREFIX = "hf://"
#: base-model levels followed upward, and base models in one tree
MAX_DEPTH = 8
MAX_NODES = 64
#: adapters listed per group (and versions each way)
RELATED = 20
#: a group's count stops here (its index range is read no further)
COUNT_CAP = 1_000

_SUMMARY = select(
    Adapter.id,
    Adapter.name,
    Adapter.author,
    Adapter.base_model,
    Adapter.source_uri,
    Adapter.source_revision,
    Adapter.created_at,
    Adapter.source_metadata["last_modified"].as_string().label("last_modified"),
)


def lineage(session: Session, adapter_id: int, limit: int = RELATED) -> dict[str, Any]:
    """The lineage resource of one adapter: itself, `base_models` (a tree), `versions` (older and newer, nearest
    first), the groups `same_base_model`, `same_author`, `same_source` (each: value, total other adapters,
    whether the total was capped at COUNT_CAP, and the newest `limit` of them), and `from_weights`: the relations
    found from the weights (zoo.store.relations.from_weights), beside the card's."""
    me = session.execute(_SUMMARY.add_columns(Adapter.source_metadata.label("meta")).where(Adapter.id == adapter_id)).one_or_none()
    if me is None:
        raise NotFoundError(f"no adapter with id {adapter_id}")
    meta = me.meta if isinstance(me.meta, dict) else {}
    bases, relation = _description(meta)
    named = named_base_model(me.base_model)
    if named is not None:
        bases = list(dict.fromkeys([named, *bases]))
    own = me.source_uri.removeprefix(HUB_PREFIX) if me.source_uri.startswith(HUB_PREFIX) else None
    recorded = meta.get("base_model_tree")
    return {
        "adapter": {**_summary(me), "relation": relation},
        "base_models": _base_model_tree(session, bases, relation, own, recorded if isinstance(recorded, dict) else {}),
        "versions": {
            "older": _summaries(session, _older(session, adapter_id, limit)),
            "newer": _summaries(session, _newer(session, adapter_id, me.source_uri, limit)),
        },
        "same_base_model": _group(session, Adapter.base_model, named, adapter_id, limit),
        "same_author": _group(session, Adapter.author, me.author, adapter_id, limit),
        "same_source": _group(session, Adapter.source_uri, me.source_uri, adapter_id, limit),
        "from_weights": from_weights(session, adapter_id, relation),
        "limit": limit,
    }


def _description(meta: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """(base models, relation) from a model's description; anything malformed counts as absent."""
    named = meta.get("card_base_model")
    named = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    bases = list(dict.fromkeys(b.strip() for b in named if isinstance(b, str) and b.strip()))
    relation = meta.get("base_model_relation")
    return bases, relation if isinstance(relation, str) and relation else None


def _node(model: str, relation: str | None) -> dict[str, Any]:
    node: dict[str, Any] = {"model": model, "relation": relation, "adapter_id": None, "described_by": None}
    return {**node, "cycle": False, "truncated": False, "base_models": []}


def _base_model_tree(
    session: Session, bases: list[str], relation: str | None, own: str | None, recorded: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The base models (each with its own base models, upward) level by level, one query per level. A model that
    is already its own descendant is marked `cycle` and not followed; past MAX_DEPTH levels or MAX_NODES models
    a node is marked `truncated`."""
    roots = [_node(b, relation) for b in bases]
    frontier = [(node, frozenset({own} if own else ())) for node in roots]
    count, depth = len(roots), 1
    while frontier:
        stored = _stored_descriptions(session, {node["model"] for node, _ in frontier})
        following = []
        for node, below in frontier:
            model = node["model"]
            if model in stored:
                node["adapter_id"], description = stored[model]
                node["described_by"] = "stored"
            elif isinstance(recorded.get(model), dict):
                description, node["described_by"] = recorded[model], "recorded"
            else:
                continue
            if model in below:
                node["cycle"] = True
                continue
            parents, parent_relation = _description(description)
            if parents and (depth >= MAX_DEPTH or count + len(parents) > MAX_NODES):
                node["truncated"] = True
                continue
            count += len(parents)
            for parent in parents:
                node["base_models"].append(_node(parent, parent_relation))
                following.append((node["base_models"][-1], below | {model}))
        frontier, depth = following, depth + 1
    return roots


def _stored_descriptions(session: Session, models: Iterable[str]) -> dict[str, tuple[int, dict[str, Any]]]:
    """{model id: (adapter id, source metadata)} of the newest stored adapter from each model's Hub URI."""
    uris = [HUB_PREFIX + m for m in models]
    stmt = select(Adapter.id, Adapter.source_uri, Adapter.source_metadata).where(Adapter.source_uri.in_(uris)).order_by(Adapter.id)
    return {uri.removeprefix(HUB_PREFIX): (i, m if isinstance(m, dict) else {}) for i, uri, m in session.execute(stmt)}


def _older(session: Session, adapter_id: int, limit: int) -> list[int]:
    """The chain of previous versions, nearest first (by primary key; a cycle ends it)."""
    chain = (
        select(Adapter.id, Adapter.previous_version_id, literal_column("0").label("depth"))
        .where(Adapter.id == adapter_id)
        .cte("older", recursive=True)
    )
    prev = aliased(Adapter)
    step = select(prev.id, prev.previous_version_id, chain.c.depth + literal_column("1"))
    chain = chain.union_all(step.join(chain, prev.id == chain.c.previous_version_id).where(chain.c.depth < limit))
    return _until_repeated(session.scalars(select(chain.c.id).order_by(chain.c.depth)))[1:]


def _newer(session: Session, adapter_id: int, source_uri: str, limit: int) -> list[int]:
    """The versions that name this one as previous, then theirs, nearest first: a new version comes from the same
    source, so each step is a look-up by source URI."""
    chain = select(Adapter.id, literal_column("0").label("depth")).where(Adapter.id == adapter_id).cte("newer", recursive=True)
    nxt = aliased(Adapter)
    step = select(nxt.id, chain.c.depth + literal_column("1")).join(chain, nxt.previous_version_id == chain.c.id)
    chain = chain.union_all(step.where(nxt.source_uri == source_uri, chain.c.depth < limit))
    ids = session.scalars(select(chain.c.id).order_by(chain.c.depth, chain.c.id).limit(limit + 1))
    return _until_repeated(ids)[1:]


def _until_repeated(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i in out:
            break
        out.append(i)
    return out


def _summary(row: Any) -> dict[str, Any]:
    return columns(row, ("id", "name", "author", "base_model", "source_uri", "source_revision", "created_at", "last_modified"))


def _summaries(session: Session, ids: list[int]) -> list[dict[str, Any]]:
    """Summaries of these adapters, in the order given."""
    if not ids:
        return []
    rows = {r.id: _summary(r) for r in session.execute(_SUMMARY.where(Adapter.id.in_(ids)))}
    return [rows[i] for i in ids if i in rows]


def _group(session: Session, column: SQLColumnExpression[Any], value: str | None, adapter_id: int, limit: int) -> dict[str, Any]:
    """The other adapters with this value in an indexed column: their count (capped) and the newest `limit`."""
    if value is None:
        return {"value": None, "total": 0, "capped": False, "adapters": []}
    same = column == value
    counted = select(literal_column("1")).where(same).limit(COUNT_CAP + 2).subquery()
    n = int(session.scalar(select(func.count()).select_from(counted)) or 0) - 1  # the adapter itself is one of them
    stmt: Select = _SUMMARY.where(same, Adapter.id != adapter_id).order_by(Adapter.id.desc()).limit(limit)
    return {
        "value": value,
        "total": min(n, COUNT_CAP),
        "capped": n > COUNT_CAP,
        "adapters": [_summary(r) for r in session.execute(stmt)],
    }
