"""The `zoo` command: the parser and `main`; each command group's module parses its arguments and prints its results."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zoo.cli import adapters, app, evaluation, jobs, ops, spaces
from zoo.config import Settings
from zoo.errors import ZooError
from zoo.store.errors import UnavailableError
from zoo.store.session import shown_url


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zoo",
        description="A weight-space model zoo: ingest LoRA adapters and checkpoints, canonicalize and describe them.",
    )
    p.add_argument("--db", metavar="URL", help="database URL (default: $ZOO_DATABASE_URL, else SQLite under the data dir)")
    p.add_argument("--data-dir", metavar="DIR", help="data directory for the blob store (default: $ZOO_DATA_DIR or ~/.local/share/zoo)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (app, adapters, spaces, evaluation, jobs, ops):
        group.add_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.load(args.db, args.data_dir)
    try:
        return int(args.func(settings, args))
    except ZooError as exc:
        print(f"zoo: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except UnavailableError as exc:
        first = str(exc.orig or exc).strip().splitlines()[0]
        where = shown_url(settings.database_url)
        if "database is locked" in first:
            print(
                f"zoo: error: the SQLite database {where} stayed locked by another writer past the busy timeout; "
                "try again, or use PostgreSQL for many concurrent writers",
                file=sys.stderr,
            )
        else:
            print(
                f"zoo: error: cannot use the database {where} ({first}); check --db / ZOO_DATABASE_URL and that the server is running",
                file=sys.stderr,
            )
        return 2
