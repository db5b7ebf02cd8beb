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
