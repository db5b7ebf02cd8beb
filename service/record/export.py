"""``padim records export``: a filtered set of recorded rows and their pictures in a folder, for audits and for
offline training (``padim train OUT/pictures`` after exporting ``--label normal``).

``OUT/rows.jsonl`` and ``OUT/rows.csv`` hold one row each (the client's fields as JSON in the CSV, the reviews in
the JSON lines), ``OUT/pictures/<sha256>.<ext>`` each picture once, its bytes as sent. The folder is written as
``OUT.partial`` and renamed once complete.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from padim.models.errors import UsageError

from .pictures import PictureStore, picture_format
from .store import Filters, RecordStore
from .tables import records

COLUMNS = [c.name for c in records.columns] + ["picture"]


def export_records(
    store: RecordStore,
    pictures: PictureStore,
    filters: Filters,
    output: Path,
    with_reviews: bool = True,
    on_row: Callable[[], None] | None = None,
) -> dict:
    """Write the rows ``filters`` selects, and their pictures, into ``output`` (which must not exist).

    Returns:
        ``{"rows", "pictures", "evicted"}``: rows written, pictures copied, rows whose picture was evicted.
    """
    output = Path(output)
    if output.exists():
        raise UsageError(f"{output}: already exists; export into a new folder")
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "pictures").mkdir(parents=True)
    counts = {"rows": 0, "pictures": 0, "evicted": 0}
    written: dict[str, str] = {}
    with open(partial / "rows.jsonl", "w") as lines, open(partial / "rows.csv", "w", newline="") as table:
        writer = csv.DictWriter(table, fieldnames=COLUMNS)
        writer.writeheader()
        for row in store.iterate(filters):
            sha256 = row["sha256"]
            if sha256 not in written:
                data = pictures.read(sha256)
                if data is None:
                    written[sha256] = ""
                else:
                    name = f"pictures/{sha256}{picture_format(data)[1]}"
                    (partial / name).write_bytes(data)
                    written[sha256] = name
                    counts["pictures"] += 1
            row["picture"] = written[sha256] or None
            counts["evicted"] += row["picture"] is None
            writer.writerow({**row, "fields": json.dumps(row["fields"], sort_keys=True)})
            if with_reviews:
                row["reviews"] = store.get(row["id"])["reviews"] if row["label"] is not None else []
            lines.write(json.dumps(row, sort_keys=True) + "\n")
            counts["rows"] += 1
            if on_row is not None:
                on_row()
    os.replace(partial, output)
    return counts
