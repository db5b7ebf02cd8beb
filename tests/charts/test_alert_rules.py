"""The shipped Prometheus alerting rules: valid, firing as their unit tests say, on metrics the server exports."""

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from padim.service.metrics import Metrics

RULES = Path(__file__).parents[2] / "charts" / "padim" / "files"


def promtool(*args: str) -> subprocess.CompletedProcess:
    executable = shutil.which("promtool")  # there: the promtool marker checked it
    return subprocess.run([executable, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


@pytest.mark.promtool
def test_the_rules_are_valid_and_fire_as_their_unit_tests_say():
    checked = promtool("check", "rules", "padim-alerts.yml")
    assert checked.returncode == 0 and "SUCCESS: 9 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "padim-alerts.test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_metric_the_rules_read_is_one_the_server_exports(server, dataset):
    image = (dataset / "test" / "good" / "000.png").read_bytes()
    assert httpx.post(server.url + "/score", content=image, headers={"content-type": "image/png"}).status_code == 200
    exported = {
        sample.name
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        for sample in family.samples
    }
    read = set(re.findall(r"\b(padim_[a-z_]*[a-z])\b(?!_\*)", (RULES / "padim-alerts.yml").read_text()))
    # a line's metrics have samples once a line runs (PADIM_LINES; tests/service/lines read them): declared here
    lines = {name for name in read if name.startswith("padim_line_")}
    declared = {family.name for family in Metrics().registry.collect()}
    assert lines and lines <= declared, lines - declared
    read -= lines
    assert read and read <= exported, read - exported
    # and the unit tests feed the series the rules read, label for label
    for labels in re.findall(r"padim_monitor_p_value\{([^}]*)\}", (RULES / "padim-alerts.test.yml").read_text()):
        test = dict(re.findall(r'(\w+)="([^"]*)"', labels))["test"]
        assert f'padim_monitor_p_value{{model="weave",test="{test}"}}' in httpx.get(server.url + "/metrics").text
