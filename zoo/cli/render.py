"""How the `zoo` command prints: numbers, probabilities and plurals as a person reads them, JSON for scripts, and the
lines of the reports several commands print."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zoo.reference.build import ZooReport
    from zoo.runners.worker import WorkerSummary
    from zoo.services.relations import RelationReport
    from zoo.store.imputation import FromLineage, Source
    from zoo.store.job_resources import JobDetail, JobSummary


def print_json(obj: object) -> None:
    print(json.dumps(obj, default=str))


def human(value: object) -> str:
    """A value as a person reads it: numbers to 4 significant digits, lists joined, nothing as "-"."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(human(v) for v in value)
    return str(value)


def percent(p: float) -> str:
    """A probability as a person reads it: `62%`, never a rounded `100%` or `0%` (`>99%`, `<1%`)."""
    return ">99%" if p >= 0.995 else "<1%" if p < 0.005 else f"{p:.0%}"


def plural(n: object, word: str) -> str:
    """`1 problem`, `3 problems`."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None, indent: str = "") -> list[str]:
    """Rows under a header, each column as wide as its widest cell and two spaces apart; `right`: which columns are
    right-aligned (numbers; default: every column but the first). Cells are shown as `human` shows them."""
    cells = [[c if isinstance(c, str) else human(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(header)]
    right = right if right is not None else [i > 0 for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return indent + "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)).rstrip()

    return [line(list(header)), *(line(row) for row in cells)]


def label_columns(rows: Sequence[dict[str, str]]) -> tuple[list[str], list[list[str]]]:
    """Given labels as table columns: `task` when any row has one, then the others compactly (`lang=en, size=s`)
    when any row has them; ([], [[]...]) when none has labels."""
    has_task = any("task" in labels for labels in rows)
    has_other = any(k != "task" for labels in rows for k in labels)
    header = ["task"] * has_task + ["labels"] * has_other
    cells = [
        [labels.get("task", "-")] * has_task + [", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "task") or "-"] * has_other
        for labels in rows
    ]
    return header, cells


def map_text(how: str) -> str:
    """What `zoo embed` did to a space's map (embed.serving.maps.update_map's `how`), as a person reads it: a first map is
    news, not an error."""
    if how.startswith("fitted (no map file "):
        return f"fitted a new one, saved to {how.removeprefix('fitted (no map file ').removesuffix(')')}"
    if how == "fitted (asked)":
        return "fitted again, as asked"
    if how.startswith("fitted (") and how.endswith(")"):
        return f"fitted again and saved (the old file: {how.removeprefix('fitted (')[:-1]})"
    return how


def duration(seconds: float) -> str:
    """A rough duration: `40 s`, `about 3 min` (rounded up)."""
    return f"{max(1, round(seconds))} s" if seconds < 90 else f"{-(-seconds // 60):.0f} min"


#: `zoo eval`'s measures by what they measure, each group one table
EVAL_GROUPS = (
    (
        "task prediction (each held-out adapter's task, from the labelled training adapters)",
        ("attr_acc", "attr_macro_f1", "attr_ece", "attr_wrong_at_100"),
    ),
    ("test-accuracy prediction (mean absolute error, rank correlations)", ("perf_mae", "perf_spearman", "perf_kendall")),
    ("retrieval (each held-out adapter a query; relevant: an adapter of the same task)", ("hit@1", "hit@10", "mrr", "ndcg@10")),
)
EVAL_ROWS = (
    "rows: default is what `zoo search` and `zoo predict` do after `zoo train`; dw_cosine, module_cosine, "
    "input_gram_cosine (of the input Grams dWᵀdW), centred_gram_cosine (the input Grams less the labelled adapters' "
    "mean) and module_centred_cosine (module and centred Gram cosine averaged) compare the updates exactly, with "
    "nothing learned; w2t_* are the learned "
    "embedding alone (a W2T row below dw_cosine: on this zoo the embedding alone finds same-task adapters less well than "
    "the plain cosine of the updates)"
)


def _cell(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def eval_lines(result: dict) -> list[str]:
    """`zoo eval`'s result (embed.training.eval_summary.summarize: one split, or several: mean ± std) as tables per group of
    measures, each split's choices and checks, the line that names the method leading on the main measure, and the
    paired table (paired_lines)."""
    splits = result.get("splits", [result])
    spread = result.get("methods_std")
    seeds = ", ".join(str(r["seed"]) for r in splits)
    sizes = f"{result['n_train']} train, {result['n_test']} test adapters"
    head = f"space {result['space']} ({result.get('protocol', 'full labels')}; W2T {result.get('objective', 'supervised')}): {sizes}"
    lines = [f"{head}; {'split seeds' if spread else 'split seed'} {seeds}" + ("; mean ± std over the splits" if spread else "")]
    for title, keys in EVAL_GROUPS:
        rows = [[name, *(_cell(row[k], spread[name][k] if spread else None) for k in keys)] for name, row in result["methods"].items()]
        lines += ["", f"{title}:", *table(["method", *keys], rows, indent="  ")]
    lines.append("")
    for r in splits:
        prefix = f"seed {r['seed']}: " if spread else ""
        corr, inv = r["sketch_vs_exact_cosine_corr"], r["invariance_min_cosine"]
        lines.append(f"{prefix}module sketch vs exact module cosine, correlation over pairs: {'-' if corr is None else f'{corr:.3f}'}")
        lines.append(f"{prefix}invariance (re-factorized with random G), min cosine: {'-' if inv is None else f'{inv:.6f}'}")
        for target, c in r["choices"].items():
            lines.append(f"{prefix}{target} by {c['chosen']} (out of fold: {c['reason']})")
    return [*lines, "", EVAL_ROWS, comparison_line(result.get("comparison"), lead=True), "", *paired_lines(result)]


def interval_text(c: dict | None) -> str:
    """A paired difference with its interval: `+0.076 [+0.060, +0.091]`; `-` for none."""
    if not c:
        return "-"
    shown = f"{c.get('difference', c.get('mean')):+.3f}"
    return shown if c["low"] is None else f"{shown} [{c['low']:+.3f}, {c['high']:+.3f}]"


#: the rows of `zoo eval`'s paired table
PAIRED_KEYS = ("hit@1", "mrr", "ndcg@10", "attr_acc", "perf_spearman")


def paired_lines(result: dict) -> list[str]:
    """`zoo eval`'s paired table: per measure the default − dw_cosine and the search choice's cross-fitted regret, each
    with its 95 % interval (embed.training.eval_summary.summarize), then the default's performance Spearman against the best
    training-free kNN."""
    versus = result.get("default_versus", {}).get("dw_cosine", {})
    regret = result.get("search_regret", {})
    rows = [[k, interval_text(versus.get(k)), interval_text(regret.get(k))] for k in PAIRED_KEYS]
    any_row = next((c for c in versus.values() if c), None)
    lines = [
        "default (what `zoo search` and `zoo predict` serve) against dw_cosine, paired, and the search regret (the search "
        "chosen on the other splits, fixed, minus the one served: positive where it retrieves better), with 95 % intervals"
        + (f" over {plural(any_row['splits'], 'split')} × {plural(any_row['tasks'], 'query task')}" if any_row and any_row["tasks"] else "")
        + " (perf_spearman: over the splits):",
        *table(["measure", "default − dw_cosine", "search regret"], rows, indent="  "),
    ]
    if not regret:
        lines.append("  (the regret needs two splits or more; --splits 10 gives intervals worth reading)")
    best = result.get("spearman_versus_best_knn")
    if best:
        lines.append(f"perf_spearman, default − {best['second']} (the best training-free kNN here): {interval_text(best)}")
    c = result.get("calibration")
    if c:
        lines.append(
            f"attr_ece of the served task probabilities: {c['splits_mean']:.3f} the splits' mean (a calibrated predictor's, by chance "
            f"alone: {c['floor']:.3f}), {c['pooled']:.3f} over all {c['queries']} queries pooled"
        )
    return lines


def comparison_line(c: dict | None, lead: bool = False) -> str:
    """A paired comparison of two methods (embed.training.eval_summary.compare) in words: who is ahead, by how much, and whether the
    95 % interval says so (`lead`: the first is the best method, the second the runner-up)."""
    if not c:
        return "no two methods to compare" if lead else "default or dw_cosine has no value to compare"
    metric, first, second, diff = c["metric"], c["first"], c["second"], c["difference"]
    same = f" ({', '.join(c['same_as_first'])}: the same as {first} here)" if c.get("same_as_first") else ""
    ahead = f"{first} leads {second} by {diff:.3f}" if lead else f"{first} against {second}: {diff:+.3f}"
    if c["low"] is None:
        return f"on {metric}, {ahead} on this one split{same}; --splits 10 gives a 95 % interval"
    if c["low"] == c["high"] == diff == 0:
        return f"{first} and {second} score alike on {metric} on every query{same}"
    over = plural(c["splits"], "split") + (f" × {plural(c['tasks'], 'query task')}" if c.get("tasks") else "")
    interval = f"95 % paired interval, bootstrap over {over}, {c['low']:+.3f}..{c['high']:+.3f}"
    if not c["clear"]:
        return f"no clear winner on {metric}: {ahead}, but the {interval} includes 0{same}"
    winner, loser = (first, second) if diff > 0 else (second, first)
    return f"{winner} wins on {metric} over {loser} by {abs(diff):.3f} ({interval}){same}"


def print_zoo_report(report: ZooReport) -> None:
    acc = report["accuracy"]["overall"]
    per = report["train_seconds_per_adapter"]
    print(
        f"{plural(report['count'], report['recipe'] + ' adapter')} in {report['out_dir']} ({report['built']} built, "
        f"{report['skipped']} already there) in {report['seconds']:.0f} s"
        + (f", {per:.2f} s of training each on {plural(report['cpu_kernels'], 'CPU kernel')}" if per else "")
        + f"; {report['disk_bytes'] / 2**20:.1f} MiB"
    )
    print(f"test accuracy: mean {acc['mean']:.3f}, std {acc['std']:.3f}, range {acc['min']:.3f}..{acc['max']:.3f}")
    tasks = report["accuracy"]["by"].get("task", {})
    if tasks:
        print(f"  {'task':<16} {'adapters: mean':>14}  {'range':<12} {'n':>3}  {'chance':>6}  {'base model alone':>16}")
    for value, s in tasks.items():
        base = f"{s['base']:.3f}" if s.get("base") is not None else "-"
        print(f"  {value:<16} {s['mean']:>14.3f}  {s['min']:.3f}..{s['max']:.3f} {s['n']:>3}  {s['chance']:>6.3f}  {base:>16}")
    if tasks:
        print("  (held-out test accuracy; docs/reference-zoos.md says why some tasks stay low)")


def lineage_lines(found: dict) -> list[str]:
    """The lineage resource as a readable tree."""

    def ref(a: dict) -> str:
        by = f"  by {a['author']}" if a["author"] else ""
        at = f"  @ {a['source_revision'][:12]}" if a["source_revision"] else ""
        return f"#{a['id']} {a['name']}{by}{at}"

    def tree(nodes: list[dict], indent: str) -> list[str]:
        out = []
        for i, n in enumerate(nodes):
            last = i == len(nodes) - 1
            notes = [f"stored as #{n['adapter_id']}" if n["adapter_id"] else ""]
            notes += ["cycle: not followed" if n["cycle"] else "", "more above, not shown" if n["truncated"] else ""]
            shown = ", ".join(x for x in notes if x)
            of = f"{n['relation']} of " if n["relation"] else ""
            out.append(f"{indent}{'└─' if last else '├─'} {of}{n['model']}{f'  ({shown})' if shown else ''}")
            out += tree(n["base_models"], indent + ("   " if last else "│  "))
        return out

    me = found["adapter"]
    lines = [f"{ref(me)}  {me['source_uri']}", "base models:"]
    lines += tree(found["base_models"], "  ") or ["  none known"]
    older, newer = found["versions"]["older"], found["versions"]["newer"]
    if older or newer:
        lines.append("versions (oldest first):")
        for a, mark in [*((a, "") for a in reversed(older)), (me, "  ← this one"), *((a, "") for a in newer)]:
            when = a["last_modified"] or a["created_at"] or ""
            lines.append(f"  {ref(a)}  {when}{mark}")
    for key, title in (("same_base_model", "same base model"), ("same_author", "same author"), ("same_source", "same source")):
        group = found[key]
        if group["value"] is None:
            continue
        total = f"{group['total']}{'+' if group['capped'] else ''}"
        shown = f", the newest {len(group['adapters'])}" if len(group["adapters"]) < group["total"] else ""
        lines.append(f"{title} {group['value']}: {total} other{'' if group['total'] == 1 else 's'}{shown}")
        lines += [f"  {ref(a)}" for a in group["adapters"]]
    return lines + from_weights_lines(found["from_weights"])


def edge_text(e: dict) -> str:
    """One edge's relation and parameters, as a person reads them."""
    p = e["parameters"]
    what = {
        "rescaled": f"× {p.get('scale', 0):.4g}",
        "cast": f"{p.get('precision') or '?'}" + (f", × {p['scale']:.4g}" if "rescaled" in p.get("steps", []) else ""),
        "truncated": "to rank " + ",".join(str(k) for k in sorted(set((p.get("kept_rank") or {}).values()))),
        "pruned": f"{100 * p.get('sparsity', 0):.1f} % zeros",
        "merge": f"weight {p.get('weight', 0):.3g}, {p.get('combination')}, one of {p.get('parents')} parents",
        "continuation": f"direction {percent(p.get('direction_confidence', 0))} sure",
    }.get(e["relation"], "")
    return f"{e['relation']}{f' ({what})' if what else ''}"


def from_weights_lines(w: dict) -> list[str]:
    """The lineage's "from the weights" section: each edge with its confidence and main evidence."""

    def line(e: dict, arrow: str) -> str:
        a, ev = e["adapter"], e["evidence"]
        shown = ", ".join(f"{k} {ev[k]:.3g}" for k in ("relative_residual", "module_cosine", "shared_rows") if ev.get(k) is not None)
        return f"  {arrow} #{a['id']} {a['name']}: {edge_text(e)}, confidence {e['confidence']:.2f}{f'  [{shown}]' if shown else ''}"

    scan = w["scan"]
    if scan is None:
        return ["from the weights: not scanned yet (`zoo embed` scans new adapters)"]
    lines = ["from the weights:" + (f"  (last scan failed: {scan['error']})" if scan["error"] else "")]
    lines += [line(e, "derives from") for e in w["parents"]]
    lines += [line(e, "is the source of") for e in w["children"]]
    if not w["parents"] and not w["children"]:
        lines.append("  no relation to a stored adapter found")
    if w["disagreement"]:
        lines.append(f"  disagrees with the card: {w['disagreement']}")
    return lines


def from_lineage_lines(found: FromLineage | None) -> list[str]:
    """What an adapter inherits along its edges (graph imputation): per key its values with their scores (a merge's:
    all of them) and the adapters they came from."""
    if found is None:
        return ["from lineage: none (a file is not stored: it has no edges)"]
    head = f"from lineage (given labels of the adapters related by the weights, confidence ≥ {found['min_confidence']:.2f}):"
    if not found["attributes"]:
        why = "no confident edge" if not found["edges"] else f"{plural(found['edges'], 'confident edge')}, no label it lacks at their ends"
        return [f"{head} nothing ({why})"]
    lines = [head]
    for key, inherited in found["attributes"].items():
        values = ", ".join(f"{v['value']} {percent(v['score'])}" for v in inherited["values"])
        sources = {s["adapter"]["id"]: s for v in inherited["values"] for s in v["sources"]}
        via = "; ".join(_source_text(s) for s in sources.values())
        union = "" if inherited["kind"] != "merge" else "all of: " if inherited["complete"] else "all of (a parent's unknown): "
        lines.append(f"  {key:<16} {union}{values}  ({via})")
    return lines


def _source_text(s: Source) -> str:
    """How the adapter relates to the one a value came from: `rescaled of #3 a`, `#7 b is cast of it`."""
    other = f"#{s['adapter']['id']} {s['adapter']['name']}"
    weight = f" (weight {s['weight']:.3g})" if s["weight"] is not None else ""
    return f"{s['relation']} of {other}{weight}" if s["direction"] == "parent" else f"{other} is {s['relation']} of it"


def relations_line(r: RelationReport) -> str:
    """What the relation step did in a space, in one line."""
    cost = f" ({r['ms_per_adapter']:.0f} ms each)" if r["ms_per_adapter"] is not None else ""
    line = f"{r['space']}: relations from the weights: {plural(r['scanned'], 'adapter')} scanned{cost}, {plural(r['edges'], 'edge')} found"
    line += f", {r['failed']} failed ({'; '.join(r['errors'])})" if r["failed"] else ""
    line += f"; {budget_text(r)}" if r["budget_cut"] else ""
    return line + (f"; stopped: {r['not_ready']}" if r["not_ready"] else "")


def budget_text(r: RelationReport) -> str:
    """What the read budget left out of the relation step, and what to do about it."""
    from zoo.config import EMBED_CHUNK_BYTES
    from zoo.services.relations import COMPARED

    none = r["uncompared"]
    fewer = r["budget_cut"] - none
    parts = [f"{plural(none, 'adapter')} compared with no neighbour"] if none else []
    parts += [f"{plural(fewer, 'adapter')} with fewer than {COMPARED}"] if fewer else []
    return (
        f"{' and '.join(parts)}: up to {r['largest_mb'] or 0:,.0f} MB each in float64, which with their neighbours would "
        f"pass the read budget (ZOO_EMBED_CHUNK_BYTES, {EMBED_CHUNK_BYTES.get() / 2**20:,.0f} MiB); the next "
        f"`zoo embed` with a larger budget compares them again"
    )


def worker_line(summary: WorkerSummary) -> str:
    """A worker run's summary in one line."""
    embedded = ", ".join(f"{n} in {space}" for space, n in summary["embedded"].items()) or "none"
    return (
        f"{plural(summary['processed'], 'item')} in {summary['ingest_seconds']:.1f} s ({summary['items_per_s'] or 0:.2f} items/s), "
        f"{summary['seconds']:.1f} s with embedding: "
        f"{summary['done']} done, {plural(summary['duplicate'], 'duplicate')}, {summary['failed']} failed"
        + (f", {summary['queued']} queued again" if summary["queued"] else "")
        + (f", {summary['lost']} taken over by another worker" if summary["lost"] else "")
        + f"; embedded: {embedded}"
    )


def job_list_lines(found: list[JobSummary]) -> list[str]:
    lines = [
        f"{'id':>5}  {'state':<9} {'total':>6} {'done':>6} {'dup':>5} {'failed':>6} {'queued':>6} {'running':>7} {'items/s':>8}  created"
    ]
    for j in found:
        c = j["counts"]
        rate = f"{j['throughput']:.2f}" if j["throughput"] else "-"
        lines.append(
            f"{j['id']:>5}  {j['state']:<9} {c['total']:>6} {c['done']:>6} {c['duplicate']:>5} {c['failed']:>6} {c['queued']:>6} "
            f"{c['running']:>7} {rate:>8}  {str(j['created_at'])[:19]}"
        )
    return lines


def job_lines(j: JobDetail) -> list[str]:
    """A job resource as text: counts, throughput and ETA, stage means, failed items."""
    from zoo.store.jobs import ITEM_STATES

    c = j["counts"]
    when = f"created {str(j['created_at'])[:19]}" + (f", finished {str(j['finished_at'])[:19]}" if j["finished_at"] else "")
    lines = [f"job {j['id']}: {j['state']} ({j['kind']}, by {j['created_by'] or '-'}, {when})"]
    lines.append(f"  {plural(c['total'], 'item')}: " + ", ".join(f"{c[s]} {s}" for s in ITEM_STATES if c[s] or s in ("done", "failed")))
    if j["throughput"]:
        eta = f"; ETA {j['eta_s']:.0f} s" if j["eta_s"] is not None else ""
        lines.append(f"  {j['processed']} processed in {j['elapsed_s']:.1f} s: {j['throughput']:.2f} items/s{eta}")
    stages, slowest = j["stages"], j["slowest_stage"]
    if stages and slowest is not None:  # the slowest is one of the stages (None when there are none)
        total = sum(stages.values())
        means = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stages.items())
        lines.append(f"  per item: {means}; slowest stage: {slowest} ({stages[slowest] / total:.0%})")
    for key in ("requeued", "cancelled_items"):
        if key in j:
            lines.append(f"  {plural(j[key], 'item')} {'queued again' if key == 'requeued' else 'cancelled'}")
    items = j.get("items", [])
    failed = [i for i in items if i["state"] == "failed"]
    if failed:
        lines.append("  failed (`zoo jobs retry` queues them again):")
        lines += [f"    #{i['id']} {i['reason'] or i['source']}" for i in failed]
    warned = [i for i in items if i.get("warnings")]
    if warned:
        lines.append("  stored, with warnings:")
        lines += [f"    #{i['id']} warning: {w}" for i in warned for w in i["warnings"]]
    return lines
