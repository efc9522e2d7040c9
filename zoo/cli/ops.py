"""`zoo backup DEST`, `zoo restore SRC`: a zoo's rows, blobs and checkpoints written out and brought back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zoo.cli.render import plural, print_json
from zoo.config import Settings

BACKUP_HELP = (
    "Writes DEST (a new directory): the database's rows table by table as gzipped JSON lines (portable: a SQLite zoo's "
    "backup restores into PostgreSQL and back), every blob a row refers to and the trained W2T checkpoints, each checked "
    "against its hash, and manifest.json, written last. Rows are read in one snapshot, so zoo serve and zoo worker may "
    "keep running. Indexes, module stores and maps are not backed up: zoo restore rebuilds them."
)
RESTORE_HELP = (
    "Reads a backup made by zoo backup into the database and data dir given (--db, --data-dir or their variables): the "
    "database must be new or empty; it is migrated to the backup's schema, filled, then migrated to this zoo's. Blobs and "
    "checkpoints are checked against the manifest's hashes, and each space's indexes, module store and map are rebuilt. "
    "Run zoo check afterwards."
)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_backup(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.services.backup import backup

    report = backup(settings, Path(args.dest), progress=not args.json and sys.stderr.isatty())
    if args.json:
        print_json(report)
        return 0
    print(
        f"backed up {plural(sum(report['rows'].values()), 'row')} of {plural(len(report['rows']), 'table')}, "
        f"{plural(report['blobs'], 'blob')} ({_size(report['blob_bytes'])}) and {plural(report['files'], 'checkpoint file')} "
        f"({_size(report['file_bytes'])}) to {report['path']} in {report['seconds']:.1f} s"
    )
    return 0


def cmd_restore(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.services.backup import restore

    report = restore(settings, Path(args.src), progress=not args.json and sys.stderr.isatty())
    if args.json:
        print_json(report)
        return 0
    print(
        f"restored {plural(sum(report['rows'].values()), 'row')}, {plural(report['blobs'], 'blob')} ({_size(report['blob_bytes'])}) "
        f"and {plural(report['files'], 'checkpoint file')} from {report['path']} in {report['seconds']:.1f} s; "
        f"rebuilt the files of {plural(len(report['rebuilt']), 'space')}; run `zoo check` to confirm"
    )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("backup", help="write the zoo's rows, blobs and trained checkpoints to a new directory", description=BACKUP_HELP)
    s.add_argument("dest", metavar="DEST", help="a new (or empty) directory for the backup")
    s.add_argument("--json", action="store_true", help="no progress bars; print a JSON report")
    s.set_defaults(func=cmd_backup)

    s = sub.add_parser("restore", help="bring a backup back into a new, empty database and data dir", description=RESTORE_HELP)
    s.add_argument("src", metavar="SRC", help="a directory `zoo backup` wrote")
    s.add_argument("--json", action="store_true", help="no progress bars; print a JSON report")
    s.set_defaults(func=cmd_restore)
