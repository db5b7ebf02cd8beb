"""What the Docker tests measured (image size, build time), printed in the test summary."""

import pytest

_REPORT: list[str] = []


@pytest.fixture(scope="session")
def docker_report() -> list[str]:
    return _REPORT


def pytest_terminal_summary(terminalreporter):
    for line in _REPORT:
        terminalreporter.write_line(line)
