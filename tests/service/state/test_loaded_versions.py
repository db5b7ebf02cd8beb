"""The loaded versions on their own (:mod:`padim.service.state.versions`): a swap retires the old version, which
closes once its last request is let go, and never before; a closing version takes no new request."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from padim.service.metrics import Metrics
from padim.service.state.served import ServedModel
from padim.service.state.versions import LoadedVersions


class Batcher:
    """What a version's batcher is to the versions: something to close."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def version(number: int, serial: int) -> ServedModel:
    scorer = SimpleNamespace(weights=SimpleNamespace(label="random"))
    # a stand-in scorer and batcher: the versions read only the weights' label, and close the batcher
    return ServedModel("weave", Path(f"v{number}"), "", scorer, Batcher(), 0.1, None, version=number, serial=serial)


async def settle() -> None:
    await asyncio.sleep(0.05)  # the closing task and its collection on the collector thread


def test_a_swap_retires_the_old_version_which_closes_after_its_last_request():
    async def run() -> None:
        with ThreadPoolExecutor(1) as collector:
            versions = LoadedVersions(Metrics(), collector)
            versions.loop = asyncio.get_running_loop()
            changes = []
            versions.on_change = lambda: changes.append(sorted(versions.by_serial))
            first, second = version(1, versions.next_serial()), version(2, versions.next_serial())
            versions.install("weave", first)
            assert versions.default_name == "weave" and versions.models["weave"] is first and changes == [[1]]
            assert versions.hold(first)  # a request admitted by version 1
            versions.install("weave", second, "activate")
            assert versions.models["weave"] is second and first.retired and versions.retired == [first]
            await settle()
            assert not first.batcher.closed and first.scorer is not None  # its request is not answered yet
            assert versions.hold(first)  # still answering: another picture of the same request may be held
            versions.let_go(first)
            await settle()
            assert not first.batcher.closed
            versions.let_go(first)  # the last one
            await settle()
            assert first.batcher.closed and first.scorer is None and 1 not in versions.by_serial
            assert versions.retired == [] and not versions.hold(first)  # closed: no new request
            assert versions.find("weave", 2) is second and versions.find("weave", 1) is None
            assert versions.serials == 2 and changes[-1] == [2]

    asyncio.run(run())


def test_an_idle_retired_version_closes_at_once_and_taking_a_model_off_keeps_the_poll_away():
    async def run() -> None:
        with ThreadPoolExecutor(1) as collector:
            versions = LoadedVersions(Metrics(), collector)
            versions.loop = asyncio.get_running_loop()
            served = version(1, versions.next_serial())
            versions.install("weave", served)
            with versions.using(served):
                versions.take_off("weave")
                await settle()
                assert not served.batcher.closed  # the request in hand is answered first
            await settle()
            assert served.batcher.closed and "weave" in versions.unloaded and versions.models == {}
            again = version(2, versions.next_serial())
            versions.install("weave", again)
            assert "weave" not in versions.unloaded
            versions.close()
            assert again.batcher.closed

    asyncio.run(run())
