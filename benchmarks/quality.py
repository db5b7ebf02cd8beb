"""Detection quality of the scoring options, by measurement: image score, neighbourhood features,
channel ensembles, crop and blur, on generated data (or MVTec AD folders), several channel seeds each.

What it does, per category:

1. the backbone runs once per preprocessing (plain resize, or centre crop of 87.5% first, as the
   paper and anomalib resize to 256 and crop 224) over the training, normal test and defect
   test images, with the product's own modules (:class:`padim.models.Fit`'s embedder);
2. per channel seed, neighbourhood (1, 3) and reduction (random subset, semi-orthogonal
   projection), the embedding of the product's :class:`~padim.models.features.embedding.Embedding`,
   the fitted Gaussian, the leave-one-out distances of the training images (what ``train``
   calibrates on, :func:`padim.core.out_of_fold.out_of_fold_squared_distances`) and the test
   images' distances (:func:`padim.core.scoring.squared_mahalanobis`);
3. per image score (``map_max``, ``patch_max``, ``top_mean``) and blur sigma, the maps and scores
   (:func:`padim.core.scoring.anomaly_maps`, :func:`~padim.core.scoring.image_scores`), the
   calibrated threshold for 1% false alarms from the out-of-fold scores
   (:class:`padim.core.calibration.Calibration`, as ``train`` sets it), and: image AUROC, pixel
   AUROC, PRO (to 30% FPR), the defect recall and the false-alarm rate on unseen normal images at
   that threshold;
4. ensembles: the seeds' distance grids, each divided by its own calibrated threshold, averaged.

**Robustness** (``--grid robust``, the grid defaults are chosen on): every option is also read on
normal pictures under the small changes a line makes (:data:`NUISANCES`): another region of the same
material or another placement of the part (the generator's ``region``, 0.25 and 0.5), brightness and
contrast +-10%, a shift of 1-3 px, a turn of 1 degree, defocus (Gaussian blur sigma 0.5-1 px) and JPEG
quality 80, each drawn on the unseen normal pictures with :func:`padim.models.data.changes.apply`. For
every neighbourhood, smoothing, image score, calibration folds and calibration (:data:`CALIBRATIONS`:
nothing expected; ``--expect`` presets, their copies scored or also fitted, one seeded draw or the
maximum of four) it reports the false-alarm rate at the calibrated threshold on each nuisance, beside
image AUROC and recall. The out-of-fold scores of changed copies are the product's
(:func:`padim.core.out_of_fold.out_of_fold_squared_distances` with ``copies``), the copies the
product's seeded draws.

Then the scoring time of each option (the product's scorer, batch 16), the model-file size and the
fit's memory plan, and a product check: ``padim.fit`` + ``Detector.scores`` with the best option
gives the scores this script computed. Results as JSON (``--output``) and a table on stdout.

The backbone is seeded random resnet18 weights (ImageNet weights cannot be fetched here) unless
``--weights`` names a state_dict file: every figure says which.

    python benchmarks/quality.py                        # the frozen benchmark (25 minutes on 2 cores)
    python benchmarks/quality.py --quick                # 2 categories, fewer images: a smoke run
    python benchmarks/quality.py --grid main            # neighbourhood x image score x sigma 0/2/4 (12 minutes)
    python benchmarks/quality.py --grid robust          # the same x folds x calibration, under nuisances
    python benchmarks/quality.py --costs                # scoring time only: each option, today's default vs the paper
    python benchmarks/quality.py --mvtec /data/mvtec --categories bottle,carpet --weights r18.pth
    python benchmarks/quality.py --photographed --grid robust   # photographed materials, their other region a nuisance
    python benchmarks/quality.py --grid robust --shrinkage 0.5  # every option with its Gaussians shrunk

``--photographed``: categories cut from the photographs scikit-image ships (benchmarks/photographed.py: brick,
grass, gravel, stained tissue, the moon), training crops from one half of each photograph, normal test crops
from the same half and (``--grid robust``: the ``region`` nuisance) from the other half. ``--shrinkage W``: every
Gaussian ``(1 - W) S_p + W T + epsilon I`` (``train --shrinkage``), its out-of-fold scores the product's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from photographed import MATERIALS, write_category
from PIL import Image
from sklearn.metrics import roc_auc_score
from timing import machine_name, median_seconds, work_folder

from padim.core.calibration import Calibration, fold_of
from padim.core.out_of_fold import out_of_fold_squared_distances
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import Shrinkage, batch_state, covariance, finalise
from padim.models import Fit, PadimConfig, list_images
from padim.models.data.changes import Draw, Expected, apply, seeded
from padim.models.data.synthetic import CATEGORIES, DEFECTS, MORE_DEFECTS, generate
from padim.models.evaluation.metrics import per_region_overlap, read_mvtec_category
from padim.models.features.embedding import Embedding, model_input
from padim.models.fit.memory_plan import FitFacts, plan_fit
from padim.models.options import Gaussian
from padim.models.scoring.model import PadimModel

HERE = Path(__file__).resolve().parent
IMAGE_SCORES = ("map_max", "patch_max", "top_mean")
SIGMAS = (2.0, 4.0, 8.0)
#: ``--grid main``: the neighbourhood and the blur alone (plain resize, random subset, single models), sigma 0 too.
MAIN_SIGMAS = (0.0, 2.0, 4.0)
CROP = 0.875  # 224 of 256
#: PaDiM as published (configs/paper.yaml), the base every option is measured against.
PAPER = {
    "neighbourhood": 1,
    "blur_sigma": 4.0,
    "image_score": "map_max",
    "expect": "",
    "fit_changes": False,
    "shrinkage": 0.0,
}
#: The small changes of a line, drawn on unseen normal pictures (``region*``: generated from another region).
NUISANCES = ("region", "region_far", "brightness", "contrast", "shift", "rotate", "blur", "jpeg")
#: ``region`` and ``region_far``: the generator's ``region`` of their pictures.
REGIONS = {"region": 0.25, "region_far": 0.5}
#: Calibrations of ``--grid robust``: (``expect`` preset, copies drawn a picture, copies fitted).
CALIBRATIONS = {
    "stable": ("stable", 0, False),
    "typical": ("typical", 1, False),
    "typical max of 4": ("typical", 4, False),
    "typical + fit": ("typical", 1, True),
    "rough": ("rough", 1, False),
    "rough + fit": ("rough", 1, True),
}
ROBUST_FOLDS = ("loo", 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mvtec", type=Path, help="a folder of MVTec AD categories (default: generated data)")
    parser.add_argument("--categories", help="default: every generated category, or every photographed material")
    parser.add_argument(
        "--photographed",
        action="store_true",
        help="categories cut from photographs (benchmarks/photographed.py: brick, grass, gravel, tissue, moon) instead "
        "of generated ones; with --grid robust their other region is the region nuisance",
    )
    parser.add_argument(
        "--shrinkage", type=float, default=0.0, help="every option's Gaussians shrunk toward the pooled covariance"
    )
    parser.add_argument("--train", type=int, default=100, help="normal training images per category (generated)")
    parser.add_argument("--test-good", type=int, default=100, help="unseen normal images per category (generated)")
    parser.add_argument("--defect-images", type=int, default=24, help="images per defect kind (5 kinds, generated)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="categories measured at once (processes; the cores are shared out)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="channel seeds of every option")
    parser.add_argument("--weights", default="random", help="random (seeded resnet18, seed 0) or a resnet18 state_dict")
    parser.add_argument("--false-alarm-rate", type=float, default=0.01)
    parser.add_argument(
        "--grid",
        choices=("full", "main", "robust"),
        default="full",
        help="full: every option; main: neighbourhood 1/3 x sigma 0/2/4 x image score only (a third "
        "of the time); robust: main x folds x calibration, with false alarms under each nuisance",
    )
    parser.add_argument("--quick", action="store_true", help="2 categories, 40/40/8 images, 2 seeds")
    parser.add_argument("--costs", action="store_true", help="only the scoring costs (on the first category)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument(
        "--rows",
        type=Path,
        help="the measurements an earlier run kept (RESULTS.rows.json) when its "
        "costs or product check failed: summarise and check them without measuring again",
    )
    parser.add_argument(
        "--output", type=Path, help="results JSON (default benchmarks/results/DATE-MACHINE-quality.json)"
    )
    args = parser.parse_args()
    if args.quick:
        quick = "tissue,brick" if args.photographed else "carpet,pill"
        args.categories, args.train, args.test_good, args.defect_images, args.seeds = quick, 40, 40, 8, "0,1"
    default = MATERIALS if args.photographed else CATEGORIES
    categories = [c for c in (args.categories or ",".join(default)).split(",") if c]
    seeds = [int(s) for s in args.seeds.split(",")]
    work = work_folder(args.workdir, "padim-quality-")
    data = args.mvtec or work / ("photographed" if args.photographed else "data")
    if args.photographed:
        per_defect = max(1, args.defect_images // 5)
        for category in categories:
            write_category(data, category, args.train, args.test_good, args.test_good, per_defect, seed=24)
    elif args.mvtec is None and not all((data / c).exists() for c in categories):
        generate(
            data,
            tuple(categories),
            train=args.train,
            test_good=args.test_good,
            test_defect=args.defect_images,
            size=256,
            seed=24,
            defects=DEFECTS + MORE_DEFECTS,
        )
    regions = {}  # normal pictures of other regions of the material (generated data only)
    if args.grid == "robust" and args.mvtec is None and not args.photographed:
        for nuisance, region in REGIONS.items():
            regions[nuisance] = work / f"data-{nuisance}"
            if not all((regions[nuisance] / c).exists() for c in categories):
                generate(
                    regions[nuisance],
                    tuple(categories),
                    train=0,
                    test_good=args.test_good,
                    test_defect=0,
                    size=256,
                    seed=25,
                    region=region,
                )
    weights = args.weights
    if weights == "random":  # one backbone for every seed: the seed then draws the channels alone
        weights = str(work / "resnet18-random-seed0.pt")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            import torchvision

            torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    # the paper's scoring as the base (padim's default before 2026-11-24): every option is measured against it
    base = PadimConfig(
        weights=weights, device="cpu", false_alarm_rate=args.false_alarm_rate, **{**PAPER, "shrinkage": args.shrinkage}
    )
    if args.costs:
        costs = {
            "machine": machine_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "category": categories[0],
            **option_costs(base, data / categories[0]),
        }
        output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-quality-costs.json"
        output.write_text(json.dumps(costs, indent=1) + "\n")
        print(json.dumps(costs, indent=1))
        print(f"results: {output}")
        return
    started = time.time()
    suffix = {"full": "", "main": "-main", "robust": "-robust"}[args.grid]
    output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-quality{suffix}.json"
    if args.rows is not None:  # the measurements of an earlier run whose checks did not finish
        kept = json.loads(args.rows.read_text())
        rows, measured = kept["rows"], kept["seconds"]
    else:
        rows = []
        jobs = max(1, min(args.jobs, len(categories)))
        threads = max(1, (os.cpu_count() or 1) // jobs)
        tasks = [
            (
                data / category,
                base,
                seeds,
                args.false_alarm_rate,
                args.grid,
                {"region": data / category / "region"}
                if args.photographed and args.grid == "robust"
                else {k: v / category for k, v in regions.items()},
                threads,
            )
            for category in categories
        ]
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for category, part in zip(categories, pool.imap(measure_in_process, tasks), strict=True):
                rows += part
                print(f"{category}: done after {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        measured = round(time.time() - started)
        # kept should the checks below fail: --rows FILE goes on from here
        output.with_suffix(".rows.json").write_text(json.dumps({"seconds": measured, "rows": rows}))
    torch.set_num_threads(os.cpu_count() or 1)
    summary = summarise(rows)
    costs = option_costs(base, data / categories[0])
    if args.grid == "robust":
        bound = promise_bound(args.train, args.false_alarm_rate)
        choice = best_robust_option(summary, bound)
        costs["calibrations"] = calibration_costs(base, data / categories[0])
    else:
        bound, choice = None, best_product_option(summary)
    check = product_check(base.replace(**choice), data / categories[0], args.false_alarm_rate)
    output.with_suffix(".rows.json").unlink(missing_ok=True)
    result = {
        "machine": machine_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "weights": "seeded random resnet18 (seed 0), not ImageNet" if args.weights == "random" else args.weights,
        "data": str(args.mvtec)
        if args.mvtec
        else f"generated (models/data/synthetic.py, seed 24, 256 px): {args.train} training, "
        f"{args.test_good} unseen normal, "
        f"{args.defect_images} x {len(DEFECTS + MORE_DEFECTS)} defect images ({', '.join(DEFECTS + MORE_DEFECTS)}) "
        "per category",
        "nuisances": {n: (f"generated region {REGIONS[n]}" if n in REGIONS else NUISANCE_TEXT[n]) for n in NUISANCES}
        if args.grid == "robust"
        else None,
        "calibrations": {
            name: {"expect": str(Expected.parse(preset)), "copies": copies, "fitted": fitted}
            for name, (preset, copies, fitted) in CALIBRATIONS.items()
        }
        if args.grid == "robust"
        else None,
        "grid": args.grid,
        "categories": categories,
        "seeds": seeds,
        "false_alarm_rate": args.false_alarm_rate,
        "seconds": measured,
        "summary": summary,
        "costs": costs,
        "product_check": check,
        "promise_bound": bound,
        "choice": choice,
        "rows": rows,
    }
    output.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"results: {output}")


# ---------------------------------------------------------------------- measuring
def measure_in_process(task) -> list[dict]:
    *arguments, threads = task
    torch.set_num_threads(threads)
    return measure_category(*arguments)


def measure_category(
    root: Path,
    base: PadimConfig,
    seeds: list[int],
    false_alarm_rate: float,
    grid: str = "full",
    regions: dict[str, Path] | None = None,
) -> list[dict]:
    """Every option on one category: a row per (preprocessing, reduction, neighbourhood, seed or ensemble,
    image score, sigma); with ``grid`` robust, per (neighbourhood, seed, sigma, image score, folds, calibration)."""
    if grid == "robust":
        return measure_robust(root, base, seeds, false_alarm_rate, regions or {})
    train = list_images(root / "train" / "good")
    samples = read_mvtec_category(root)
    labels = np.array([s.is_anomalous for s in samples])
    rows = []
    main = grid == "main"
    for crop in (None,) if main else (None, CROP):
        fit = Fit.start(base)
        train_features = features(fit, train, crop)
        test_features = features(fit, [s.path for s in samples], crop)
        masks = load_masks(samples, base.features.image_size, crop)
        combos = [("random", 1), ("random", 3)] + (
            [("semi_orthogonal", 1), ("semi_orthogonal", 3)] if crop is None and not main else []
        )
        for reduction, neighbourhood in combos:
            config = base.replace(reduction=reduction, neighbourhood=neighbourhood)
            members = []
            for seed in seeds:
                embedding = Embedding.create(
                    config.spec,
                    config.features.stages,
                    config.embedding_dim_or_default(),
                    reduction,
                    seed,
                    neighbourhood,
                )
                oof, test = distances(embedding, train_features, test_features, config.gaussian)
                members.append((oof, test))
                # the blur is measured on the main axis (plain resize, random subset); the rest at sigma 4
                sigmas = MAIN_SIGMAS if main else SIGMAS if crop is None and reduction == "random" else (4.0,)
                rows += evaluate(
                    root.name,
                    {"crop": crop, "reduction": reduction, "neighbourhood": neighbourhood, "seed": seed},
                    oof,
                    test,
                    labels,
                    masks,
                    samples,
                    config,
                    false_alarm_rate,
                    sigmas,
                )
            if reduction == "random" and len(seeds) > 1 and not main:
                oof, test = ensemble(members, config, false_alarm_rate)
                rows += evaluate(
                    root.name,
                    {
                        "crop": crop,
                        "reduction": reduction,
                        "neighbourhood": neighbourhood,
                        "seed": f"ensemble of {len(seeds)}",
                    },
                    oof,
                    test,
                    labels,
                    masks,
                    samples,
                    config,
                    false_alarm_rate,
                    (4.0,),
                    squared=False,
                )
        del train_features, test_features
    return rows


def features(fit: Fit, paths: list[Path], crop: float | None) -> list[torch.Tensor]:
    """The backbone's stages of every image, ``[(N, C_l, H_l, W_l)]``, as the product preprocesses them."""
    out = []
    for start in range(0, len(paths), 32):
        images = [cropped(Image.open(p).convert("RGB"), crop) for p in paths[start : start + 32]]
        out.append(fit.embedder.extractor(model_input(fit.embedder.preprocess(images))))
    return [torch.cat(parts) for parts in zip(*out, strict=True)]


def cropped(image: Image.Image, crop: float | None) -> Image.Image:
    if crop is None:
        return image
    width, height = image.size
    w, h = round(width * crop), round(height * crop)
    left, top = (width - w) // 2, (height - h) // 2
    return image.crop((left, top, left + w, top + h))


def load_masks(samples, size: int, crop: float | None) -> np.ndarray:
    masks = []
    for sample in samples:
        if sample.mask_path is None:
            masks.append(np.zeros((size, size), dtype=bool))
            continue
        mask = cropped(Image.open(sample.mask_path).convert("L"), crop).resize((size, size), Image.NEAREST)
        masks.append(np.asarray(mask) > 127)
    return np.stack(masks)


def embed(embedding: Embedding, stages: list[torch.Tensor]) -> torch.Tensor:
    """``(N, P, D)`` embeddings of stored backbone stages, a batch at a time."""
    parts = []
    for start in range(0, stages[0].shape[0], 64):
        out = embedding([s[start : start + 64] for s in stages])  # (B, D, H, W)
        parts.append(out.permute(0, 2, 3, 1).reshape(out.shape[0], -1, out.shape[1]))
    return torch.cat(parts)


def distances(
    embedding: Embedding, train: list[torch.Tensor], test: list[torch.Tensor], gaussian: Gaussian
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out squared distances of the training images ``(N, P)`` and the test images' ``(T, P)``."""
    x = embed(embedding, train)
    state = batch_state(x.double())
    shrunk = Shrinkage.of(state, gaussian.epsilon, gaussian.shrinkage)
    oof = torch.empty(x.shape[0], x.shape[1], dtype=torch.float64)
    for start in range(0, x.shape[1], 256):  # pixel slices, as the fit does
        stop = min(start + 256, x.shape[1])
        oof[:, start:stop] = out_of_fold_squared_distances(
            covariance(state, start, stop),
            state.mean[start:stop],
            x.shape[0],
            x[:, start:stop],
            [1] * x.shape[0],
            shrunk,
        )
    mean, factor = finalise(state, gaussian.epsilon, shrinkage=gaussian.shrinkage)
    y = embed(embedding, test)
    test_squared = torch.cat([squared_mahalanobis(y[i : i + 32], mean, factor) for i in range(0, len(y), 32)])
    return oof.float(), test_squared


def ensemble(members, config: PadimConfig, false_alarm_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Average of the members' distance grids, each divided by its own calibrated ``map_max`` threshold."""
    oof_sum, test_sum = 0, 0
    for oof, test in members:
        side = int(round(oof.shape[1] ** 0.5))
        scores = image_scores(
            anomaly_maps(oof, (side, side), config.features.image_size, config.scoring.blur_sigma)
        ).double()
        threshold = Calibration.from_scores(scores, false_alarm_rate).threshold
        oof_sum = oof_sum + oof.clamp_min(0).sqrt() / threshold
        test_sum = test_sum + test.clamp_min(0).sqrt() / threshold
    return oof_sum / len(members), test_sum / len(members)


def evaluate(
    category: str,
    option: dict,
    oof: torch.Tensor,
    test: torch.Tensor,
    labels: np.ndarray,
    masks: np.ndarray,
    samples,
    config: PadimConfig,
    false_alarm_rate: float,
    sigmas=SIGMAS,
    squared: bool = True,
) -> list[dict]:
    """Rows for every sigma and image score of one set of distances (``squared``: else plain distances)."""
    if not squared:  # an ensemble's averaged distances: square them, as the maps take squared distances
        oof, test = oof.square(), test.square()
    side = int(round(oof.shape[1] ** 0.5))
    good = labels == 0
    defect_kinds = sorted({s.defect for s in samples} - {"good"})
    rows = []
    for sigma in sigmas:
        test_maps = torch.cat(
            [
                anomaly_maps(test[i : i + 32], (side, side), config.features.image_size, sigma)
                for i in range(0, len(test), 32)
            ]
        )
        maps = test_maps.numpy()
        pixel_auroc, pro = pixel_metrics(maps, masks)
        for method in IMAGE_SCORES:
            scores = np.concatenate(
                [image_scores(test_maps[i : i + 64], method, test[i : i + 64]).numpy() for i in range(0, len(test), 64)]
            )
            oof_scores = torch.cat(
                [
                    image_scores(
                        anomaly_maps(oof[i : i + 64], (side, side), config.features.image_size, sigma),
                        method,
                        oof[i : i + 64],
                    )
                    for i in range(0, len(oof), 64)
                ]
            ).double()
            threshold = Calibration.from_scores(oof_scores, false_alarm_rate).threshold
            flagged = scores >= threshold
            rows.append(
                {
                    "category": category,
                    **option,
                    "sigma": sigma,
                    "image_score": method,
                    "image_auroc": float(roc_auc_score(labels, scores)),
                    "pixel_auroc": pixel_auroc,
                    "pro": pro,
                    "recall": float(flagged[~good].mean()),
                    "false_alarms": float(flagged[good].mean()),
                    "recall_by_defect": {
                        d: float(flagged[np.array([s.defect == d for s in samples])].mean()) for d in defect_kinds
                    },
                }
            )
    return rows


# ---------------------------------------------------------------------- robustness (--grid robust)
NUISANCE_TEXT = {
    "brightness": "every channel x (1 +- 0.1), sign drawn",
    "contrast": "contrast x (1 +- 0.1), sign drawn",
    "shift": "moved 1-3 px in a drawn direction",
    "rotate": "turned +-1 degree, sign drawn",
    "blur": "Gaussian blur sigma 0.5-1 px",
    "jpeg": "JPEG quality 80",
}


def nuisance(kind: str, rng: np.random.Generator) -> Draw:
    """One nuisance of ``kind`` at the magnitude the benchmark reads false alarms at (:data:`NUISANCE_TEXT`)."""
    sign = float(rng.choice([-1.0, 1.0]))
    if kind == "brightness":
        return Draw(brightness=1 + 0.1 * sign)
    if kind == "contrast":
        return Draw(contrast=1 + 0.1 * sign)
    if kind == "shift":
        length, angle = rng.uniform(1, 3), rng.uniform(0, 2 * np.pi)
        return Draw(dx=float(length * np.cos(angle)), dy=float(length * np.sin(angle)))
    if kind == "rotate":
        return Draw(angle=sign)
    if kind == "blur":
        return Draw(sigma=float(rng.uniform(0.5, 1.0)))
    if kind == "jpeg":
        return Draw(quality=80)
    raise ValueError(kind)


def picture_features(fit: Fit, pictures: list[Image.Image]) -> list[torch.Tensor]:
    """The backbone's stages of pictures in memory, as :func:`features` of files."""
    out = [
        fit.embedder.extractor(model_input(fit.embedder.preprocess(pictures[i : i + 32])))
        for i in range(0, len(pictures), 32)
    ]
    return [torch.cat(parts) for parts in zip(*out, strict=True)]


def sliced_out_of_fold(
    x: torch.Tensor, sizes: list[int], gaussian: Gaussian, state=None, copies: torch.Tensor | None = None
) -> torch.Tensor:
    """``(R, P)`` float32 out-of-fold squared distances of ``x``'s rows (or of their ``copies``), in pixel slices."""
    state = state if state is not None else batch_state(x)
    shrunk = Shrinkage.of(state, gaussian.epsilon, gaussian.shrinkage)
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float64)
    for start in range(0, x.shape[1], 256):
        stop = min(start + 256, x.shape[1])
        out[:, start:stop] = out_of_fold_squared_distances(
            covariance(state, start, stop),
            state.mean[start:stop],
            int(state.count),
            x[:, start:stop],
            sizes,
            shrunk,
            copies=None if copies is None else copies[:, start:stop],
        )
    return out.float()


def fold_order(names: list[str], folds) -> tuple[list[int], list[int]]:
    """Rows ordered by calibration fold (the product's :func:`fold_of`), and the fold sizes."""
    if folds == "loo":
        return list(range(len(names))), [1] * len(names)
    labels = [fold_of(n, folds) for n in names]
    order = sorted(range(len(names)), key=lambda i: (labels[i], names[i]))
    sizes = [labels.count(k) for k in sorted(set(labels))]
    return order, sizes


def interleave(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each picture's row, then its copy's (as the product spools them)."""
    return torch.stack([x, y], dim=1).reshape(-1, *x.shape[1:])


def measure_robust(
    root: Path, base: PadimConfig, seeds: list[int], false_alarm_rate: float, regions: dict[str, Path]
) -> list[dict]:
    """A row per (neighbourhood, seed, sigma, image score, folds, calibration): image AUROC, pixel AUROC, PRO,
    recall and false alarms on unseen normal pictures as drawn and under each nuisance."""
    train_paths = list_images(root / "train" / "good")
    names = [p.name for p in train_paths]
    train = [Image.open(p).convert("RGB") for p in train_paths]
    samples = read_mvtec_category(root)
    labels = np.array([s.is_anomalous for s in samples])
    good = [Image.open(s.path).convert("RGB") for s in samples if not s.is_anomalous]
    rng = np.random.default_rng(7)
    sets = {n: [apply(p, nuisance(n, rng)) for p in good] for n in NUISANCES if n not in REGIONS}
    for n, folder in regions.items():
        sets[n] = [Image.open(p).convert("RGB") for p in list_images(folder / "test" / "good")]
    copies_of = {}  # preset -> [copy j of every training picture]
    for preset, count, _ in CALIBRATIONS.values():
        if count:
            expected = Expected.parse(preset)
            have = copies_of.setdefault(preset, [])
            for j in range(len(have), count):
                have.append([apply(p, expected.draw(seeded(n, j))) for p, n in zip(train, names, strict=True)])
    fit = Fit.start(base)
    train_features = picture_features(fit, train)
    test_features = features(fit, [s.path for s in samples], None)
    set_features = {n: picture_features(fit, v) for n, v in sets.items()}
    copy_features = {k: [picture_features(fit, c) for c in v] for k, v in copies_of.items()}
    masks = load_masks(samples, base.features.image_size, None)
    rows = []
    for neighbourhood in (1, 3):
        config = base.replace(neighbourhood=neighbourhood)
        for seed in seeds:
            embedding = Embedding.create(
                config.spec, config.features.stages, config.embedding_dim_or_default(), "random", seed, neighbourhood
            )
            x = embed(embedding, train_features).double()
            copies = {k: [embed(embedding, c).double() for c in v] for k, v in copy_features.items()}
            # the Gaussians: of the pictures, and of the pictures with their first copy (fitted copies)
            fitted = {"": x, **{k: interleave(x, v[0]) for k, v in copies.items()}}
            scored = {}  # statistics -> (test, {nuisance: distances})
            for key, rows_fitted in fitted.items():
                mean, factor = finalise(
                    batch_state(rows_fitted), config.gaussian.epsilon, shrinkage=config.gaussian.shrinkage
                )

                def distances_of(stages, mean=mean, factor=factor, embedding=embedding):
                    return torch.cat(
                        [
                            squared_mahalanobis(embed(embedding, [s[i : i + 32] for s in stages]), mean, factor)
                            for i in range(0, stages[0].shape[0], 32)
                        ]
                    )

                scored[key] = (distances_of(test_features), {n: distances_of(v) for n, v in set_features.items()})
            out_of_fold = {}  # (calibration, folds) -> [(R, P) squared distances scored, one per copy]
            for folds in ROBUST_FOLDS:
                order, sizes = fold_order(names, folds)
                xs = x[order]
                state = batch_state(xs)
                for name, (preset, count, fitted_copies) in CALIBRATIONS.items():
                    if not count:
                        out_of_fold[name, folds] = [sliced_out_of_fold(xs, sizes, config.gaussian, state)]
                    elif fitted_copies:
                        both = interleave(xs, copies[preset][0][order])
                        squared = sliced_out_of_fold(both, [2 * m for m in sizes], config.gaussian)
                        out_of_fold[name, folds] = [squared[1::2]]  # the copies' rows
                    else:
                        out_of_fold[name, folds] = [
                            sliced_out_of_fold(xs, sizes, config.gaussian, state, copies[preset][j][order])
                            for j in range(count)
                        ]
            side = int(round(x.shape[1] ** 0.5))
            for sigma in MAIN_SIGMAS:

                def maps(squared, sigma=sigma, side=side, config=config):
                    return torch.cat(
                        [
                            anomaly_maps(squared[i : i + 64], (side, side), config.features.image_size, sigma)
                            for i in range(0, len(squared), 64)
                        ]
                    )

                test_maps = {key: maps(test) for key, (test, _) in scored.items()}
                set_maps = {key: {n: maps(d) for n, d in sets_.items()} for key, (_, sets_) in scored.items()}
                oof_maps = {k: [(maps(d), d) for d in v] for k, v in out_of_fold.items()}
                pixel = {key: pixel_metrics(m.numpy(), masks) for key, m in test_maps.items()}
                for method in IMAGE_SCORES:

                    def score(maps_, squared, method=method, top_fraction=config.scoring.top_fraction):
                        return image_scores(maps_, method, squared, top_fraction).double().numpy()

                    test_scores = {key: score(test_maps[key], test) for key, (test, _) in scored.items()}
                    set_scores = {
                        key: {n: score(set_maps[key][n], d) for n, d in sets_.items()}
                        for key, (_, sets_) in scored.items()
                    }
                    for (name, folds), calibration_sets in oof_maps.items():
                        preset, _, fitted_copies = CALIBRATIONS[name]
                        key = preset if fitted_copies else ""
                        oof = np.max([score(m, d) for m, d in calibration_sets], axis=0)  # one score a picture
                        threshold = Calibration.from_scores(torch.from_numpy(oof), false_alarm_rate).threshold
                        flagged = test_scores[key] >= threshold
                        rows.append(
                            {
                                "category": root.name,
                                "neighbourhood": neighbourhood,
                                "seed": seed,
                                "sigma": sigma,
                                "image_score": method,
                                "folds": folds,
                                "calibration": name,
                                "image_auroc": float(roc_auc_score(labels, test_scores[key])),
                                "pixel_auroc": pixel[key][0],
                                "pro": pixel[key][1],
                                "recall": float(flagged[labels == 1].mean()),
                                "false_alarms": float(flagged[labels == 0].mean()),
                                "false_alarms_by_nuisance": {
                                    n: float((v >= threshold).mean()) for n, v in set_scores[key].items()
                                },
                                "recall_by_defect": {
                                    d: float(flagged[np.array([s.defect == d for s in samples])].mean())
                                    for d in sorted({s.defect for s in samples} - {"good"})
                                },
                            }
                        )
    return rows


def pixel_metrics(maps: np.ndarray, masks: np.ndarray) -> tuple[float, float]:
    """Pixel AUROC (sklearn) and PRO to 30% FPR (the product's :func:`per_region_overlap`) of ``(N, S, S)`` maps."""
    return float(roc_auc_score(masks.ravel(), maps.ravel())), per_region_overlap(maps, masks)


# ---------------------------------------------------------------------- summaries
def option_key(row: dict) -> tuple:
    return (
        row["crop"],
        row["reduction"],
        row["neighbourhood"],
        "ensemble" if str(row["seed"]).startswith("ensemble") else "single",
        row["image_score"],
        row["sigma"],
    )


def option_name(key: tuple) -> str:
    crop, reduction, neighbourhood, members, method, sigma = key
    return f"{'crop' if crop else 'resize'} {reduction[:4]} nb{neighbourhood} {members[:3]} {method} s{sigma:g}"


def robust_key(row: dict) -> tuple:
    return row["neighbourhood"], row["sigma"], row["image_score"], str(row["folds"]), row["calibration"]


def summarise_robust(rows: list[dict]) -> list[dict]:
    """Per option of ``--grid robust``: each metric (false alarms per nuisance too) averaged over seeds, then over
    categories; the worst category's false alarms beside."""
    by_option: dict = {}
    for row in rows:
        flat = {**row, **{f"fa_{n}": v for n, v in row["false_alarms_by_nuisance"].items()}}
        by_option.setdefault(robust_key(row), {}).setdefault(row["category"], []).append(flat)
    out = []
    for key, per_category in by_option.items():
        neighbourhood, sigma, method, folds, calibration = key
        entry = {
            "option": f"nb{neighbourhood} s{sigma:g} {method} folds {folds} {calibration}",
            "neighbourhood": neighbourhood,
            "sigma": sigma,
            "image_score": method,
            "folds": folds,
            "calibration": calibration,
            "by_category": {},
        }
        metrics = ["image_auroc", "pixel_auroc", "pro", "recall", "false_alarms"] + [
            k for k in next(iter(per_category.values()))[0] if k.startswith("fa_")
        ]
        for metric in metrics:
            means = {c: statistics.fmean(v[metric] for v in values) for c, values in per_category.items()}
            for category, mean in means.items():
                entry["by_category"].setdefault(category, {})[metric] = round(mean, 4)
            entry[metric] = round(statistics.fmean(means.values()), 4)
            if metric.startswith("fa_") or metric == "false_alarms":
                entry[f"{metric}_worst_category"] = round(max(means.values()), 4)
        out.append(entry)
    return sorted(out, key=lambda e: -(e["image_auroc"] + e["recall"]))


def worst_false_alarms(entry: dict, stress: tuple[str, ...] = ("fa_region_far",)) -> float:
    """The highest mean false-alarm rate of an option over the nuisances (the stress test ``region_far`` aside)."""
    return max(
        v
        for k, v in entry.items()
        if (k.startswith("fa_") and not k.endswith("_worst_category") and k not in stress) or k == "false_alarms"
    )


#: Options this close in image AUROC + recall are a tie (the seeds' spread is larger): today's scoring options win it.
TIE = 0.005


def best_robust_option(summary: list[dict], bound: float) -> dict:
    """The default by the combined measurement: among the options whose false alarms stay within ``bound`` on
    every nuisance but ``region_far`` (mean over categories), the highest image AUROC + recall, ties (:data:`TIE`)
    going to today's neighbourhood, sigma, image score and folds; if none is within, the fewest false alarms."""
    within = [e for e in summary if worst_false_alarms(e) <= bound]
    if not within:
        best = min(summary, key=worst_false_alarms)
    else:
        top = max(e["image_auroc"] + e["recall"] for e in within)
        today = PadimConfig()
        scoring = (
            today.gaussian.neighbourhood,
            today.scoring.blur_sigma,
            today.scoring.image_score,
            str(today.gaussian.calibration_folds),
        )
        best = max(
            (e for e in within if e["image_auroc"] + e["recall"] >= top - TIE),
            key=lambda e: (
                sum(
                    a == b
                    for a, b in zip(
                        (e["neighbourhood"], e["sigma"], e["image_score"], str(e["folds"])), scoring, strict=True
                    )
                ),
                e["image_auroc"] + e["recall"],
            ),
        )
    preset, _, fitted = CALIBRATIONS[best["calibration"]]
    return {
        "neighbourhood": best["neighbourhood"],
        "image_score": best["image_score"],
        "blur_sigma": best["sigma"],
        "calibration_folds": best["folds"] if best["folds"] == "loo" else int(best["folds"]),
        "expect": preset,
        "fit_changes": fitted,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Per option: mean and spread over seeds of each category's metric, then the mean over categories."""
    if rows and "calibration" in rows[0]:
        return summarise_robust(rows)
    by_option: dict = {}
    for row in rows:
        by_option.setdefault(option_key(row), {}).setdefault(row["category"], []).append(row)
    out = []
    for key, per_category in by_option.items():
        entry = {
            "option": option_name(key),
            "crop": key[0],
            "reduction": key[1],
            "neighbourhood": key[2],
            "members": key[3],
            "image_score": key[4],
            "sigma": key[5],
            "by_category": {},
        }
        for metric in ("image_auroc", "pixel_auroc", "pro", "recall", "false_alarms"):
            category_means, spreads = [], []
            for category, values in per_category.items():
                numbers = [v[metric] for v in values]
                mean = statistics.fmean(numbers)
                spread = statistics.stdev(numbers) if len(numbers) > 1 else 0.0
                entry["by_category"].setdefault(category, {})[metric] = [round(mean, 4), round(spread, 4)]
                category_means.append(mean)
                spreads.append(spread)
            entry[metric] = round(statistics.fmean(category_means), 4)
            entry[f"{metric}_seed_spread"] = round(statistics.fmean(spreads), 4)
        out.append(entry)
    return sorted(out, key=lambda e: -e["image_auroc"])


def baseline(summary: list[dict]) -> dict:
    """The paper (padim's default before 2026-11-24): plain resize, random subset, no neighbourhood, one seed,
    map_max, sigma 4."""
    return next(
        e
        for e in summary
        if e["crop"] is None
        and e["reduction"] == "random"
        and e["neighbourhood"] == 1
        and e["members"] == "single"
        and e["image_score"] == "map_max"
        and e["sigma"] == 4.0
    )


def best_product_option(summary: list[dict]) -> dict:
    """The best single-model option that is product configuration (no crop: that is preprocessing)."""
    candidates = [e for e in summary if e["crop"] is None and e["members"] == "single"]
    best = max(candidates, key=lambda e: e["image_auroc"] + e["recall"])
    return {
        "reduction": best["reduction"],
        "neighbourhood": best["neighbourhood"],
        "image_score": best["image_score"],
        "blur_sigma": best["sigma"],
    }


# ---------------------------------------------------------------------- costs and the product check
def option_costs(base: PadimConfig, root: Path) -> dict:
    """Scoring time (batch 16, the product's scorer), model-file size and fit memory of each scoring option."""
    images = [Image.open(p).convert("RGB") for p in list_images(root / "train" / "good")[:16]]
    fit = Fit.start(base)
    batch = fit.embedder.preprocess(images)
    pixels, dim = fit.embedder.grid_shape[0] * fit.embedder.grid_shape[1], base.embedding_dim_or_default()
    mean = torch.zeros(pixels, dim)
    factor = torch.eye(dim).expand(pixels, dim, dim).contiguous().half()  # float16, as train stores it
    costs = {}
    reference = None
    for neighbourhood in (1, 3):
        for method in IMAGE_SCORES:
            config = base.replace(neighbourhood=neighbourhood, image_score=method)
            start = Fit.start(config)
            model = PadimModel(start.embedder, mean, factor, dataclasses.replace(config.scoring, image_score=method))
            seconds = median_seconds(lambda model=model: model(batch), 5)
            reference = reference or seconds
            costs[f"nb{neighbourhood} {method}"] = {
                "seconds_per_batch16": round(seconds, 4),
                "relative": round(seconds / reference, 3),
            }
    plan = plan_fit(base, FitFacts(100, spool=True))
    model_bytes = pixels * (dim * (dim + 1) // 2) * 2 + pixels * dim * 4  # float16 packed factors + mean
    with torch.inference_mode():
        backbone = median_seconds(lambda: fit.embedder(batch), 5)
        maha = median_seconds(lambda: squared_mahalanobis(torch.zeros(16, pixels, dim), mean, factor), 5)
    costs["ensemble of k"] = {
        "seconds_per_batch16": f"{backbone:.4f} + k x {maha:.4f} (backbone once, a Gaussian per member)",
        "model_file_bytes": f"k x {model_bytes}",
    }
    costs["model_file_bytes_slim"] = model_bytes
    costs["fit_memory_bytes"] = plan.total
    costs["note"] = "neighbourhood and image score change neither the model file's size nor the fit's memory"
    costs["default vs paper"] = default_versus_paper(base, batch, mean, factor)
    return costs


def default_versus_paper(
    base: PadimConfig, batch: torch.Tensor, mean: torch.Tensor, factor: torch.Tensor, rounds: int = 9
) -> dict:
    """Scoring time of today's default (``PadimConfig()``'s scoring) and of the paper's, in interleaved rounds."""
    today = PadimConfig()  # its expected changes cost at the fit, not when scoring
    configs = {
        "default": base.replace(
            neighbourhood=today.gaussian.neighbourhood,
            blur_sigma=today.scoring.blur_sigma,
            image_score=today.scoring.image_score,
            expect=today.gaussian.expect,
            fit_changes=today.gaussian.fit_changes,
        ),
        "paper": base.replace(**PAPER),
    }
    models = {name: PadimModel(Fit.start(c).embedder, mean, factor, c.scoring) for name, c in configs.items()}
    times = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, model in models.items():
                times[name].append(median_seconds(lambda model=model: model(batch), 3))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        **{f"{name}_seconds_per_batch16": round(m, 4) for name, m in medians.items()},
        "default_relative_to_paper": round(medians["default"] / medians["paper"], 3),
        "default": {k: getattr(configs["default"], k) for k in PAPER},
        "rounds": rounds,
    }


def product_check(config: PadimConfig, root: Path, false_alarm_rate: float = 0.01) -> dict:
    """``padim.fit`` and ``Detector.scores`` with ``config``: the same scores and threshold as this script's path."""
    import padim

    config = config.replace(calibration_folds="loo")
    train = list_images(root / "train" / "good")
    test = list_images(root / "test")[:24]
    detector = padim.fit(root / "train" / "good", config=config, progress=False)  # names: relative to the folder
    ours = np.array([prediction.raw_score for prediction in detector.predict(test)])
    fit = Fit.start(config)
    embedding = Embedding.create(
        config.spec,
        config.features.stages,
        config.embedding_dim_or_default(),
        config.features.reduction,
        config.features.seed,
        config.gaussian.neighbourhood,
    )
    pictures = [Image.open(p).convert("RGB") for p in train]
    x = embed(embedding, picture_features(fit, pictures)).double()
    copies = None
    if config.gaussian.expect:  # the product's draws: one seeded copy a picture, by name (names relative to the folder)
        changed = [apply(p, config.expected.draw(seeded(path.name))) for p, path in zip(pictures, train, strict=True)]
        copies = embed(embedding, picture_features(fit, changed)).double()
    rows = interleave(x, copies) if config.copies_fitted else x
    mean, factor = finalise(batch_state(rows), config.gaussian.epsilon, shrinkage=config.gaussian.shrinkage)
    squared = squared_mahalanobis(embed(embedding, features(fit, test, None)), mean, factor)
    side = int(round(squared.shape[1] ** 0.5))

    def scores(d):
        return image_scores(
            anomaly_maps(d, (side, side), config.features.image_size, config.scoring.blur_sigma),
            config.scoring.image_score,
            d,
            config.scoring.top_fraction,
        ).double()

    expected = scores(squared).numpy()
    if config.copies_fitted:
        oof = sliced_out_of_fold(rows, [2] * len(x), config.gaussian)[1::2]
    else:
        oof = sliced_out_of_fold(x, [1] * len(x), config.gaussian, copies=copies)
    threshold = Calibration.from_scores(scores(oof), false_alarm_rate).threshold
    return {
        "config": {
            k: getattr(config, k)
            for k in ("reduction", "neighbourhood", "image_score", "blur_sigma", "expect", "fit_changes")
        },
        "max_relative_score_difference": float(np.max(np.abs(ours - expected) / np.abs(expected))),
        "threshold_relative_difference": abs(detector.calibration.threshold - threshold) / threshold,
        "images": len(test),
    }


def calibration_costs(base: PadimConfig, root: Path, rounds: int = 3) -> dict:
    """Fit time (``padim.fit``, this machine; the median of interleaved rounds) and the memory plan of each
    calibration, on one category's pictures."""
    import padim

    train = list_images(root / "train" / "good")
    names = ("stable", "typical", "typical + fit", "rough + fit")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):  # interleaved: the machine's drift falls on every calibration alike
        for name in names:
            preset, _, fitted = CALIBRATIONS[name]
            started = time.perf_counter()
            padim.fit(root / "train" / "good", config=base.replace(expect=preset, fit_changes=fitted), progress=False)
            seconds[name].append(time.perf_counter() - started)
    out = {}
    for name in names:
        preset, _, fitted = CALIBRATIONS[name]
        plan = plan_fit(base.replace(expect=preset, fit_changes=fitted), FitFacts(len(train), spool=True))
        out[name] = {
            "fit_seconds": round(statistics.median(seconds[name]), 1),
            "relative_to_stable": round(statistics.median(seconds[name]) / statistics.median(seconds["stable"]), 2),
            "planned_memory_bytes": plan.total,
            "spool_bytes": plan.spool,
            "images": len(train),
            "rounds": rounds,
        }
    return out


def print_robust_table(result: dict) -> None:
    summary = result["summary"]
    nuisances = [n for n in NUISANCES if f"fa_{n}" in summary[0]]
    print(
        f"weights: {result['weights']}; {len(result['categories'])} categories, seeds {result['seeds']}; recall and "
        f"false alarms at the threshold calibrated for {result['false_alarm_rate']:.0%} (its promise's bound: "
        f"{result['promise_bound']:.2%}); false alarms: unseen normal pictures as drawn (FA), then under each nuisance"
    )
    print(f"{'option':46} {'AUROC':>6} {'recall':>6} {'FA':>5} " + " ".join(f"{n[:7]:>7}" for n in nuisances))
    today = PadimConfig()
    for e in summary:
        mark = ""
        preset, copies, fitted = CALIBRATIONS[e["calibration"]]
        if (
            e["neighbourhood"],
            e["sigma"],
            e["image_score"],
            str(e["folds"]),
            str(Expected.parse(preset)),
            fitted,
            copies <= 1,
        ) == (
            today.gaussian.neighbourhood,
            today.scoring.blur_sigma,
            today.scoring.image_score,
            str(today.gaussian.calibration_folds),
            today.gaussian.expect,
            today.copies_fitted,
            True,
        ):
            mark = "  <- today's default"
        print(
            f"{e['option']:46} {e['image_auroc']:6.3f} {e['recall']:6.3f} {e['false_alarms']:5.3f} "
            + " ".join(f"{e['fa_' + n]:7.3f}" for n in nuisances)
            + mark
        )
    print(
        "choice (within the bound on every nuisance but region_far, then the highest AUROC + recall):",
        json.dumps(result["choice"]),
    )
    print("costs:", json.dumps(result["costs"]))
    print("product check:", json.dumps(result["product_check"]))


def promise_bound(images: int, false_alarm_rate: float) -> float:
    """The false-alarm bound (95% confidence) a calibration of ``images`` out-of-fold scores gives at the requested
    rate when every score lies at or below the threshold (as the Gumbel threshold puts them here)."""
    return Calibration.from_scores(
        torch.linspace(1.0, 2.0, images, dtype=torch.float64), false_alarm_rate
    ).false_alarm_bound


def print_table(result: dict) -> None:
    if result["grid"] == "robust":
        print_robust_table(result)
        return
    summary = result["summary"]
    base = baseline(summary)
    print(
        f"weights: {result['weights']}; {len(result['categories'])} categories, seeds {result['seeds']}; "
        f"recall and false alarms at the threshold calibrated for {result['false_alarm_rate']:.0%}"
    )
    print(f"{'option':44} {'img AUROC':>12} {'px AUROC':>9} {'PRO':>6} {'recall':>7} {'FA':>6}")
    for e in summary[:25] + ([base] if base not in summary[:25] else []):
        today = PadimConfig()
        mark = (
            "  <- the paper"
            if e is base
            else "  <- today's default"
            if (
                e["crop"] is None
                and e["reduction"] == "random"
                and e["members"] == "single"
                and (e["neighbourhood"], e["image_score"], e["sigma"])
                == (today.gaussian.neighbourhood, today.scoring.image_score, today.scoring.blur_sigma)
            )
            else ""
        )
        print(
            f"{e['option']:44} {e['image_auroc']:.3f}±{e['image_auroc_seed_spread']:.3f} {e['pixel_auroc']:9.3f} "
            f"{e['pro']:6.3f} {e['recall']:7.3f} {e['false_alarms']:6.3f}{mark}"
        )
    print("costs:", json.dumps(result["costs"]))
    print("product check:", json.dumps(result["product_check"]))


if __name__ == "__main__":
    main()
