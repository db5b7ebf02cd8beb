"""Scoring throughput of padim (CPU, or GPU with --device cuda) and where the time goes.

A seeded resnet18 state_dict file (ImageNet weights cannot be downloaded here), 224-px
generated images, layers 1-3, 100 channels. The torch breakdown is measured on model-input
tensors, and set against this machine's roofs, measured on the spot (sgemm GFLOP/s of a 2048^2
product, copy bandwidth of 256 MB): each stage's floor is its arithmetic at the sgemm roof or
its bytes at the bandwidth roof, whichever is longer, and the share of the floor reached is
printed per stage and for the whole scorer. Then every installed runtime (torch eager, onnxruntime, OpenVINO; see
padim.models.deploy.runtimes) is timed side by side in interleaved rounds, at batch 1 and at
--batch-size, two ways: the scorer alone (normalised tensor in, maps and scores out) and end to
end (decoded images in: resize + normalise + scorer). It prints min / median img/s, the ratio
to torch eager, and the largest score difference from torch. The side-by-side comparison with
anomalib is benchmarks/compare_anomalib.py; with AnomaVision, benchmarks/compare_anomavision.py.

    python benchmarks/throughput.py [--device cuda] [--batch-size 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score
from timing import median_seconds, seeded_resnet18, work_folder

from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.models import PadimConfig, fit_detector, training_images
from padim.models.data.synthetic import generate
from padim.models.evaluation.metrics import read_mvtec_category


def load_batch(paths, detector, batch_size):
    images = [Image.open(p).convert("RGB") for p in paths[:batch_size]]
    while len(images) < batch_size:
        images += images[: batch_size - len(images)]
    return detector.preprocess(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--train-images", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the runtime comparison")
    parser.add_argument("--workdir", type=Path, help="keep generated data and weights here")
    args = parser.parse_args()

    work = work_folder(args.workdir, "padim-bench-")
    work.mkdir(parents=True, exist_ok=True)
    category = work / "data" / "carpet"
    if not category.exists():
        generate(
            work / "data",
            ("carpet",),
            train=args.train_images,
            test_good=10,
            test_defect=5,
            size=args.image_size,
            seed=1,
        )
    weights = seeded_resnet18(work / "resnet18-seed0.pth")

    config = PadimConfig(
        weights=str(weights),
        image_size=args.image_size,
        batch_size=args.batch_size,
        device=args.device,
        decode_workers=2,
    )
    start = time.perf_counter()
    detector, _ = fit_detector(config, training_images(category / "train" / "good"), progress=False)
    fit_seconds = time.perf_counter() - start

    samples = read_mvtec_category(category)
    test_paths = [s.path for s in samples]
    labels = np.array([s.is_anomalous for s in samples])
    scores = []
    for i in range(0, len(test_paths), args.batch_size):
        batch = detector.preprocess([Image.open(p).convert("RGB") for p in test_paths[i : i + args.batch_size]])
        scores.append(detector.score(batch).raw_scores.cpu())
    auroc = float(roc_auc_score(labels, torch.cat(scores).numpy()))

    batch = load_batch(test_paths, detector, args.batch_size).to(detector.device)
    b = args.batch_size
    model, embedder = detector.model, detector.model.embedder
    with torch.inference_mode():
        features = embedder.extractor(batch)
        embedded = embedder.embedding(features)
        flat = embedded.permute(0, 2, 3, 1).reshape(b, -1, embedder.embedding_dim)
        squared = squared_mahalanobis(flat, model.mean, model.precision_factor)
        parts = {
            "backbone": median_seconds(lambda: embedder.extractor(batch), args.repeats),
            "embedding": median_seconds(lambda: embedder.embedding(features), args.repeats),
            "mahalanobis": median_seconds(
                lambda: squared_mahalanobis(flat, model.mean, model.precision_factor), args.repeats
            ),
            "upsample_blur_max": median_seconds(
                lambda: image_scores(anomaly_maps(squared, model.grid_shape, args.image_size, 4.0)), args.repeats
            ),
        }
        total = median_seconds(lambda: detector.score(batch), args.repeats)
        single = median_seconds(lambda: detector.score(batch[:1]), args.repeats)
    ours = {
        "images_per_second_batch": b / total,
        "images_per_second_batch1": 1 / single,
        "seconds_per_batch": total,
        "breakdown_seconds": parts,
        "image_auroc": auroc,
        "fit_seconds": fit_seconds,
    }
    report = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "device": str(detector.device),
        "torch": torch.__version__,
        "batch_size": b,
        "image_size": args.image_size,
        "padim": ours,
    }
    print(
        f"padim   : {ours['images_per_second_batch']:.1f} img/s at batch {b} "
        f"({1 / single:.1f} img/s at batch 1), image AUROC {auroc:.3f}"
    )
    for name, seconds in parts.items():
        print(f"  {name:<18} {seconds * 1000:8.1f} ms/batch ({100 * seconds / total:4.1f}%)")
    with torch.inference_mode():
        half = model.precision_factor.half()
        parts16 = median_seconds(lambda: squared_mahalanobis(flat, model.mean, half), args.repeats)
    print(f"  {'mahalanobis, float16 factors (chunked upcast)':<18} {parts16 * 1000:8.1f} ms/batch")
    report["padim"]["mahalanobis_float16_seconds"] = parts16
    report["floor"] = floor_report(detector, batch, features, flat, parts, total, args)

    report["runtimes"] = compare_runtimes(detector, work, test_paths, args)
    print(json.dumps(report))


def machine_roofs(device: str, repeats: int) -> dict:
    """This machine's roofs, measured on the spot: sgemm GFLOP/s and copy bandwidth GB/s."""
    n = 2048
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sgemm = 2 * n**3 / median_seconds(lambda: a @ b, repeats) / 1e9
    source = torch.randn(64 * 2**20, device=device)  # 256 MB, far beyond any cache
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / median_seconds(lambda: target.copy_(source), repeats) / 1e9  # read + write
    return {"sgemm_gflops": sgemm, "bandwidth_gbps": bandwidth}


def floor_report(detector, batch, features, flat, parts: dict, total: float, args) -> dict:
    """Each stage's floor (its arithmetic at the sgemm roof, or its bytes at the bandwidth roof,
    whichever is longer) against what it took; and the share of the whole floor reached."""
    from torch.utils.flop_counter import FlopCounterMode

    roofs = machine_roofs(args.device, args.repeats)
    model, embedder = detector.model, detector.model.embedder
    b, (pixels, dim), size = batch.shape[0], model.mean.shape, args.image_size
    height, width = model.grid_shape
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        embedder.extractor(batch)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    work = {  # (floating-point operations, bytes that must move)
        "backbone": (
            counter.get_total_flops(),
            nbytes(batch) + sum(nbytes(f) for f in features) + sum(nbytes(p) for p in embedder.extractor.parameters()),
        ),
        "embedding": (0, sum(nbytes(f) for f in features) + nbytes(flat)),
        "mahalanobis": (
            2 * pixels * b * dim * dim,
            nbytes(model.precision_factor) + nbytes(model.mean) + 2 * nbytes(flat),
        ),
        "upsample_blur_max": (2 * b * (size * height * width + size * size * width), b * size * size * 4),
    }
    report = {"roofs": roofs, "stages": {}}
    print(
        f"floor of this machine: sgemm {roofs['sgemm_gflops']:.0f} GFLOP/s, copy bandwidth "
        f"{roofs['bandwidth_gbps']:.1f} GB/s"
    )
    floor_total = 0.0
    for name, (flops, moved) in work.items():
        floor = max(flops / (roofs["sgemm_gflops"] * 1e9), moved / (roofs["bandwidth_gbps"] * 1e9))
        floor_total += floor
        report["stages"][name] = {
            "gflop": flops / 1e9,
            "mbytes": moved / 1e6,
            "floor_seconds": floor,
            "seconds": parts[name],
            "share_of_floor": floor / parts[name],
        }
        print(
            f"  {name:<18} {parts[name] * 1000:8.1f} ms, floor {floor * 1000:7.1f} ms "
            f"({flops / 1e9:6.2f} GFLOP, {moved / 1e6:6.1f} MB): {100 * floor / parts[name]:5.1f}% of the floor"
        )
    report["floor_seconds"], report["share_of_floor"] = floor_total, floor_total / total
    print(
        f"  whole scorer       {total * 1000:8.1f} ms, floor {floor_total * 1000:7.1f} ms: "
        f"{100 * floor_total / total:.1f}% of the floor ({b / floor_total:.1f} img/s would be the floor)"
    )
    return report


def compare_runtimes(detector, work: Path, test_paths, args) -> dict:
    """Every installed runtime, interleaved: scorer alone and end to end, batch 1 and batch B."""
    from padim.models.deploy.export import ExportError
    from padim.models.deploy.runtimes import load_scorer
    from padim.models.fit.model_file import save_detector

    path = work / "throughput.padim"
    save_detector(detector, path)
    scorers = {}
    for runtime in ("torch", "onnxruntime", "openvino"):
        try:
            scorers[runtime] = load_scorer(path, runtime, args.device)
        except ExportError as error:
            print(f"  {runtime}: not measured ({error})")
    images = [Image.open(p).convert("RGB") for p in test_paths[: args.batch_size]]
    while len(images) < args.batch_size:
        images += images[: args.batch_size - len(images)]
    batch = scorers["torch"].preprocess(images)
    reference = scorers["torch"].score(batch).raw_scores.cpu()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    cases = {}
    for name, scorer in scorers.items():
        difference = float(((scorer.score(batch).raw_scores.cpu() - reference).abs() / reference.abs()).max())
        cases[name] = {"max_relative_score_difference": difference}
        for b in sorted({1, args.batch_size}):
            cases[name][f"scorer_b{b}"] = lambda s=scorer, x=batch[:b]: s.score(x)
            cases[name][f"end_to_end_b{b}"] = lambda s=scorer, i=images[:b]: s.score(s.preprocess(i))
    times: dict[str, dict[str, list[float]]] = {n: {} for n in cases}
    for fns in cases.values():  # warm-up
        for fn in fns.values():
            if callable(fn):
                fn()
    for _ in range(args.rounds):
        for name, fns in cases.items():
            for key, fn in fns.items():
                if not callable(fn):
                    continue
                time.sleep(0.3)  # each timing starts on idle cores: no runtime's pool still spinning
                started = time.perf_counter()
                fn()
                sync()
                times[name].setdefault(key, []).append(time.perf_counter() - started)
    result = {}
    print(f"runtimes, {args.rounds} interleaved rounds (img/s: median, best; ratio of medians to torch eager):")
    for name in cases:
        result[name] = {"max_relative_score_difference": cases[name]["max_relative_score_difference"]}
        for key, seconds in times[name].items():
            b = int(key.rsplit("b", 1)[1])
            median, best = b / float(np.median(seconds)), b / min(seconds)
            torch_median = b / float(np.median(times["torch"][key]))
            result[name][key] = {
                "median_images_per_second": median,
                "best_images_per_second": best,
                "ratio_to_torch": median / torch_median,
            }
            print(f"  {name:<12} {key:<14} {median:7.1f} {best:7.1f}  x{median / torch_median:4.2f}")
        print(
            f"  {name:<12} largest score difference from torch: "
            f"{result[name]['max_relative_score_difference']:.1e} relative"
        )
    return result


if __name__ == "__main__":
    sys.exit(main())
