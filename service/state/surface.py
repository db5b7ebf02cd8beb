"""What the score routes ask of the process that answers them: one surface, kept by two owners.

A single-process service answers ``POST /score`` with :class:`~padim.service.state.ServiceState`, which holds the
device; each API process of ``padim serve --workers N`` with :class:`~padim.service.processes.api.ApiState`, whose
device is the scoring process's. Both name :class:`ScoreSurface` as a base, so mypy checks each against it (a member
left out or of another signature fails the check), and the routes are typed with it alone (``routes/score.py``): a
route that reached past it fails the type check.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

from ..device.batching import ScoredImage
from ..record.recorder import Recorder
from ..settings import ServiceSettings


class ServedVersion(Protocol):
    """What a route reads of the version that scores: its name, and the identity every answer carries."""

    @property
    def name(self) -> str: ...

    def identity(self) -> dict: ...


Served = TypeVar("Served", bound=ServedVersion)


class ScoreSurface(Protocol[Served]):
    """The score routes' surface, over the type of the version that scores (a loaded one, or an API process's view).

    Attributes:
        settings: the service's settings (timeouts, batch limits, whether a row must be durable before the answer).
        decode: the pool pictures are hashed and decoded on.
    """

    settings: ServiceSettings
    decode: Executor

    @property
    def record(self) -> Recorder | None:
        """The inspection record's writer in this process, when the record is on."""
        ...

    def model(self, name: str | None) -> Served:
        """The version that admits a request for ``name`` (the default model for ``None``); 503 while it cannot
        score, 404 for a model not served."""
        ...

    def using(self, served: Served) -> AbstractContextManager[Served]:
        """``served`` held for one request: not closed before it is answered."""
        ...

    async def score_pictures(
        self,
        served: Served,
        datas: list[bytes],
        threshold: float | None,
        heatmap: bool,
        mask: bool,
        monitor: bool = True,
    ) -> tuple[Served, list[ScoredImage], list[dict], list[tuple[int, int]]]:
        """The pictures decoded, scored and answered: the version that scored (first: it may be another than
        ``served`` in an API process, when ``served`` was let go meanwhile), each picture as scored, its result, and
        its size as sent."""
        ...

    def observe(self, model: Served, results: list[dict], own_threshold: bool) -> None:
        """What one request was answered, into the verdict metrics."""
        ...

    def keep(
        self,
        model: Served,
        datas: list[bytes],
        digests: list[str],
        fields: list[dict],
        scored: list[ScoredImage],
        results: list[dict],
        pictures: list[tuple[int, int]],
    ) -> list[Any]:
        """The answered pictures into the record: the futures that resolve once each row is durable."""
        ...
