"""A line's journal: one verdict per key, a message in every outbox or in none, outboxes bounded as configured."""

from __future__ import annotations

import pytest

from padim.service.lines.journal import LineJournal, OutboxFull


def message(key: str) -> dict:
    return {"id": key, "is_anomaly": False, "seen": 0.0}


def test_a_key_gets_one_verdict_and_one_message_per_sink(tmp_path):
    journal = LineJournal(tmp_path / "a.sqlite", ["mqtt", "webhook"], 10, "block")
    first = journal.add("k1", message("k1"), {"id": "r1"})
    again = journal.add("k1", {**message("k1"), "is_anomaly": True}, {"id": "r2"})
    assert again == first and not again.message["is_anomaly"] and again.row == {"id": "r1"}
    assert journal.depths() == {"mqtt": 1, "webhook": 1}
    journal.add("k2", message("k2"), None)
    due = journal.due("mqtt", 10)
    assert [p.key for p in due] == ["k1", "k2"]
    journal.delivered("mqtt", [due[0].id])
    journal.failed([due[1].id], delay_s=60)
    assert journal.due("mqtt", 10) == [] and journal.depths() == {"mqtt": 1, "webhook": 2}
    assert [p.attempts for p in journal.due("mqtt", 10, now=1e12)] == [1]
    journal.close()
    reopened = LineJournal(tmp_path / "a.sqlite", ["mqtt", "webhook"], 10, "block")
    assert reopened.depths() == {"mqtt": 1, "webhook": 2} and reopened.get("k2").message == message("k2")
    assert reopened.get("nope") is None


def test_a_full_outbox_blocks_and_nothing_is_written(tmp_path):
    journal = LineJournal(tmp_path / "a.sqlite", ["mqtt", "webhook"], 2, "block")
    journal.add("k1", message("k1"), None)
    journal.add("k2", message("k2"), None)
    journal.delivered("webhook", [p.id for p in journal.due("webhook", 10)])
    assert not journal.room()
    with pytest.raises(OutboxFull, match="the mqtt outbox holds 2 verdicts"):
        journal.add("k3", message("k3"), None)
    assert journal.get("k3") is None and journal.depths() == {"mqtt": 2, "webhook": 0}  # not half-written


def test_drop_oldest_keeps_the_newest(tmp_path):
    journal = LineJournal(tmp_path / "a.sqlite", ["mqtt"], 3, "drop_oldest")
    for i in range(5):
        journal.add(f"k{i}", message(f"k{i}"), None)
    assert journal.room() and journal.depths() == {"mqtt": 3} and journal.dropped == {"mqtt": 2}
    assert [p.key for p in journal.due("mqtt", 10)] == ["k2", "k3", "k4"]
    assert journal.oldest()["mqtt"] is not None
