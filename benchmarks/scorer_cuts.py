"""Three cuts at the scorer's own time, each measured against what it replaced, in one process.

- ``stem``: the model's int8 backbone graph as the model file keeps it, against the same graph with its stem read
  over the picture's 2 x 2 blocks (:func:`padim.models.features.quantised.space_to_depth_stem`, what the fit's
  int8 pass and the scorer's export run). Their maps must be the same to the bit (checked, printed).
- ``input``: the scorer's graph (``load_scorer(..., "auto")``: the model's int8 scorer where this CPU computes int8
  faster) handed its input normalised by torch (``model_input``, as ``score`` did before) against NumPy's
  (``model_input_array``, what it does now). torch runs the normalisation on its OpenMP team, whose threads keep
  spinning on the cores the graph's threads need next.
- ``kept``: the scorer's graphs (the model's int8 scorer's and its float32 one's) with every channel of the deepest
  stage computed, then gathered, against the graphs padim exports, whose last convolution computes only the channels
  the embedding keeps (``_kept_channels_only`` in :mod:`padim.models.deploy.export`). The int8 outputs must be the
  same to the bit, the float32 ones within float32's rounding (checked, printed).

Batches 1 and 16, the two sides interleaved round by round (the order alternating), each call after an idle pause;
medians printed, and each side's median against the other's per round. The model: ``--model`` (a ``.padim`` file
fitted with an int8 scorer), else a default fit of ``--train`` generated carpet pictures at 224 px with seeded
random resnet18 weights.

    python benchmarks/scorer_cuts.py [--model F] [--rounds 30] [--output benchmarks/results/DATE-MACHINE-cuts.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timing import machine_name, seeded_resnet18, work_folder

from padim.models import PadimConfig, fit_detector, training_images
from padim.models.data.synthetic import generate
from padim.models.deploy import export
from padim.models.deploy.runtimes import OnnxRuntimeSession, load_scorer
from padim.models.devices import cpu_features
from padim.models.features.embedding import model_input, model_input_array
from padim.models.features.quantised import GRAPH_KEY, GraphExtractor, QuantisedExtractor
from padim.models.fit.model_file import load_detector, save_detector

#: Idle seconds before each timed call (thread pools stop spinning).
SETTLE_S = 0.03


def interleaved(sides: dict[str, Callable[[], object]], rounds: int) -> dict:
    """Median milliseconds of each side, and the median of each round's ratio of the second side to the first."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():
        side()
    for index in range(rounds):
        for name in list(sides)[:: 1 if index % 2 == 0 else -1]:
            time.sleep(SETTLE_S)
            started = time.perf_counter()
            sides[name]()
            times[name].append(1000 * (time.perf_counter() - started))
    first, second = times.values()
    return {
        **{f"{name} ms": round(statistics.median(values), 3) for name, values in times.items()},
        "second / first, per round": round(statistics.median(b / a for a, b in zip(first, second, strict=True)), 3),
    }


def default_model(work: Path, train: int) -> Path:
    """A default fit (its int8 scorer included) of ``train`` generated carpet pictures, made once in ``work``."""
    model = work / "carpet.padim"
    if not model.exists():
        generate(work / "data", ("carpet",), train=train, test_good=16, test_defect=0, size=224, seed=1)
        config = PadimConfig(weights=str(seeded_resnet18(work / "resnet18-seed0.pth")), image_size=224, device="cpu")
        pictures = training_images(work / "data" / "carpet" / "train" / "good")
        save_detector(fit_detector(config, pictures, progress=False)[0], model)
    return model


def measure_input(scorer, batch: torch.Tensor, rounds: int, report: dict) -> None:
    """The scorer's graph handed torch's normalisation against NumPy's, at batches 1 and 16, into ``report``."""
    run = scorer._session.run  # the graph alone: what score() hands its input to
    for size in (1, 16):
        pictures = batch[:size]
        same = np.array_equal(model_input(pictures).numpy(), model_input_array(pictures))
        cut = interleaved(
            {
                "torch input": lambda p=pictures: run(np.ascontiguousarray(model_input(p).numpy())),
                "NumPy input": lambda p=pictures: run(model_input_array(p)),
            },
            rounds,
        )
        report[f"input batch {size}"] = {**cut, "same input to the bit": same}
        print(f"the {report['scorer']} scorer, batch {size}: {cut} (the same input to the bit: {same})")


def measure_kept(detector, batch: torch.Tensor, rounds: int, report: dict, work: Path) -> None:
    """The scorer's graphs with the deepest stage's every channel computed against its kept channels only, at batches
    1 and 16, into ``report``."""
    makers = {"float32": export._export_onnx}
    if detector.int8_scorer is not None and detector.int8_scorer.usable:
        makers["int8"] = export._export_int8_onnx
    cpu = torch.device("cpu")
    for scorer, make in makers.items():
        kept = make(detector, work / f"{scorer}-kept.onnx", False)
        original = export._kept_channels_only
        export._kept_channels_only = lambda model: 0  # the graph as it was exported before
        try:
            whole = make(detector, work / f"{scorer}-whole.onnx", False)
        finally:
            export._kept_channels_only = original
        sessions = {"every channel": OnnxRuntimeSession(whole, cpu), "kept channels": OnnxRuntimeSession(kept, cpu)}
        for size in (1, 16):
            images = model_input_array(batch[:size])
            first, second = (session.run(images) for session in sessions.values())
            pairs = zip(first, second, strict=True)
            largest = max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in pairs)
            cut = interleaved({k: lambda s=s, i=images: s.run(i) for k, s in sessions.items()}, rounds)
            report[f"kept {scorer} batch {size}"] = {**cut, "largest difference / largest output": largest}
            print(f"the {scorer} scorer's graph, batch {size}: {cut} (largest difference {largest:.2e} of the output)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a .padim file with an int8 scorer (default: a fit made here)")
    parser.add_argument("--train", type=int, default=60, help="pictures of the fit made here (default 60)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args()

    work = work_folder(args.workdir, "padim-scorer-cuts-")
    model = args.model or default_model(work, args.train)
    detector = load_detector(model, device="cpu")
    graph = detector.backbone_weights.get(GRAPH_KEY)
    if graph is None:
        parser.error(f"{model} has no int8 backbone graph (fit it without --no-int8-scorer)")
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (16, 3, 224, 224), dtype=np.uint8))
    pictures = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]
    batch = detector.preprocess(pictures)
    # the sessions padim opens: the graph's own bytes, and the int8 extractor's (its stem over 2 x 2 blocks)
    stages = detector.config.features.stages
    stored, blocks = GraphExtractor(graph, stages).session, QuantisedExtractor(graph, stages).session
    name = stored.get_inputs()[0].name
    report: dict = {"machine": machine_name(), "cpu": platform.processor(), "cpu_features": list(cpu_features())}
    print(f"{report['machine']}: {', '.join(report['cpu_features'])}; {model}")
    for size in (1, 16):
        images = model_input_array(batch[:size])
        same = all(
            np.array_equal(a, b)
            for a, b in zip(stored.run(None, {name: images}), blocks.run(None, {name: images}), strict=True)
        )
        stem = interleaved(
            {
                "stored": lambda s=stored, i=images: s.run(None, {name: i}),
                "2x2 blocks": lambda s=blocks, i=images: s.run(None, {name: i}),
            },
            args.rounds,
        )
        report[f"stem batch {size}"] = {**stem, "same maps to the bit": same}
        print(f"int8 backbone, batch {size}: {stem} (the same maps to the bit: {same})")
    scorer = load_scorer(model, "auto", "cpu")
    report["scorer"] = getattr(scorer, "file_scorer", None) or type(scorer).__name__
    if hasattr(scorer, "_session"):
        measure_input(scorer, batch, args.rounds, report)
    else:
        print(f"input: not measured (runtime auto chose torch here: {getattr(scorer, 'runtime_reason', '')})")
    measure_kept(detector, batch, args.rounds, report, work)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
