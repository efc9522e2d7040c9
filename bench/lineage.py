"""Benchmark: relations found from the weights against a shapes-lineage zoo's ground truth.

Builds a shapes-lineage zoo (`zoo make-zoo --recipe shapes-lineage`, or reuses one with --zoo), stores it with its
labels (`zoo init`, `zoo ingest ZOO --labels ZOO/labels.csv`), runs `zoo embed` (whose relation step finds and
stores the edges), reads the stored edges and scores them against labels.csv, per relation, as the goals in
docs/results.md count them:

- transforms (rescaled, cast, truncated, pruned): recall of the edge to the right parent, its type, and the
  precision of the transform edges. A child that ingest stored as a duplicate (an fp16 cast lies within the
  duplicate tolerance) has no adapter of its own: it is counted apart, with whether it was its parent's duplicate;
- merges: all parents found, and every weight within 0.05 of PEFT's;
- continuations: the parent found (a continuation edge between the two), and the direction;
- false edges: the share of pairs of unrelated roots of one task with any edge between them, and every stored edge
  that the ground truth does not hold. Edges between two copies of one root (siblings, e.g. a rescaled copy and a
  cast of it) are true relations that labels.csv does not list: they are counted as `copies of one root`, apart;
  so are edges between two members made from a common root (two merges of one root, a continuation and a merge
  of its root): related, but by no relation the detectors name;
- cost: the relation step's ms per adapter, from `zoo embed`'s report.

Relations with no direction in the weights (identical, rescaled, cast) name the older adapter as the parent, so
their edges are scored as undirected.

    python -m bench.lineage --work /tmp/lineage-bench --count 120 --seed 0 [--zoo DIR] [--rescan] [--impute] [--json]

--work holds the data dir (SQLite unless --database-url) and what a run again reuses (the build's and the ingest's
reports); --rescan drops the stored edges and scans every adapter again (after a detector change); --impute also
measures graph imputation against the embedding's predictions with labels held out (bench/imputation.py, in data dirs
of its own under --work). Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

#: relations of one update to another
TRANSFORMS = ("identical", "rescaled", "cast", "truncated", "pruned")
#: relations with no direction in the weights: scored as undirected
UNDIRECTED = frozenset({"identical", "rescaled", "cast"})
#: a merge's weight is right within this of PEFT's
WEIGHT_TOL = 0.05
#: the confidence at which precision is reported a second time
CONFIDENT = 0.5


@dataclass(frozen=True)
class Member:
    """One row of labels.csv."""

    name: str
    relation: str
    parents: tuple[str, ...]
    task: str
    weights: tuple[float, ...]
    combination: str | None
    variant: str | None


@dataclass(frozen=True)
class StoredEdge:
    child: int
    parent: int
    relation: str
    confidence: float
    parameters: dict[str, Any]


def read_members(labels: Path) -> dict[str, Member]:
    with open(labels, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {
        r["name"]: Member(
            name=r["name"],
            relation=r["relation"],
            parents=tuple(p for p in (r.get("parents") or "").split(";") if p),
            task=r["task"],
            weights=tuple(float(w) for w in (r.get("weights") or "").split(";") if w),
            combination=r.get("combination") or None,
            variant=r.get("variant") or None,
        )
        for r in rows
    }


def zoo(env: dict[str, str], *args: str) -> tuple[float, str]:
    """Run the zoo CLI; (seconds, stdout)."""
    start = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).with_name("zoo")), *args], env=env, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and args[0] != "ingest"):
        sys.exit(f"zoo {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, proc.stdout


def build(env: dict[str, str], work: Path, zoo_dir: Path | None, count: int, seed: int, workers: int) -> tuple[Path, dict]:
    """The zoo's directory and its build's figures (read from work/build.json when there)."""
    if zoo_dir is not None:
        return zoo_dir, {"reused": str(zoo_dir)}
    out, report = work / "zoo", work / "build.json"
    if report.exists():
        return out, json.loads(report.read_text())
    seconds, stdout = zoo(env, "make-zoo", str(out), "--recipe", "shapes-lineage", "--count", str(count), "--seed", str(seed),
                          "--workers", str(workers), "--json")  # fmt: skip
    built = {"seconds": seconds, "count": count, "seed": seed, "workers": workers, "report": json.loads(stdout)}
    report.write_text(json.dumps(built))
    return out, built


def ingest(
    env: dict[str, str], work: Path, zoo_dir: Path, members: dict[str, Member], labels: Path | None = None
) -> tuple[dict[str, int], set[str], float]:
    """name -> adapter id (a duplicate's: the stored adapter it duplicates), the names stored as duplicates, and the
    ingest's seconds; from work/ingest.json when there. The labels are labels.csv's unless `labels` names others."""
    report = work / "ingest.json"
    if not report.exists():
        zoo(env, "init")
        seconds, stdout = zoo(env, "ingest", "--no-embed", str(zoo_dir), "--labels", str(labels or zoo_dir / "labels.csv"), "--json")
        lines = [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]
        report.write_text(json.dumps({"seconds": seconds, "lines": lines}))
    saved = json.loads(report.read_text())
    ids, duplicates = {}, set()
    for line in saved["lines"]:
        name = next((part for part in Path(line["source"]).parts if part in members), None)
        if name is None or line["status"] == "failed":
            continue
        ids[name] = int(line["adapter_id"])
        if line["status"] == "duplicate":
            duplicates.add(name)
    return ids, duplicates, float(saved["seconds"])


def embed(env: dict[str, str], work: Path, database_url: str, rescan: bool) -> tuple[float, dict]:
    """`zoo embed`'s seconds and its relation report (after dropping every edge and scan with `rescan`); those of the
    run that scanned (work/embed.json) when nothing was left to scan."""
    if rescan:
        from sqlalchemy import delete

        from zoo.store.models import AdapterRelation, RelationScan
        from zoo.store.session import session_factory

        with session_factory(database_url).begin() as session:
            session.execute(delete(AdapterRelation))
            session.execute(delete(RelationScan))
    seconds, stdout = zoo(env, "embed", "--json")
    reports = json.loads(stdout)
    relations = reports[0]["relations"] if reports else {}
    saved = work / "embed.json"
    if relations.get("scanned"):
        saved.write_text(json.dumps({"seconds": seconds, "relations": relations}))
    elif saved.exists():  # nothing left to scan: the run that scanned
        return json.loads(saved.read_text())["seconds"], json.loads(saved.read_text())["relations"]
    return seconds, relations


def stored_edges(database_url: str) -> list[StoredEdge]:
    from sqlalchemy import select

    from zoo.store.models import AdapterRelation
    from zoo.store.session import session_factory

    with session_factory(database_url)() as session:
        return [
            StoredEdge(r.child_id, r.parent_id, r.relation, float(r.confidence), dict(r.parameters or {}))
            for r in session.scalars(select(AdapterRelation))
        ]


class Truth:
    """The ground truth at the level of stored adapters."""

    def __init__(self, members: dict[str, Member], ids: dict[str, int]) -> None:
        self.members, self.ids = members, ids
        self.names: dict[int, list[str]] = defaultdict(list)
        for name, i in ids.items():
            self.names[i].append(name)
        # a transform's root, else the member itself: copies of one root are related though labels.csv lists no edge
        self.root = {n: m.parents[0] if m.relation in TRANSFORMS else n for n, m in members.items()}
        # the roots a member is made from (a root: itself)
        self.roots = {n: set(m.parents) or {n} for n, m in members.items()}

    def listed(self, e: StoredEdge) -> Member | None:
        """The child of labels.csv whose edge to its parent this stored edge is (either way for undirected ones)."""
        for c in self.names[e.child]:
            for p in self.names[e.parent]:
                for child, parent in ((c, p), (p, c)):
                    if parent in self.members[child].parents:
                        return self.members[child]
        return None

    def kind(self, e: StoredEdge) -> str:
        """true (the listed pair, right type and direction), reversed, of another type ("a merge found as cast"),
        copies of one root, made from a common root (e.g. two merges of one root, not listed), or false."""
        m = self.listed(e)
        if m is not None:
            undirected = e.relation in UNDIRECTED or m.relation in UNDIRECTED
            forward = m.name in self.names[e.child]
            if m.relation != e.relation:
                return f"a {m.relation} found as {e.relation}"
            return "true" if forward or undirected else "reversed"
        if any(self.root[c] == self.root[p] for c in self.names[e.child] for p in self.names[e.parent]):
            return "copies of one root"
        if any(self.roots[c] & self.roots[p] for c in self.names[e.child] for p in self.names[e.parent]):
            return "made from a common root"
        return "false"


def share(hits: int, n: int) -> float | None:
    return hits / n if n else None


def score(members: dict[str, Member], ids: dict[str, int], duplicates: set[str], edges: list[StoredEdge]) -> dict:
    truth = Truth(members, ids)
    between: dict[frozenset[int], list[StoredEdge]] = defaultdict(list)
    for e in edges:
        between[frozenset((e.child, e.parent))].append(e)

    def pair(a: str, b: str) -> list[StoredEdge]:
        return between.get(frozenset((ids[a], ids[b])), []) if a in ids and b in ids else []

    out: dict[str, Any] = {"members": dict(Counter(m.relation for m in members.values())), "stored": len(set(ids.values()))}
    # transforms
    rows, counts = {}, Counter[str]()
    for relation in TRANSFORMS[1:]:
        kids = [m for m in members.values() if m.relation == relation]
        stored = [m for m in kids if m.name not in duplicates]
        found = [m for m in stored if any(e.relation in TRANSFORMS for e in pair(m.name, m.parents[0]))]
        typed = [m for m in found if any(e.relation == relation for e in pair(m.name, m.parents[0]))]
        dup_of_parent = [m for m in kids if m.name in duplicates and ids[m.name] == ids.get(m.parents[0])]
        counts.update(stored=len(stored), found=len(found), typed=len(typed))
        rows[relation] = {
            "children": len(kids),
            "stored_as_duplicate": len(kids) - len(stored),
            "duplicate_of_parent": len(dup_of_parent),
            "recall": share(len(found), len(stored)),
            "type_correct": share(len(typed), len(found)),
            "misses": [m.name for m in stored if m not in found],
        }
    transform_edges = [e for e in edges if e.relation in TRANSFORMS]
    kinds = Counter(truth.kind(e) for e in transform_edges)
    right_pair = sum(1 for e in transform_edges if (m := truth.listed(e)) is not None and m.relation in TRANSFORMS)
    out["transforms"] = {
        "by_relation": rows,
        "recall": share(counts["found"], counts["stored"]),
        "type_correct": share(counts["typed"], counts["found"]),
        "edges": len(transform_edges),
        "edge_kinds": dict(kinds),
        "precision": share(right_pair, len(transform_edges)),
        "precision_with_copies": share(len(transform_edges) - kinds["false"], len(transform_edges)),
    }
    # merges
    merges = [m for m in members.values() if m.relation == "merge" and m.name not in duplicates]
    by_combination: dict[str, Counter[str]] = defaultdict(Counter)
    misses = []
    for m in merges:
        parents = {p: e for e in edges if e.relation == "merge" and e.child == ids[m.name] for p in truth.names[e.parent]}
        c = by_combination[m.combination or "?"]
        c["n"] += 1
        if all(p in parents for p in m.parents):
            c["all_parents"] += 1
            c["exact_parents"] += len({ids[p] for p in m.parents}) == len({e.parent for e in parents.values()})
            weights = zip(m.parents, m.weights, strict=True)
            c["weights"] += all(abs(parents[p].parameters.get("weight", -1) - w) <= WEIGHT_TOL for p, w in weights)
        else:
            misses.append(m.name)
    total = sum(by_combination.values(), Counter())
    out["merges"] = {
        "n": total["n"],
        "all_parents": share(total["all_parents"], total["n"]),
        "exact_parents": share(total["exact_parents"], total["n"]),
        "weights": share(total["weights"], total["n"]),
        "by_combination": {k: dict(v) for k, v in sorted(by_combination.items())},
        "misses": misses,
    }
    # continuations
    conts = [m for m in members.values() if m.relation == "continuation" and m.name not in duplicates]
    by_variant: dict[str, Counter[str]] = defaultdict(Counter)
    for m in conts:
        c, es = by_variant[m.variant or "?"], pair(m.name, m.parents[0])
        cont = [e for e in es if e.relation == "continuation"]
        c["n"] += 1
        c["parent"] += bool(cont)
        c["direction"] += any(e.child == ids[m.name] for e in cont)
        c["any_edge"] += bool(es)
    total = sum(by_variant.values(), Counter())
    out["continuations"] = {
        "n": total["n"],
        "parent_found": share(total["parent"], total["n"]),
        "direction_right": share(total["direction"], total["n"]),
        "direction_right_of_found": share(total["direction"], total["parent"]),
        "any_edge": share(total["any_edge"], total["n"]),
        "by_variant": {k: dict(v) for k, v in sorted(by_variant.items())},
        "duplicates": sum(m.name in duplicates for m in members.values() if m.relation == "continuation"),
    }
    # false edges: pairs of roots of one task (unrelated: a root has no parent), and every edge by what it is
    roots = [m for m in members.values() if m.relation == "root" and m.name in ids]
    pairs = [(a, b) for a, b in combinations(roots, 2) if a.task == b.task and ids[a.name] != ids[b.name]]
    hit = [(a.name, b.name, sorted({e.relation for e in pair(a.name, b.name)})) for a, b in pairs if pair(a.name, b.name)]
    out["unrelated"] = {"pairs": len(pairs), "with_edge": len(hit), "share": share(len(hit), len(pairs)), "edges": hit}
    per_relation = {}
    for relation in sorted({e.relation for e in edges}):
        mine = [e for e in edges if e.relation == relation]
        sure = [e for e in mine if e.confidence >= CONFIDENT]
        kinds = Counter(truth.kind(e) for e in mine)
        per_relation[relation] = {
            "edges": len(mine),
            "kinds": dict(kinds),
            "precision": share(kinds["true"], len(mine)),
            "confident": len(sure),
            "precision_confident": share(sum(truth.kind(e) == "true" for e in sure), len(sure)),
        }
    out["edges"] = per_relation
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(result: dict) -> None:
    t, m, c, u = result["transforms"], result["merges"], result["continuations"], result["unrelated"]
    print(f"members {result['members']}; stored adapters {result['stored']}")
    print(f"build {result['build'].get('seconds', result['build'].get('reused'))}; ingest {result['ingest_s']:.1f} s;", end=" ")
    print(f"embed + relation step {result['embed_s']:.1f} s")
    print("\n| relation | goal | measured |\n| --- | --- | --- |")
    measured = f"{fmt(t['precision'])} / {fmt(t['recall'])}, {fmt(t['type_correct'])}"
    print(f"| transforms: precision / recall, type | ≥ 0.98 / ≥ 0.95, ≥ 0.95 | {measured} |")
    measured = f"{fmt(m['all_parents'])} / {fmt(m['weights'])} (n={m['n']})"
    print(f"| merges: all parents / weights within {WEIGHT_TOL} | ≥ 0.90 / ≥ 0.90 | {measured} |")
    print(f"| continuations: parent / direction | ≥ 0.80 / ≥ 0.80 | {fmt(c['parent_found'])} / {fmt(c['direction_right'])} (n={c['n']}) |")
    print(f"| false edges, unrelated same-task roots | ≤ 1 % | {u['with_edge']}/{u['pairs']} = {fmt(u['share'])} |")
    print(f"| relation step, ms per adapter | ≤ 50 (at 1M) | {fmt(result['ms_per_adapter'])} |")
    print("\ntransforms by relation (children, stored as duplicates [of their parent], recall, type correct, misses):")
    for relation, r in t["by_relation"].items():
        print(f"  {relation:10s} {r['children']:3d}  dup {r['stored_as_duplicate']} [{r['duplicate_of_parent']}]  "
              f"recall {fmt(r['recall'])}  type {fmt(r['type_correct'])}  {' '.join(r['misses'])}")  # fmt: skip
    print(f"  transform edges {t['edges']}: {t['edge_kinds']}; precision with copies of one root {fmt(t['precision_with_copies'])}")
    print(f"merges by combination: {m['by_combination']}; exact parent sets {fmt(m['exact_parents'])}; misses {' '.join(m['misses'])}")
    print(f"continuations by variant: {c['by_variant']}; any edge to the parent {fmt(c['any_edge'])}")
    print(f"unrelated same-task roots with an edge: {u['edges']}")
    print(f"\nstored edges by relation (precision: the listed pair, type and direction; at confidence ≥ {CONFIDENT}):")
    for relation, r in result["edges"].items():
        print(f"  {relation:12s} {r['edges']:3d}  {r['kinds']}  precision {fmt(r['precision'])}  "
              f"confident {r['confident']} precision {fmt(r['precision_confident'])}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="the data dir and the saved reports (reused when there)")
    p.add_argument("--zoo", type=Path, default=None, help="an existing shapes-lineage zoo (default: build one under --work)")
    p.add_argument("--count", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--database-url", default=None, help="default: SQLite in --work/data")
    p.add_argument("--rescan", action="store_true", help="drop the stored edges and scan every adapter again")
    p.add_argument("--impute", action="store_true", help="also measure graph imputation against the embedding (bench/imputation.py)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data"
    database_url = args.database_url or f"sqlite:///{data / 'zoo.db'}"
    env = {**os.environ, "ZOO_DATA_DIR": str(data), "ZOO_DATABASE_URL": database_url}
    zoo_dir, built = build(env, args.work, args.zoo, args.count, args.seed, args.workers)
    members = read_members(zoo_dir / "labels.csv")
    ids, duplicates, ingest_s = ingest(env, args.work, zoo_dir, members)
    embed_s, relations = embed(env, args.work, database_url, args.rescan)
    result = score(members, ids, duplicates, stored_edges(database_url))
    result |= {"build": built, "ingest_s": ingest_s, "embed_s": embed_s, "ms_per_adapter": relations.get("ms_per_adapter"),
               "scanned": relations.get("scanned"), "failed": relations.get("failed")}  # fmt: skip
    if not args.json:
        print_table(result)
    if args.impute:
        from bench import imputation

        result["imputation"] = imputation.measure(env, args.work, zoo_dir, members, args.seed)
        if not args.json:
            imputation.print_table(result["imputation"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
