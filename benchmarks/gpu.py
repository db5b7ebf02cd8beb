"""What padim costs on a GPU: fit time and peak memory, scoring speed per runtime, CPU-vs-GPU differences.

For each backbone (resnet18 and wide_resnet50_2 by default), on generated images with random
weights:

- **fit**: ``padim train``'s own function on the GPU: seconds by phase and
  ``torch.cuda.max_memory_allocated``, at ``--images`` and (``fit_phases``) at each of ``--fit-images`` (100 and
  1,000 pictures): pass 1 and the part of it spent waiting for decoded pictures and their changed copies, the
  finish, the calibration, the write, and whether the embeddings waited in GPU memory;
- **scoring**: images per second at batch 1, 16 and 64 with torch (the model as served),
  ONNX Runtime's CUDA provider (needs ``onnxruntime-gpu``) and TensorRT through ONNX Runtime
  (needs its TensorRT provider; engines cached in the work folder), each skipped with the reason
  when it cannot run here;
- **precision**: each ``train --precision`` (fp32, bf16, fp16 by default) fitted on the same images: the torch
  scorer's images per second beside the backbone alone at that arithmetic (from GPU memory: the floor), the
  fit's own gate (its largest score difference against fp32 on training pictures), and against the fp32 model
  the largest relative image-score difference on the same pictures and the relative threshold difference;
- **CUDA graphs**: the torch scorer again at each batch size, replayed from the graphs the service captures
  (``PADIM_CUDA_GRAPHS``), with the capture's seconds;
- **CPU vs GPU**: the largest relative difference of image scores of the same model and images,
  scored on the CPU and on the GPU (padim's stated tolerance is ``CROSS_DEVICE_RTOL``); and, with
  ``--cpu-fit``, the threshold of a CPU fit of the same images against the GPU fit's.

It prints one line per measurement and, with ``--save``, writes them to
``benchmarks/results/<date>-<machine>-gpu.json``. ``--device cpu`` runs the same steps on the
CPU (to check the script where there is no GPU; the figures are then the CPU's).

    python benchmarks/gpu.py                                  # on a GPU machine
    python benchmarks/gpu.py --backbones resnet18 --images 40 --size 128 --device cpu   # a dry run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import machine_name, median_seconds, work_folder  # noqa: E402 (the benchmarks' own helpers)

from padim.core.artifact import read_header  # noqa: E402
from padim.models import CROSS_DEVICE_RTOL, PadimConfig, train, training_images  # noqa: E402
from padim.models.data.synthetic import generate  # noqa: E402
from padim.models.deploy.runtimes import TENSORRT_ENV, load_scorer  # noqa: E402
from padim.models.devices import onnxruntime_has_cuda  # noqa: E402
from padim.models.errors import PadimError  # noqa: E402
from padim.models.features.embedding import stacked  # noqa: E402
from padim.models.fit.model_file import load_detector  # noqa: E402


def say(record: dict, results: list[dict]) -> None:
    results.append(record)
    print(json.dumps(record), flush=True)


def fit(
    args: argparse.Namespace,
    backbone: str,
    data: Path,
    out: Path,
    count: int,
    precision: str = "fp32",
    device: str | None = None,
) -> tuple[float, dict]:
    """``padim train``'s own function on the first ``count`` pictures of ``data``, with the command line's size,
    batch and ``--decode-workers`` (padim's default when not given), on ``device`` (the command line's when None): its
    seconds and what it reports."""
    device = device or args.device
    run = {} if args.decode_workers is None else {"decode_workers": args.decode_workers}
    config = PadimConfig(
        backbone=backbone,
        weights="random",
        image_size=args.size,
        device=device,
        batch_size=args.fit_batch,
        precision=precision,
        **run,
    )
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    report = train(config, training_images(data)[:count], out, progress=False)
    seconds = time.perf_counter() - started
    return seconds, {
        "phases": report.seconds,
        "cuda_max_memory_allocated": report.cuda_peak,
        "planned_bytes": report.plan.total if report.plan else None,
        "embeddings_in_device_memory": bool(report.plan and report.plan.spool_held),
        "decode_workers": config.run.decode_workers,
    }


def throughput(scorer, size: int, batch: int, repeats: int) -> float:
    """img/s of ``scorer`` on a batch as the service hands it one: 8-bit pixels in host memory (page-locked for a
    GPU), normalised on the device."""
    pixels = torch.randint(
        0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(batch)
    )
    images = stacked(list(pixels), scorer.device)
    seconds = median_seconds(lambda: scorer.score(images), repeats)
    return batch / seconds


def scorers(path: Path, device: str, tensorrt_cache: Path):
    """``(runtime name, scorer or the reason it cannot run)`` for each runtime measured."""
    yield "torch", load_detector(path, device=device)
    if device != "cuda":
        yield "onnxruntime-cuda", "no GPU"
        yield "tensorrt", "no GPU"
        return
    if not onnxruntime_has_cuda():
        yield "onnxruntime-cuda", "onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)"
        yield "tensorrt", "onnxruntime has no CUDAExecutionProvider"
        return
    yield "onnxruntime-cuda", load_scorer(path, "onnxruntime", "cuda")
    import onnxruntime

    if "TensorrtExecutionProvider" not in onnxruntime.get_available_providers():
        yield "tensorrt", "onnxruntime has no TensorrtExecutionProvider"
        return
    os.environ[TENSORRT_ENV] = str(tensorrt_cache)
    try:
        scorer = load_scorer(path, "onnxruntime", "cuda")
    finally:
        del os.environ[TENSORRT_ENV]
    yield (
        "tensorrt",
        scorer if scorer.providers[0] == "TensorrtExecutionProvider" else "TensorRT did not take the graph",
    )


def backbone_floor(detector, size: int, batch: int, repeats: int) -> float:
    """Images per second of the detector's backbone alone, at its arithmetic, on a batch already on its device."""
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch)).to(detector.device)
    return batch / median_seconds(lambda: detector.model.embedder.extractor(images), repeats)


def against_fp32(path: Path, reference: Path, size: int, device: str) -> dict:
    """A reduced-precision model against the fp32 one fitted on the same images: scores of one batch, thresholds."""
    batch = torch.randn(16, 3, size, size, generator=torch.Generator().manual_seed(11))
    scores = [load_detector(p, device=device).score(batch).raw_scores.double().cpu() for p in (reference, path)]
    thresholds = [read_header(p)["calibration"]["threshold"] for p in (reference, path)]
    return {
        "largest_relative_score_difference": float(((scores[1] - scores[0]).abs() / scores[0].abs()).max()),
        "relative_threshold_difference": abs(thresholds[1] - thresholds[0]) / abs(thresholds[0]),
        "gate": read_header(path).get("precision_check"),
    }


def cpu_vs_gpu(path: Path, size: int) -> float:
    batch = torch.randn(16, 3, size, size, generator=torch.Generator().manual_seed(7))
    on_cpu = load_detector(path, device="cpu").score(batch).raw_scores.double()
    on_gpu = load_detector(path, device="cuda").score(batch).raw_scores.double().cpu()
    return float(((on_gpu - on_cpu).abs() / on_cpu.abs()).max())


def measure_precision(backbone, precision, reference, category, folder, device_name, args, results) -> None:
    """One ``train --precision``: its fit, the torch scorer beside the backbone floor, and against fp32."""
    model = folder / f"{backbone}-{precision}-{args.device}.padim" if precision != "fp32" else reference
    if precision != "fp32":
        try:
            # the fp32 reference's pictures: the two models differ by arithmetic alone
            seconds, detail = fit(args, backbone, category / "train" / "good", model, args.images, precision)
        except PadimError as error:  # bf16 on a GPU older than Ampere; a gate that refused
            say({"backbone": backbone, "step": "precision", "precision": precision, "skipped": str(error)}, results)
            return
        say(
            {"backbone": backbone, "step": "fit", "precision": precision, "seconds": round(seconds, 2), **detail},
            results,
        )
    detector = load_detector(model, device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        say(
            {
                "backbone": backbone,
                "step": "precision",
                "precision": precision,
                "batch": batch,
                "images_per_second": round(throughput(detector, args.size, batch, args.repeats), 1),
                "backbone_alone": round(backbone_floor(detector, args.size, batch, args.repeats), 1),
            },
            results,
        )
    if args.device == "cuda":  # the same scorer replayed from CUDA graphs, as the service runs it (PADIM_CUDA_GRAPHS)
        started = time.perf_counter()
        sizes = detector.capture_graphs(max(batches))
        capture = {"graph_sizes": list(sizes), "capture_seconds": round(time.perf_counter() - started, 2)}
        for batch in batches if sizes else []:
            say(
                {
                    "backbone": backbone,
                    "step": "cuda_graphs",
                    "precision": precision,
                    "batch": batch,
                    "images_per_second": round(throughput(detector, args.size, batch, args.repeats), 1),
                    **capture,
                },
                results,
            )
        if not sizes:
            say({"backbone": backbone, "step": "cuda_graphs", "skipped": "not captured (the log says why)"}, results)
    del detector
    if precision != "fp32":
        say(
            {
                "backbone": backbone,
                "step": "precision_vs_fp32",
                "precision": precision,
                "device": device_name,
                **against_fp32(model, reference, args.size, args.device),
            },
            results,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", default="resnet18,wide_resnet50_2")
    parser.add_argument("--images", type=int, default=100, help="training images (default 100)")
    parser.add_argument("--size", type=int, default=224, help="image size (default 224)")
    parser.add_argument("--batches", default="1,16,64", help="scoring batch sizes (default 1,16,64)")
    parser.add_argument("--fit-batch", type=int, default=32, help="batch size of the fit (default 32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per scoring figure (median)")
    parser.add_argument(
        "--precisions", default="fp32,bf16,fp16", help="train --precision values, side by side (default all three)"
    )
    parser.add_argument(
        "--fit-images",
        default="100,1000",
        help="picture counts of the fit's phases, per backbone (default 100,1000; empty: none)",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        help="the fits' --decode-workers (decoding and changed-copy threads; default: padim's own default)",
    )
    parser.add_argument("--cpu-fit", action="store_true", help="also fit on the CPU and compare thresholds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workdir", type=Path, help="keep the data and models here (default: a temporary folder)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/<date>-<machine>-gpu.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: torch sees no GPU here; run it on a GPU machine (or --device cpu for a dry run)",
            file=sys.stderr,
        )
        return 2
    folder = work_folder(args.workdir, "padim-gpu-bench-")
    fit_counts = [int(n) for n in args.fit_images.split(",") if n.strip()]
    (category,) = generate(
        folder / "data",
        ("weave",),
        train=max([args.images, *fit_counts]),
        test_good=1,
        test_defect=1,
        size=args.size,
        seed=0,
    )
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results: list[dict] = []
    for backbone in args.backbones.split(","):
        model = folder / f"{backbone}-{args.device}.padim"
        for count in fit_counts:  # the phases of a fit, by picture count (`padim train`'s report)
            seconds, detail = fit(
                args, backbone, category / "train" / "good", folder / f"{backbone}-{count}.padim", count
            )
            record = {"backbone": backbone, "step": "fit_phases", "images": count, "seconds": round(seconds, 2)}
            say({**record, **detail}, results)
        seconds, detail = fit(args, backbone, category / "train" / "good", model, args.images)
        say(
            {
                "backbone": backbone,
                "step": "fit",
                "device": device_name,
                "images": args.images,
                "size": args.size,
                "seconds": round(seconds, 2),
                **detail,
            },
            results,
        )
        for runtime, scorer in scorers(model, args.device, folder / "tensorrt"):
            if isinstance(scorer, str):
                say({"backbone": backbone, "step": "score", "runtime": runtime, "skipped": scorer}, results)
                continue
            for batch in (int(b) for b in args.batches.split(",")):
                rate = throughput(scorer, args.size, batch, args.repeats)
                say(
                    {
                        "backbone": backbone,
                        "step": "score",
                        "runtime": runtime,
                        "batch": batch,
                        "images_per_second": round(rate, 1),
                    },
                    results,
                )
            del scorer
        for precision in args.precisions.split(","):
            measure_precision(backbone, precision, model, category, folder, device_name, args, results)
        if args.device == "cuda":
            say(
                {
                    "backbone": backbone,
                    "step": "cpu_vs_gpu",
                    "largest_relative_score_difference": cpu_vs_gpu(model, args.size),
                    "stated_tolerance": CROSS_DEVICE_RTOL,
                },
                results,
            )
        if args.cpu_fit:
            on_cpu = folder / f"{backbone}-cpu-fit.padim"
            # the GPU model's pictures (they were all the generated ones, which --fit-images may make many more)
            cpu_seconds, _ = fit(args, backbone, category / "train" / "good", on_cpu, args.images, device="cpu")
            first, second = (read_header(p)["calibration"]["threshold"] for p in (model, on_cpu))
            say(
                {
                    "backbone": backbone,
                    "step": "threshold",
                    "fit_device": device_name,
                    "cpu_fit_seconds": round(cpu_seconds, 2),
                    "relative_threshold_difference": abs(first - second) / abs(second),
                },
                results,
            )
    if args.save:
        name = f"{datetime.date.today()}-{machine_name()}-gpu.json"
        target = Path(__file__).resolve().parent / "results" / name
        target.write_text(
            json.dumps({"device": device_name, "torch": torch.__version__, "results": results}, indent=2) + "\n"
        )
        print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
