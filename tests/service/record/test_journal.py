"""The record's journal: rows fsynced in groups, read on from what the database has, torn lines skipped, bounded;
and nothing acknowledged is lost to a kill -9."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from padim.service.record.journal import (
    SEGMENT_BYTES,
    Journal,
    JournalFull,
    JournalTaken,
    Position,
    adopt,
    adoptable,
)


def lines(first: int, count: int) -> list[bytes]:
    return [(json.dumps({"id": f"{i:032x}", "n": i}) + "\n").encode() for i in range(first, first + count)]


def read_all(journal: Journal, position: Position, batch: int = 7) -> tuple[list[int], Position]:
    got = []
    while True:
        rows, position = journal.read(position, batch)
        if not rows:
            return got, position
        got += [r["n"] for r in rows]


def test_rows_are_read_in_order_across_segments_and_restarts(tmp_path, monkeypatch):
    monkeypatch.setattr("padim.service.record.journal.SEGMENT_BYTES", 300)
    journal = Journal(tmp_path, max_bytes=10**6)
    for first in range(0, 40, 5):
        journal.append(lines(first, 5))
    got, position = read_all(journal, journal.position)
    assert got == list(range(40)) and len(list(tmp_path.glob("*.jsonl"))) > 2
    journal.commit(position)
    assert len(list(tmp_path.glob("*.jsonl"))) == 1 and journal.pending_bytes() == 0  # the passed ones are removed
    journal.close()
    again = Journal(tmp_path, max_bytes=10**6)  # a restart begins a new segment and reads on from COMMITTED
    again.append(lines(40, 3))
    assert read_all(again, again.position)[0] == [40, 41, 42] and again.waiting_rows() == 3


def test_a_torn_line_is_skipped_and_the_journal_is_bounded(tmp_path):
    journal = Journal(tmp_path, max_bytes=2000)
    journal.append(lines(0, 2))
    with open(tmp_path / f"{journal.current:08d}.jsonl", "ab") as handle:
        handle.write(b'{"id": "torn", "n": ')  # a crash in the middle of a write
    journal.close()
    again = Journal(tmp_path, max_bytes=2000)
    again.append(lines(2, 1))
    assert read_all(again, again.position)[0] == [0, 1, 2]
    with pytest.raises(JournalFull, match="PADIM_RECORD_JOURNAL_MAX_BYTES"):
        again.append(lines(3, 40))
    assert read_all(again, again.position)[0] == [0, 1, 2]  # nothing of the refused batch was written
    assert SEGMENT_BYTES > 2000


WRITER = textwrap.dedent("""
    import json, sys
    from padim.service.record.journal import Journal
    journal = Journal(sys.argv[1], max_bytes=10**9)
    n = 0
    while True:
        journal.append([(json.dumps({"id": str(i), "n": i}) + "\\n").encode() for i in range(n, n + 10)])
        n += 10
        print(n, flush=True)  # acknowledged: every row below n is durable
""")


def test_a_kill_9_loses_no_acknowledged_row(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acknowledged = 0
    for line in process.stdout:
        acknowledged = int(line)
        if acknowledged >= 2000:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    journal = Journal(tmp_path, max_bytes=10**9)
    got, _ = read_all(journal, journal.position, batch=500)
    assert got[:acknowledged] == list(range(acknowledged)) and got == list(range(len(got)))


def test_a_stopped_replicas_journal_is_adopted_once_and_a_running_ones_is_not(tmp_path):
    root = tmp_path / "journal"
    mine = Journal(root / "a", max_bytes=10**9)
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(root / "b")], stdout=subprocess.PIPE, text=True)
    acknowledged = 0
    for line in process.stdout:
        acknowledged = int(line)
        if acknowledged >= 500:
            break
    assert adoptable(root, mine.folder) == [root / "b"]
    with pytest.raises(JournalTaken, match="PADIM_REPLICA"):  # two processes given one replica name
        Journal(root / "b", max_bytes=10**9, wait_s=0)
    inserted: list[dict] = []
    assert adopt(root / "b", inserted.extend, 100) is None and not inserted  # b runs: its rows are its own
    process.send_signal(signal.SIGKILL)
    process.wait()
    adopted = adopt(root / "b", inserted.extend, 100)
    got = [r["n"] for r in inserted]
    assert adopted == len(got) >= acknowledged and got == list(range(len(got)))
    assert not (root / "b").exists() and adoptable(root, mine.folder) == []
    again = Journal(root / "b", max_bytes=10**9, wait_s=0)  # a replica of that name starts afresh
    assert again.waiting_rows() == 0


@pytest.mark.tmpfs
def test_an_append_the_full_disk_cuts_short_is_cut_off_again_and_the_journal_goes_on_once_there_is_room(tmp_path):
    """On a real full disk a write can land in part: the segment's last page has room for some bytes, not for the
    rest (tmpfs gives space a page at a time). The failed rows are cut off again, so the journal holds exactly what
    was acknowledged and the next row does not follow a fragment; once there is room, appends go on in the segment."""
    from helpers import small_disk

    with small_disk(tmp_path / "disk", 256 * 1024) as disk:
        journal = Journal(disk.path / "journal", max_bytes=10**6)
        journal.append(lines(0, 3))  # a segment of a few hundred bytes: most of its page is free
        (segment,) = (disk.path / "journal").glob("*.jsonl")
        before = segment.stat().st_size
        disk.fill()
        big = [(json.dumps({"id": f"{i:032x}", "n": i, "pad": "x" * 3000}) + "\n").encode() for i in (3, 4)]
        with pytest.raises(OSError, match="No space left"):
            journal.append(big)  # 6 kB: more than the page's free part
        cut = segment.stat().st_size
        disk.free()
        journal.append(lines(5, 2))
        got, _ = read_all(journal, journal.position)
        journal.close()
    assert cut == before  # nothing of the failed rows stays
    assert got == [0, 1, 2, 5, 6]  # and the rows after it read whole
