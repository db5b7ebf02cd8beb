"""lines.yaml: each mistake is one line naming the line and the field; the docs' examples are valid files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import run_cli

from padim.service.lines.config import LineConfigError, LinesFile, check_lines, read_lines

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lines.yaml"
    path.write_text(text)
    return path


FOLDER = "source: {type: folder, path: in}"
OPCUA = "type: opcua, endpoint: 'opc.tcp://p:4840'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lines: [", "lines.yaml: not YAML"),
        ("- a\n- b", "expected a mapping with 'lines:'"),
        ("lines: []", "lines: no line: name at least one"),
        (f"lines:\n  - {{name: a, {FOLDER}, colour: red}}", "line 'a': colour: unknown key"),
        (
            "lines:\n  - {name: a, source: {type: scanner}}",
            "line 'a': source: type 'scanner': expected folder or camera",
        ),
        ("lines:\n  - {name: 'a b', source: {type: folder, path: in}}", "line 'a b': name: 'a b': use 1-64 letters"),
        (
            f"lines:\n  - {{name: a, {FOLDER}, sinks: [{{type: kafka}}]}}",
            "line 'a': sinks[0]: type 'kafka': expected mqtt, webhook or opcua",
        ),
        (f"lines:\n  - {{name: a, {FOLDER}, sinks: [{{type: mqtt}}]}}", "line 'a': sinks[0].host: Field required"),
        (
            f"lines:\n  - {{name: a, {FOLDER}, sinks: [{{type: webhook, url: 'ftp://x'}}]}}",
            "line 'a': sinks[0].url: 'ftp://x' is not an http:// or https:// URL",
        ),
        (
            f"lines:\n  - {{name: a, {FOLDER}, sinks: [{{{OPCUA}, nodes: {{colour: 'ns=2;s=X'}}}}]}}",
            "line 'a': sinks[0].nodes: unknown message field 'colour'",
        ),
        (
            f"lines:\n  - {{name: a, {FOLDER}, sinks: [{{{OPCUA}, nodes: {{score: 'Score'}}}}]}}",
            "'Score' is not a node id",
        ),
        (
            "lines:\n  - {name: a, source: {type: camera, device: 0, mode: rate, trigger: {host: h, topic: t}}}",
            "line 'a': source.trigger is for mode: trigger",
        ),
        (f"lines:\n  - {{name: a, {FOLDER}}}\n  - {{name: a, {FOLDER}}}", "line 'a' is named twice"),
        (f"lines:\n  - {{name: a, {FOLDER}, latency_budget_ms: -1}}", "line 'a': latency_budget_ms: Input should be"),
    ],
)
def test_a_wrong_file_is_one_line_naming_the_line_and_the_field(tmp_path, text, message):
    with pytest.raises(LineConfigError) as raised:
        read_lines(write(tmp_path, text))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith(str(tmp_path / "lines.yaml"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{name: a, model: other, source: {type: folder, path: in}}", "line 'a': model: no model named 'other'"),
        ("{name: a, source: {type: folder, path: missing}}", "line 'a': source.path: folder "),
        ("{name: a, source: {type: camera, device: clip.avi}}", "line 'a': source.device: video file "),
        ("{name: a, source: {type: camera, device: 57}}", "line 'a': source.device: camera 57 does not open"),
        (
            "{name: a, source: {type: folder, path: in}, sinks: [{type: mqtt, host: no-such-host.invalid}]}",
            "line 'a': sinks[0].host: 'no-such-host.invalid' does not resolve",
        ),
        (
            "{name: a, source: {type: folder, path: in}, sinks: [{type: webhook, url: 'http://x', secret_env: NOPE}]}",
            "line 'a': sinks[0].secret_env: NOPE is not set",
        ),
    ],
)
def test_what_the_schema_cannot_see_is_checked_at_start(tmp_path, line, message):
    (tmp_path / "in").mkdir()
    path = write(tmp_path, f"lines:\n  - {line}\n")
    lines, _ = read_lines(path)
    with pytest.raises(LineConfigError, match=re.escape(message)):
        check_lines(lines, ["weave"], "weave", path)


def test_relative_paths_are_the_files_folder_and_a_broker_that_is_down_is_not_an_error(tmp_path):
    (tmp_path / "in").mkdir()
    path = write(
        tmp_path,
        "lines:\n  - {name: a, source: {type: folder, path: in}, sinks: [{type: mqtt, host: 127.0.0.1, port: 1}]}",
    )
    lines, state = read_lines(path)
    assert lines.lines[0].source.path == tmp_path / "in" and state == tmp_path / "padim-lines"
    check_lines(lines, ["weave"], "weave", path)  # nothing listens on port 1: its verdicts will wait


def test_check_lines_on_the_command_line(model_file, tmp_path):
    (tmp_path / "in").mkdir()
    good = write(tmp_path, "lines:\n  - {name: press, model: weave, source: {type: folder, path: in}}\n")
    result = run_cli("serve", model_file, "--lines", good, "--check-lines")
    assert "the lines are ready to start" in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("lines:\n  - {name: press, model: wave, source: {type: folder, path: in}}\n")
    result = run_cli("serve", model_file, "--lines", bad, "--check-lines", check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"padim serve: error: {bad}: line 'press': model: no model named 'wave'; served: weave"
    ]


def test_every_example_in_the_docs_is_a_valid_file():
    examples = re.findall(r"^```yaml\n(.*?)^```", (ROOT / "docs" / "lines.md").read_text(), re.S | re.M)
    files = [yaml.safe_load(e) for e in examples if e.startswith(("lines:", "state_dir:"))]
    assert len(files) >= 3
    for file in files:
        LinesFile.model_validate(file)
