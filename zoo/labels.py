"""Known attributes and measured performance of adapters, read from a CSV (`zoo ingest --labels`)."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zoo import config
from zoo.errors import InputError, UsageError

#: Columns that are always measurements (numbers), never attributes.
DEFAULT_METRICS = ("test_accuracy",)
#: The attribute that defines "same task" for retrieval.
TASK_KEY = "task"
#: The given label a source's datasets become (see source_labels).
DATASET_KEY = "dataset"


#: the width of the label and measurement key columns: no setting reaches past it
KEY_COLUMN_CHARS = 128
#: what a measurement's value counts towards ZOO_MAX_LABEL_BYTES (a float)
MEASUREMENT_VALUE_BYTES = 8


class LabelLimitError(UsageError):
    """Labels past one of the limits (ZOO_MAX_LABELS, ZOO_MAX_LABEL_KEY_CHARS, ZOO_MAX_LABEL_VALUE_CHARS, ZOO_MAX_LABEL_BYTES)."""

    http_status = 413
    error_type = "too_large"


def label_problem(attributes: Mapping[str, str], measurements: Mapping[str, float]) -> str | None:
    """What is past a limit in one adapter's labels and test measurements, all of them (those stored and those written),
    naming the limit and its setting; None when nothing is. The limits keep a label write and every catalog page that
    shows the adapter small: 20,000 labels on one adapter made each catalog page take 2.9 s."""
    most_keys, key_chars = config.MAX_LABELS.get(), min(config.MAX_LABEL_KEY_CHARS.get(), KEY_COLUMN_CHARS)
    value_chars, most_bytes = config.MAX_LABEL_VALUE_CHARS.get(), config.MAX_LABEL_BYTES.get()
    keys = len(attributes) + len(measurements)
    if keys > most_keys:
        return f"{keys:,} labels and measurements, past the limit of {most_keys:,} per adapter (ZOO_MAX_LABELS)"
    for key in [*attributes, *measurements]:
        if len(key) > key_chars:
            return f"the key {key[:40]!r}... is {len(key):,} characters long, past the limit of {key_chars:,} (ZOO_MAX_LABEL_KEY_CHARS)"
    for key, value in attributes.items():
        if len(value) > value_chars:
            return f"the value of {key!r} is {len(value):,} characters long, past the limit of {value_chars:,} (ZOO_MAX_LABEL_VALUE_CHARS)"
    size = sum(len(k.encode(errors="surrogatepass")) + len(v.encode(errors="surrogatepass")) for k, v in attributes.items())
    size += sum(len(k.encode(errors="surrogatepass")) + MEASUREMENT_VALUE_BYTES for k in measurements)
    if size > most_bytes:
        return f"{size:,} bytes of labels and measurements, past the limit of {most_bytes:,} per adapter (ZOO_MAX_LABEL_BYTES)"
    return None


def check_label_limits(attributes: Mapping[str, str], measurements: Mapping[str, float]) -> None:
    """LabelLimitError (413) when one adapter's labels and test measurements are past a limit (label_problem)."""
    problem = label_problem(attributes, measurements)
    if problem:
        raise LabelLimitError(problem)


@dataclass
class LabelRow:
    attributes: dict[str, str] = field(default_factory=dict)
    measurements: dict[str, float] = field(default_factory=dict)


def read_labels_csv(path: Path, metrics: Sequence[str] = ()) -> dict[str, LabelRow]:
    """Rows keyed by the `name` column; metric columns are parsed as floats, the rest kept as text."""
    metric_cols = set(DEFAULT_METRICS) | set(metrics)
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            columns = reader.fieldnames or []
            if "name" not in columns:
                raise InputError(path, f"labels CSV needs a 'name' column (the adapter's directory or file name); found {columns}")
            missing = sorted(set(metrics) - set(columns))
            if missing:
                raise InputError(path, f"--metrics names columns the CSV does not have: {', '.join(missing)}")
            rows: dict[str, LabelRow] = {}
            for lineno, raw in enumerate(reader, start=2):
                name = (raw.get("name") or "").strip()
                if not name:
                    raise InputError(path, f"line {lineno}: empty name")
                if name in rows:
                    raise InputError(path, f"line {lineno}: name {name!r} appears twice")
                row = LabelRow()
                for key, value in raw.items():
                    if key == "name" or key is None or value is None or value.strip() == "":
                        continue
                    if key in metric_cols:
                        try:
                            number = float(value)
                        except ValueError:
                            raise InputError(path, f"line {lineno}: {key} must be a number, got {value!r}") from None
                        if not math.isfinite(number):
                            raise InputError(path, f"line {lineno}: {key} is not finite ({value})")
                        row.measurements[key] = number
                    else:
                        row.attributes[key] = value.strip()
                problem = label_problem(row.attributes, row.measurements)
                if problem:
                    raise InputError(path, f"line {lineno}: {problem}")
                rows[name] = row
    except OSError as exc:
        raise InputError(path, f"cannot read labels CSV ({exc.strerror or exc})") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise InputError(path, f"malformed labels CSV ({exc})") from None
    return rows


def assign_rows(rows: dict[str, LabelRow], sources: list[tuple[Path, str]]) -> dict[Path, LabelRow]:
    """Each source's CSV row. A row's `name` is the source's path relative to the directory given to
    ingest (with or without its suffix) or, where that is unambiguous, its bare directory or file name.
    A bare name that fits two sources is refused: it would give both the same labels."""
    by_key: dict[str, list[Path]] = {}
    for path, relative in sources:
        for key in {relative, str(Path(relative).with_suffix("")), path.name, path.stem}:
            by_key.setdefault(key, []).append(path)
    out: dict[Path, LabelRow] = {}
    exact: set[Path] = set()
    for name, row in rows.items():
        matches = list(dict.fromkeys(by_key.get(name, [])))
        if len(matches) > 1:
            shown = ", ".join(str(m) for m in matches[:3])
            raise InputError(name, f"labels CSV name matches {len(matches)} sources ({shown}): name them by their relative path")
        if matches and (matches[0] not in out or "/" in name):  # a relative path wins over a bare name
            if matches[0] in exact and "/" in name:
                raise InputError(name, f"labels CSV names {matches[0]} twice")
            out[matches[0]] = row
            if "/" in name:
                exact.add(matches[0])
    return out


def source_labels(metadata: Mapping[str, object], given: LabelRow | None) -> dict[str, str]:
    """Given labels that what a source said implies: the model card's datasets become the label `dataset` when the
    card names exactly one and the user gave no `dataset` label (several datasets stay searchable, not a label)."""
    datasets = metadata.get("datasets")
    names = {d.strip() for d in datasets if isinstance(d, str) and d.strip()} if isinstance(datasets, list) else set()
    if len(names) != 1 or (given is not None and DATASET_KEY in given.attributes):
        return {}
    return {DATASET_KEY: names.pop()}
