"""Graph imputation measured: the `--impute` part of bench/lineage.py.

The shapes-lineage zoo is stored again, in a data dir of its own per holdout, with the labels of some members held out
(`non-root`: every member made from roots, the roots keep theirs; `half`: a random half of the members, seeded); `zoo
embed` finds the edges, `zoo train` trains W2T on the labels kept (and embeds with it). Then, per held-out stored
adapter, the task from lineage (zoo.store.imputation.from_lineage, what `zoo predict` serves) is scored against the
embedding's prediction (embed.serving.resources.predict: the predictor `zoo train` chose, as served), and against labels.csv:

- (a) imputation where it answers, and its coverage (the share of held-out adapters it answers for), for five rules:
  copies only, copies and merges (the default: edges of confidence ≥ 0.5), the same from any confidence or from 0.9,
  and continuations too;
- (b) the embedding's prediction on the same adapters, and on every held-out adapter;
- (c) imputation where it answers, else the embedding's prediction, on every held-out adapter.

A task is right when it names the truth's set of tasks: a merge's task is its parents' joined by "+", so a merge's
union from lineage, or an embedding's class "a+b", is right when it names exactly those. A held-out member stored as
the duplicate of a kept one has that one's labels: it is left out. Also reported: per labels.csv column, how often the
copy a held-out adapter's task came from has its value (which labels a copy could carry, served or not).
"""

from __future__ import annotations

import csv
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lineage import TRANSFORMS, Member, ingest, share, zoo
from zoo.domain.imputation import DEFAULT_KINDS, MIN_CONFIDENCE, Kind

PROTOCOLS = ("non-root", "half")
#: the rules compared: which kinds of edge carry labels, from which confidence on
RULES: dict[str, tuple[tuple[Kind, ...], float]] = {
    "copies": (("copy",), MIN_CONFIDENCE),
    "copies+merges": (("copy", "merge"), MIN_CONFIDENCE),
    "copies+merges, any confidence": (("copy", "merge"), 0.0),
    "copies+merges, confidence ≥ 0.9": (("copy", "merge"), 0.9),
    "+continuations": (("copy", "merge", "continuation"), MIN_CONFIDENCE),
}
DEFAULT_RULE = next(name for name, rule in RULES.items() if rule == (DEFAULT_KINDS, MIN_CONFIDENCE))
#: a merge's task joins its parents' (zoo.reference.lineage.TASKS_SEP)
TASKS_SEP = "+"
#: labels.csv columns that are no label
NOT_LABELS = ("name", "test_accuracy")
#: the predictions imputation is compared with: the embedding's (the predictor `zoo train` chose; none where W2T has no
#: task head: too few labels per task), and a kNN that always answers: the similarity-weighted vote of the KNN_K nearest
#: labelled adapters by the served search score (`zoo search`)
BASELINES = ("embedding", "knn")
KNN_K = 3


def held_out(members: dict[str, Member], protocol: str, seed: int) -> set[str]:
    if protocol == "non-root":
        return {n for n, m in members.items() if m.relation != "root"}
    names = sorted(members)
    return set(random.Random(seed).sample(names, len(names) // 2))


def store(env: dict[str, str], work: Path, zoo_dir: Path, members: dict[str, Member], held: set[str]) -> tuple[dict[str, int], set[str]]:
    """The zoo stored under work with the labels of `held` left out, embedded (edges found) and W2T trained on the rest:
    name -> adapter id and the names stored as duplicates (work/trained.json marks a store that is done)."""
    work.mkdir(parents=True, exist_ok=True)
    kept = work / "labels.csv"
    with open(zoo_dir / "labels.csv", newline="") as fh, open(kept, "w", newline="") as out:
        rows = csv.DictReader(fh)
        writer = csv.DictWriter(out, fieldnames=list(rows.fieldnames or ()))
        writer.writeheader()
        writer.writerows(r for r in rows if r["name"] not in held)
    ids, duplicates, _ = ingest(env, work, zoo_dir, members, labels=kept)
    done = work / "trained.json"
    if not done.exists():
        zoo(env, "embed", "--json")
        _, stdout = zoo(env, "train", "--json")
        done.write_text(stdout)
    return ids, duplicates


def tasks_of(value: str) -> frozenset[str]:
    return frozenset(value.split(TASKS_SEP))


def inherited_tasks(found: dict[str, Any]) -> tuple[frozenset[str], str] | None:
    """The tasks from lineage (a merge's: all its values; else the first) and the kind of edge they came through (a
    merge whose parents are not all labelled: "merge, incomplete")."""
    task = found["attributes"].get("task")
    if task is None:
        return None
    values = task["values"] if task["kind"] == "merge" else task["values"][:1]
    kind = task["kind"] if task["complete"] else f"{task['kind']}, incomplete"
    return frozenset(t for v in values for t in tasks_of(v["value"])), kind


def predict(
    env: dict[str, str], ids: dict[str, int], held: set[str], members: dict[str, Member], rows: dict[str, dict[str, str]]
) -> list[dict]:
    """Per held-out stored adapter: its truth, each baseline's answer and each rule's (tasks, kind), and per copy its
    task came from (default rule), which of its labels.csv values that copy has too."""
    from embed.serving import resources
    from embed.serving.engine import QueryEngine
    from embed.serving.refs import StoredId
    from zoo.config import Settings
    from zoo.store.blobs import BlobStore
    from zoo.store.imputation import from_lineage
    from zoo.store.session import session_factory

    settings = Settings.load(env["ZOO_DATABASE_URL"], env["ZOO_DATA_DIR"])
    sessions = session_factory(settings.database_url)
    engine = QueryEngine(sessions, BlobStore(settings.blob_dir), settings.data_dir, None)
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, i in ids.items():
        by_id[i].append(name)
    out = []
    with sessions() as session:
        for i, names in sorted(by_id.items()):
            truths = {tasks_of(members[n].task) for n in names}
            if not set(names) <= held or len(truths) > 1:  # a kept member's labels are on it, or its copies disagree
                continue
            name = names[0]
            top = resources.predict(engine, session, StoredId(i))["attributes"].get("task")
            hits = resources.search(engine, session, StoredId(i), len(by_id))["results"]
            found = {rule: from_lineage(session, i, floor, kinds) for rule, (kinds, floor) in RULES.items()}
            task = found[DEFAULT_RULE]["attributes"].get("task")
            sources = [s["adapter"]["name"] for s in task["values"][0]["sources"]] if task and task["kind"] == "copy" else []
            carried = [{k: rows[s][k] == v for k, v in rows[name].items() if k in rows[s]} for s in sources]
            out.append(
                {
                    "name": name,
                    "relation": members[name].relation,
                    "truth": truths.pop(),
                    "baselines": {"embedding": tasks_of(top[0]["value"]) if top else None, "knn": knn_vote(hits)},
                    "rules": {rule: inherited_tasks(f) for rule, f in found.items()},
                    "carried": carried,
                }
            )
    return out


def knn_vote(hits: Sequence[dict]) -> frozenset[str] | None:
    """The task of the similarity-weighted vote of the KNN_K nearest labelled adapters (hits best first)."""
    votes: dict[str, float] = defaultdict(float)
    for h in [h for h in hits if "task" in h["labels"]][:KNN_K]:
        votes[h["labels"]["task"]] += max(h["score"], 0.0) + 1e-6
    return tasks_of(max(votes, key=lambda t: votes[t])) if votes else None


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Each baseline's coverage and accuracy; per rule: coverage, the accuracy of imputation and of each baseline on the
    adapters it answers for, imputation else a baseline over all, per kind of edge and per kind of member, and what
    it got wrong; per key, how often a copy carries the held-out value."""
    n = len(rows)
    ok = {b: [r["baselines"][b] == r["truth"] for r in rows] for b in BASELINES}
    answers = {b: sum(r["baselines"][b] is not None for r in rows) for b in BASELINES}
    out: dict[str, Any] = {
        "held_out": n,
        "baselines": {b: {"answered": answers[b], "accuracy": share(sum(ok[b]), n)} for b in BASELINES},
        "rules": {},
    }
    for rule in RULES:
        got = [r["rules"][rule] for r in rows]
        right = [g is not None and g[0] == r["truth"] for g, r in zip(got, rows, strict=True)]
        answered = [j for j, g in enumerate(got) if g is not None]
        by_kind: dict[str, Counter[str]] = defaultdict(Counter)
        by_member: dict[str, Counter[str]] = defaultdict(Counter)
        for j, r in enumerate(rows):
            member = by_member["transform" if r["relation"] in TRANSFORMS else r["relation"]]
            member.update(n=1, answered=int(got[j] is not None), imputation=int(right[j]), **{b: int(ok[b][j]) for b in BASELINES})
            if got[j] is not None:
                by_kind[got[j][1]].update(n=1, imputation=int(right[j]), **{b: int(ok[b][j]) for b in BASELINES})
        out["rules"][rule] = {
            "answered": len(answered),
            "coverage": share(len(answered), n),
            "imputation_accuracy": share(sum(right[j] for j in answered), len(answered)),
            "baselines_on_answered": {b: share(sum(ok[b][j] for j in answered), len(answered)) for b in BASELINES},
            "combined_accuracy": {b: share(sum(right[j] if got[j] is not None else ok[b][j] for j in range(n)), n) for b in BASELINES},
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "by_member": {k: dict(v) for k, v in sorted(by_member.items())},
            "wrong": [
                {"name": r["name"], "relation": r["relation"], "truth": sorted(r["truth"]), "imputed": sorted(g[0]), "through": g[1]}
                for r, g, good in zip(rows, got, right, strict=True)
                if g is not None and not good
            ],
        }
    carried: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        for source in r["carried"]:
            for key, same in source.items():
                carried[key].update(n=1, same=int(same))
    out["copies_carry"] = {k: {"n": c["n"], "same": share(c["same"], c["n"])} for k, c in sorted(carried.items())}
    return out


def measure(env: dict[str, str], work: Path, zoo_dir: Path, members: dict[str, Member], seed: int) -> dict[str, Any]:
    """Both holdouts: each stored in work/impute-<holdout>, predicted and scored."""
    with open(zoo_dir / "labels.csv", newline="") as fh:
        rows = {r["name"]: {k: v for k, v in r.items() if k not in NOT_LABELS and v} for r in csv.DictReader(fh)}
    out = {}
    for protocol in PROTOCOLS:
        held = held_out(members, protocol, seed)
        where = work / f"impute-{protocol}"
        mine = {**env, "ZOO_DATA_DIR": str(where / "data"), "ZOO_DATABASE_URL": f"sqlite:///{where / 'data' / 'zoo.db'}"}
        ids, _ = store(mine, where, zoo_dir, members, held)
        out[protocol] = summarize(predict(mine, ids, held, members, rows))
    return {"min_confidence": MIN_CONFIDENCE, "default_rule": DEFAULT_RULE, "holdouts": out}


def print_table(result: dict[str, Any]) -> None:
    print(f"\ngraph imputation (edges at confidence ≥ {result['min_confidence']}; default rule {result['default_rule']}):")
    for protocol, h in result["holdouts"].items():
        base = ", ".join(f"{b} {_f(v['accuracy'])} ({v['answered']} answered)" for b, v in h["baselines"].items())
        print(f"\n{protocol}: {h['held_out']} held out; over all of them: {base}")
        print("| rule | answered (coverage) | (a) imputation | (b) embedding / kNN, same adapters | (c) imputation else embedding / kNN |")
        print("| --- | --- | --- | --- | --- |")
        for rule, r in h["rules"].items():
            same, combined = r["baselines_on_answered"], r["combined_accuracy"]
            print(f"| {rule} | {r['answered']} ({_f(r['coverage'])}) | {_f(r['imputation_accuracy'])} | "
                  f"{_f(same['embedding'])} / {_f(same['knn'])} | {_f(combined['embedding'])} / {_f(combined['knn'])} |")  # fmt: skip
        everything = h["rules"]["+continuations"]
        print(f"by kind of edge (all rules' edges): {everything['by_kind']}")
        print(f"by member (default rule): {h['rules'][result['default_rule']]['by_member']}")
        print(f"wrong (with continuations): {everything['wrong']}")
        print(f"the copy a task came from has the held-out value of: {h['copies_carry']}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
