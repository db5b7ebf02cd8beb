"""An API process's score path (service/processes/api.py), with its scoring process stood in for.

The real processes are tested in test_processes.py and tests/service/test_versions.py; what is pinned here is the
case they meet only by chance under load: the version a request was admitted with is let go before the scoring
process takes its pictures, so the version that then serves scores them, and the answer must name that one.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from padim.service.processes import api
from padim.service.processes.shared import ServedView
from padim.service.processes.wire import Stale


def view(version: int) -> ServedView:
    return ServedView(name="weave", version=version, serial=version, sha256=f"sha{version}", scorer=object())


def test_a_request_whose_version_was_let_go_is_answered_as_the_version_that_scored_it(monkeypatch):
    first, second = view(1), view(2)
    tried: list[int] = []

    async def in_slots(served, datas, threshold, heatmap, mask, monitor, admission):
        tried.append(served.version)
        if served is first:
            raise Stale()  # activated and let go between the table's reading and the scoring process's
        return [SimpleNamespace(picture=(64, 48))], ["scored by 2"]

    async def answered(pool, name, scorer, decoded, scored, threshold, heatmap, mask):
        return [{"raw_score": scored[0]}]

    monkeypatch.setattr(api, "answered", answered)
    state = SimpleNamespace(
        places=SimpleNamespace(admit=lambda name, count: contextlib.nullcontext(None)),
        table=SimpleNamespace(served=lambda name: second),
        decode=None,
        _in_slots=in_slots,
    )
    served, scored, results, sizes = asyncio.run(
        api.ApiState.score_pictures(state, first, [b"png"], None, False, False)  # type: ignore[arg-type]
    )
    assert tried == [1, 2]
    assert served is second and scored == ["scored by 2"] and results == [{"raw_score": "scored by 2"}]
    assert sizes == [(64, 48)]


def test_readiness_says_why_when_the_scoring_process_died_before_the_link_saw_it(tmp_path):
    """Killed a moment ago, the scoring process refuses connections before this process's link has seen it go: the
    readiness probe gets the answer it gets a moment later (a reason), not a score request's error body."""
    import httpx

    from padim.service.metrics import Metrics
    from padim.service.settings import ServiceSettings

    state = SimpleNamespace(
        run=SimpleNamespace(engine_socket=tmp_path / "gone.sock", workers=1),  # nothing listens there
        draining=False,
        startup_error=None,
        row=1,
        link=SimpleNamespace(up=SimpleNamespace(is_set=lambda: True)),  # it has not seen the scoring process go
        table=SimpleNamespace(current=lambda: {"ready": True}),
        settings=ServiceSettings(),
        metrics=Metrics(),
    )

    async def probe() -> httpx.Response:
        transport = httpx.ASGITransport(app=api.create_api_app(state))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://padim") as client:
            return await client.get("/health/ready")

    answer = asyncio.run(probe())
    assert answer.status_code == 503
    assert answer.json() == {"status": "not_ready", "reason": "failed: " + api.SCORING_DOWN}


def test_a_new_api_process_takes_no_connection_before_its_link_to_the_scoring_process_is_up(tmp_path):
    """A replacement that accepted on the shared socket before its link was up answered 503 for requests its sibling
    would have served (seen in CI). Its start-up waits for the link and uvicorn accepts only after the start-up: a
    request sent meanwhile waits in the kernel's queue, for whichever process accepts first, and is answered once
    this one can serve."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from padim.service.metrics import Metrics
    from padim.service.settings import ServiceSettings

    up = threading.Event()
    state = SimpleNamespace(
        run=SimpleNamespace(engine_socket=tmp_path / "scoring.sock", workers=1, set_state=lambda *a: None),
        draining=False,
        startup_error=None,
        row=1,
        link=SimpleNamespace(up=up, start=lambda loop: None),
        settings=ServiceSettings(),
        metrics=Metrics(),
        open_record=lambda: None,
        close=lambda: asyncio.sleep(0),
    )
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(api.create_api_app(state), log_config=None, lifespan="on"))  # type: ignore[arg-type]
    serving = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    serving.start()
    answers: list[tuple[float, int]] = []

    def ask() -> None:
        answer = httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=10)
        answers.append((time.monotonic(), answer.status_code))

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        time.sleep(0.6)
        assert not answers and not server.started  # connected (the kernel's queue), not accepted
        linked = time.monotonic()
        up.set()
        asking.join(10)
    finally:
        server.should_exit = True
        serving.join(10)
        listening.close()
    assert answers and answers[0][1] == 200 and answers[0][0] >= linked
