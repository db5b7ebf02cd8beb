"""A real ``padim serve`` process on 127.0.0.1, started by the tests."""

import pytest

from helpers import running_server


@pytest.fixture(scope="session")
def server(model_file, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), [model_file]) as running:
        yield running
