"""A scored picture's answer: the verdict (as ``padim predict`` gives it) and, when asked for, its heat map and mask."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from concurrent.futures import Executor

from PIL import Image

from padim.models.errors import NonFiniteScoreError
from padim.models.scoring.heatmaps import mask_image, overlay
from padim.models.scoring.verdicts import verdict_of

from ..edge.errors import api_error
from ..record.rows import make_row
from .batching import ScoredImage
from .decoding import Decoded, release_memory

log = logging.getLogger("padim.service")


async def answered(
    pool: Executor,
    name: str,
    scorer,
    decoded: list[Decoded],
    scored: list[ScoredImage],
    threshold: float | None,
    heatmap: bool,
    mask: bool,
) -> list[dict]:
    """Each scored picture's answer (:func:`answer`): drawn on ``pool`` where a heat map or mask is asked for, else
    here (a verdict is a few numbers)."""
    if not (heatmap or mask):
        return [
            answer(name, scorer, image, one, threshold, False, False)
            for image, one in zip(decoded, scored, strict=True)
        ]
    loop = asyncio.get_running_loop()
    drawn = [
        loop.run_in_executor(pool, answer, name, scorer, image, one, threshold, heatmap, mask)
        for image, one in zip(decoded, scored, strict=True)
    ]
    return list(await asyncio.gather(*drawn))


def answer(
    name: str,
    scorer,
    decoded: Decoded,
    scored: ScoredImage,
    threshold: float | None,
    heatmap: bool,
    mask: bool,
) -> dict:
    """The result of one picture of model ``name`` (``scorer``: its calibration and framing, or a view of them).

    Drawing a heat map or mask takes milliseconds: done on a decode thread then; a verdict alone is a few
    arithmetic operations, done where the answer is written.

    Raises:
        ApiError: 500 ``non_finite_score`` when the score or the map is NaN or infinite (never a verdict from one).
    """
    calibration = scorer.calibration
    try:
        result = verdict_of(
            scored.raw_score, scored.over, scored.pixels, scored.finite, calibration, threshold
        ).to_dict()
    except NonFiniteScoreError as error:  # fail closed: never a verdict from a NaN
        log.error("non-finite score", extra={"model": name, "raw_score": str(scored.raw_score)})
        raise api_error(
            error,
            "the model gave a NaN or infinite score for this image, so no verdict is given; "
            "the model file may be damaged (check it with `padim info --verify`)",
        ) from None
    if heatmap or mask:
        assert scored.map is not None, "a heat map or mask was asked for: the batch kept the map"
        width, height = decoded.shown_size
        resized = scorer.framing.to_picture(scored.map, width, height, decoded.picture)
        normalised_map = calibration.normalise(resized.double()).numpy()
        if heatmap:
            assert decoded.shown is not None, "a heat map was asked for: the decoder kept the picture"
            box = scorer.framing.shown_box(width, height, decoded.picture)
            result["heatmap"] = png_base64(overlay(decoded.shown, normalised_map, result["threshold"], scored=box))
        if mask:
            result["mask"] = png_base64(mask_image(normalised_map, result["threshold"]))
        if decoded.large:
            release_memory()
    return result


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def count_verdicts(metrics, name: str, version: int, results: list[dict], own_threshold: bool) -> None:
    """What one request was answered, into the verdict metrics."""
    label = str(version)
    for result in results:
        metrics.verdicts.labels(name, label, "anomalous" if result["is_anomaly"] else "normal").inc()
        metrics.scores.labels(name, label).observe(result["score"])
    if own_threshold:
        metrics.threshold_overrides.labels(name).inc(len(results))


def keep_rows(
    record,
    review_sample: float,
    name: str,
    version: int,
    datas: list[bytes],
    digests: list[str],
    fields: list[dict],
    scored: list[ScoredImage],
    results: list[dict],
    pictures: list[tuple[int, int]],
) -> list:
    """Hand each answered picture's row and bytes to ``record`` (never waits); each result gets its row's id.
    Returns the rows' futures, resolved once each row is durable."""
    futures = []
    for data, digest, field_map, image, result, picture in zip(
        datas, digests, fields, scored, results, pictures, strict=True
    ):
        row = make_row(
            name, version, result, image.input_distance, picture, digest, len(data), field_map, review_sample
        )
        result["record_id"] = row["id"]
        futures.append(record.submit(row, data))
    return futures
