"""``padim records``: the inspection record, offline (export a filtered set of rows and pictures)."""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from ..options import quiet_option


def register(commands) -> None:
    records = commands.add_parser(
        "records",
        parents=[quiet_option()],
        help="export rows and pictures of the inspection record (offline)",
        description="Read the inspection record that `padim serve --record DIR` (PADIM_RECORD_DIR, PADIM_RECORD_URL) "
        "keeps: every scored picture's row and its bytes as sent (docs/record.md).",
    )
    actions = records.add_subparsers(
        dest="action", metavar="ACTION", required=True, help="what to do (padim records ACTION --help for each)"
    )
    export = actions.add_parser(
        "export",
        help="write a filtered set of rows (rows.csv, rows.jsonl) and their pictures into a new folder",
        description="Write the rows the filters select, newest first, to OUT/rows.jsonl (with every review) and "
        "OUT/rows.csv, and each of their pictures once to OUT/pictures/<sha256>.<ext>, its bytes as sent. For audits, "
        "and for offline training: `--label normal` exports the pictures operators confirmed normal, which `padim "
        "train --resume MODEL OUT/pictures` can add. The folder appears only once complete.",
    )
    record_options(export)
    export.add_argument("--output", "-o", type=Path, required=True, metavar="OUT", help="a new folder")
    export.add_argument("--model", help="only this model's rows")
    export.add_argument("--version", type=int, help="only rows this version scored")
    export.add_argument("--verdict", choices=["anomalous", "normal"], help="only this verdict")
    export.add_argument(
        "--label",
        choices=["normal", "defect", "none"],
        help="only rows whose latest review says this (none: not reviewed)",
    )
    export.add_argument("--since", type=moment, help="scored at or after (ISO 8601, UTC unless it says)")
    export.add_argument("--until", type=moment, help="scored before (ISO 8601)")
    export.add_argument("--part", help="only this part (the client's part field)")
    export.set_defaults(handler=run)


def record_options(parser: argparse.ArgumentParser) -> None:
    """``--record`` and ``--url``: where the record is (the service's own settings by default)."""
    parser.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        default=os.environ.get("PADIM_RECORD_DIR"),
        help="the record's folder (default PADIM_RECORD_DIR): its pictures, and its SQLite database "
        "unless --url is given",
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("PADIM_RECORD_URL"),
        help="the record's PostgreSQL database (default PADIM_RECORD_URL)",
    )


def open_record(args: argparse.Namespace):
    """The record's database (:class:`~padim.service.record.store.RecordStore`) that ``--record`` / ``--url`` name.

    Raises:
        UsageError: no record given, or no database where it says.
    """
    # imported here: `padim --help` loads no SQLAlchemy
    from padim.models.errors import UsageError
    from padim.service.record.store import RecordStore, database_url

    if args.record is None:
        raise UsageError("no record folder: pass --record DIR (or set PADIM_RECORD_DIR)")
    if not Path(args.record).is_dir():
        raise UsageError(f"{args.record}: no such record folder")
    if args.url is None and not (Path(args.record) / "record.sqlite").is_file():
        raise UsageError(f"{args.record}: no record.sqlite there; pass --url for a record kept in PostgreSQL")
    return RecordStore(database_url(args.url, Path(args.record)))


def moment(text: str) -> float:
    """An ISO 8601 moment (UTC unless it says) as seconds since the epoch."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` loads no SQLAlchemy
    from tqdm.auto import tqdm

    from padim.service.record.export import export_records
    from padim.service.record.pictures import PictureStore
    from padim.service.record.store import Filters

    store = open_record(args)
    try:
        filters = Filters(
            model=args.model,
            version=args.version,
            verdict=args.verdict,
            label=args.label,
            since=args.since,
            until=args.until,
            part=args.part,
        )
        with tqdm(total=store.count(filters), desc="export", unit="row", disable=args.quiet, leave=False) as bar:
            counts = export_records(
                store, PictureStore(Path(args.record) / "pictures"), filters, args.output, on_row=lambda: bar.update(1)
            )
    finally:
        store.close()
    print(json.dumps({"output": str(args.output), **counts}))
    return 0
