"""``padim watch``: the lines without HTTP, from the real command line, stopped by SIGTERM as a service manager does."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time

from helpers import run_cli


def test_watch_scores_a_folder_until_sigterm_and_keeps_its_journal(model_file, dataset, tmp_path):
    (tmp_path / "in").mkdir()
    lines = tmp_path / "lines.yaml"
    lines.write_text("lines:\n  - {name: bench, source: {type: folder, path: in, settle_s: 0.2}}\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "padim", "watch", str(lines), str(model_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        (tmp_path / "in" / "part-1.png").write_bytes((dataset / "test" / "hole" / "000.png").read_bytes())
        deadline = time.time() + 60
        while time.time() < deadline and not (tmp_path / "in" / "flagged" / "part-1.png").exists():
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            time.sleep(0.1)
        assert (tmp_path / "in" / "flagged" / "part-1.png").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    with sqlite3.connect(tmp_path / "padim-lines" / "bench.sqlite") as db:
        (message,) = [json.loads(m) for (m,) in db.execute("select message from pictures")]
    assert message["source"] == "part-1.png" and message["is_anomaly"] and message["part"] == "part-1"


def test_watch_refuses_a_wrong_lines_file_in_one_line(model_file, tmp_path):
    lines = tmp_path / "lines.yaml"
    lines.write_text("lines:\n  - {name: bench, source: {type: folder, path: nowhere}}\n")
    result = run_cli("watch", lines, model_file, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"padim watch: error: {lines}: line 'bench': source.path: folder {tmp_path / 'nowhere'} does not exist"
    ]
