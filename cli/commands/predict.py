"""``padim predict``: score images and write verdicts, maps and heat maps."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TextIO

from padim.models.errors import UsageError

from ..options import batch_size, quiet_option, run_options, runtime_option, some, workers


def register(commands) -> None:
    predict = commands.add_parser(
        "predict",
        parents=[run_options(), runtime_option(), quiet_option()],
        help="score images and write results, maps and heat maps",
        description="Score images. Writes OUT_DIR/results.jsonl (one line per image: the verdict), "
        "OUT_DIR/maps/<relative path>.npy (float32 anomaly map, raw units, at the image's own size) and "
        "OUT_DIR/heatmaps/<relative path>.png (heat map over the image; threshold = middle of the colour ramp). "
        "An image whose score is not finite gets an error line and no verdict, and predict exits 1.",
    )
    predict.add_argument(
        "model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)"
    )
    predict.add_argument("inputs", type=Path, nargs="+", metavar="IMAGE_OR_DIR", help="images, or folders of images")
    predict.add_argument("--output", "-o", type=Path, required=True, metavar="OUT_DIR", help="folder for the results")
    predict.add_argument("--no-heatmaps", action="store_true", help="skip the heat-map PNGs")
    predict.add_argument("--no-maps", action="store_true", help="skip the .npy maps")
    predict.set_defaults(handler=run)


def output_names(inputs: list[Path]) -> list[tuple[Path, Path]]:
    """``(image, name under --output)`` for every image of ``inputs``, each image once, in order.

    Names mirror the inputs below the folder they have in common: ``test/hole test/scratch`` give
    ``hole/000.png`` and ``scratch/000.png``; ``a/000.png b/000.png`` give ``a/000.png`` and
    ``b/000.png``; one folder gives paths relative to it.
    """
    from padim.models.data.images import list_images  # numpy and Pillow: not for --help

    found: dict[str, Path] = {}
    for source in inputs:
        images = list_images(source)
        if not images and source.is_dir():
            raise UsageError(f"{source}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
        for image in images:
            found.setdefault(os.path.abspath(image), image)
    anchors = [os.path.abspath(s if s.is_dir() else s.parent) for s in inputs]
    base = os.path.commonpath(anchors)
    return [(image, Path(os.path.relpath(absolute, base))) for absolute, image in found.items()]


class Results:
    """``results.jsonl`` (created at its first line), and the counts of what was written to it."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / "results.jsonl"
        self.file: TextIO | None = None
        self.anomalous = 0
        self.non_finite: list[str] = []
        self.unreadable: list[str] = []

    def write(self, record: dict) -> None:
        if self.file is None:  # nothing is created until there is a first line to write
            self.out.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w")
        self.file.write(json.dumps(record) + "\n")

    def error(self, path: str, code: str, message: str) -> None:
        (self.non_finite if code == "non_finite_score" else self.unreadable).append(path)
        self.write({"path": path, "error": {"code": code, "message": message}})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from tqdm.auto import tqdm

    from padim.models.api import Detector
    from padim.models.errors import NonFiniteScoreError

    detector = Detector(load(args), batch_size=batch_size(args), workers=workers(args))
    items = output_names(args.inputs)
    name_of = {str(path): name for path, name in items}
    results, started = Results(args.output), time.perf_counter()
    unreadable: list[tuple[Path, str]] = []  # filled by the decoder, which runs ahead of scoring
    try:
        with tqdm(total=len(items), desc="predict", unit="img", disable=args.quiet, leave=False) as bar:
            for result in detector.iter_predict([path for path, _ in items], unreadable=unreadable):
                _flush_unreadable(unreadable, results, bar)
                if isinstance(result, NonFiniteScoreError):  # fail closed: no score, no verdict, exit 1 below
                    results.error(str(result.source), "non_finite_score", str(result))  # named by iter_predict
                else:
                    results.anomalous += result.is_anomaly
                    results.write(_save(result, name_of[result.source], args))
                bar.update(1)
            _flush_unreadable(unreadable, results, bar)
    finally:
        results.close()
    elapsed = time.perf_counter() - started
    print(
        json.dumps(
            {
                "images": len(items),
                "anomalous": results.anomalous,
                "failed": len(results.non_finite) + len(results.unreadable),
                "unreadable": len(results.unreadable),
                "results": str(results.path) if results.file is not None else None,
                "images_per_second": round(len(items) / elapsed, 2),
                "runtime": detector.runtime,
                "scorer": detector.scorer.file_scorer,
                "device": str(detector.scorer.device.type),
                "weights": detector.scorer.weights.label,
            }
        )
    )
    _fail_on_errors(results, len(items))
    return 0


def _flush_unreadable(unreadable: list[tuple[Path, str]], results: Results, bar) -> None:
    """Error lines for the images found unreadable so far."""
    for path, reason in unreadable:
        results.error(str(path), "unreadable_image", reason)
        bar.update(1)
    unreadable.clear()


def _save(result, name: Path, args: argparse.Namespace) -> dict:
    """The result's line, after writing its map (``.npy``) and heat map (``.png``) unless told not to."""
    import numpy as np  # not for --help

    record = result.to_dict()
    if not args.no_maps:
        map_path = args.output / "maps" / name.with_suffix(".npy")
        map_path.parent.mkdir(parents=True, exist_ok=True)
        np.save(map_path, result.anomaly_map)
        record["map"] = str(map_path)
    if not args.no_heatmaps:
        heat_path = args.output / "heatmaps" / name.with_suffix(".png")
        heat_path.parent.mkdir(parents=True, exist_ok=True)
        result.heatmap().save(heat_path)
        record["heatmap"] = str(heat_path)
    return record


def _fail_on_errors(results: Results, total: int) -> None:
    if results.non_finite:
        raise UsageError(
            f"{len(results.non_finite)} of {total} image(s) got a NaN or infinite score and no verdict "
            f"({some(results.non_finite)}); the model file may be damaged: check it with `padim info --verify`"
        )
    if results.unreadable:
        raise UsageError(
            f"{len(results.unreadable)} of {total} image(s) could not be read "
            f"({some(results.unreadable)}); see their error lines in {results.path}"
        )


def load(args: argparse.Namespace):
    """The :class:`~padim.models.scorer.Scorer` of ``args.model`` on ``args.runtime`` (predict, evaluate)."""
    from padim.models.deploy.runtimes import load_scorer  # torch: not for --help

    return load_scorer(args.model, args.runtime, args.device or "auto")
