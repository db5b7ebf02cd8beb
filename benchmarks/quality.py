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

Then the scoring time of each option (the product's scorer, batch 16), the model-file size and the
fit's memory plan, and a product check: ``padim.fit`` + ``Detector.scores`` with the best option
gives the scores this script computed. Results as JSON (``--output``) and a table on stdout.

The backbone is seeded random resnet18 weights (ImageNet weights cannot be fetched here) unless
``--weights`` names a state_dict file: every figure says which.

    python benchmarks/quality.py                        # the frozen benchmark (25 minutes on 2 cores)
    python benchmarks/quality.py --quick                # 2 categories, fewer images: a smoke run
    python benchmarks/quality.py --grid main            # neighbourhood x image score x sigma 0/2/4 (12 minutes)
    python benchmarks/quality.py --costs                # scoring time only: each option, today's default vs the paper
    python benchmarks/quality.py --mvtec /data/mvtec --categories bottle,carpet --weights r18.pth
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score

from padim.core.calibration import Calibration
from padim.core.out_of_fold import out_of_fold_squared_distances
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import batch_state, covariance, finalise
from padim.models import Fit, PadimConfig, list_images
from padim.models.data.synthetic import CATEGORIES, DEFECTS, MORE_DEFECTS, generate
from padim.models.evaluation.metrics import per_region_overlap, read_mvtec_category
from padim.models.features.embedding import Embedding
from padim.models.fit.memory_plan import plan_fit
from padim.models.model import PadimModel
from timing import machine_name, median_seconds, work_folder

HERE = Path(__file__).resolve().parent
IMAGE_SCORES = ("map_max", "patch_max", "top_mean")
SIGMAS = (2.0, 4.0, 8.0)
#: ``--grid main``: the neighbourhood and the blur alone (plain resize, random subset, single models), sigma 0 too.
MAIN_SIGMAS = (0.0, 2.0, 4.0)
CROP = 0.875  # 224 of 256
#: PaDiM as published (configs/paper.yaml), the base every option is measured against.
PAPER = {"neighbourhood": 1, "blur_sigma": 4.0, "image_score": "map_max"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mvtec", type=Path, help="a folder of MVTec AD categories (default: generated data)")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--train", type=int, default=100, help="normal training images per category (generated)")
    parser.add_argument("--test-good", type=int, default=100, help="unseen normal images per category (generated)")
    parser.add_argument("--defect-images", type=int, default=24, help="images per defect kind (5 kinds, generated)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="categories measured at once (processes; the cores are shared out)")
    parser.add_argument("--seeds", default="0,1,2", help="channel seeds of every option")
    parser.add_argument("--weights", default="random", help="random (seeded resnet18, seed 0) or a resnet18 state_dict")
    parser.add_argument("--false-alarm-rate", type=float, default=0.01)
    parser.add_argument("--grid", choices=("full", "main"), default="full",
                        help="full: every option; main: neighbourhood 1/3 x sigma 0/2/4 x image score only (a third "
                        "of the time)")
    parser.add_argument("--quick", action="store_true", help="2 categories, 40/40/8 images, 2 seeds")
    parser.add_argument("--costs", action="store_true", help="only the scoring costs (on the first category)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path, help="results JSON (default benchmarks/results/DATE-MACHINE-quality.json)")
    args = parser.parse_args()
    if args.quick:
        args.categories, args.train, args.test_good, args.defect_images, args.seeds = "carpet,pill", 40, 40, 8, "0,1"
    categories = [c for c in args.categories.split(",") if c]
    seeds = [int(s) for s in args.seeds.split(",")]
    work = work_folder(args.workdir, "padim-quality-")
    data = args.mvtec or work / "data"
    if args.mvtec is None and not all((data / c).exists() for c in categories):
        generate(data, tuple(categories), train=args.train, test_good=args.test_good, test_defect=args.defect_images,
                 size=256, seed=24, defects=DEFECTS + MORE_DEFECTS)
    weights = args.weights
    if weights == "random":  # one backbone for every seed: the seed then draws the channels alone
        weights = str(work / "resnet18-random-seed0.pt")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            import torchvision
            torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    # the paper's scoring as the base (padim's default before 2026-11-24): every option is measured against it
    base = PadimConfig(weights=weights, device="cpu", false_alarm_rate=args.false_alarm_rate, **PAPER)
    if args.costs:
        costs = {"machine": machine_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "category": categories[0], **option_costs(base, data / categories[0])}
        output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-quality-costs.json"
        output.write_text(json.dumps(costs, indent=1) + "\n")
        print(json.dumps(costs, indent=1))
        print(f"results: {output}")
        return
    started = time.time()
    rows = []
    jobs = max(1, min(args.jobs, len(categories)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    tasks = [(data / category, base, seeds, args.false_alarm_rate, args.grid, threads) for category in categories]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for category, part in zip(categories, pool.imap(measure_in_process, tasks)):
            rows += part
            print(f"{category}: done after {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    summary = summarise(rows)
    output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-quality{'-main' if args.grid == 'main' else ''}.json"
    output.with_suffix(".rows.json").write_text(json.dumps(rows))  # kept should the checks below fail
    costs = option_costs(base, data / categories[0])
    check = product_check(base.replace(**best_product_option(summary)), data / categories[0])
    output.with_suffix(".rows.json").unlink()
    result = {
        "machine": machine_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "weights": "seeded random resnet18 (seed 0), not ImageNet" if args.weights == "random" else args.weights,
        "data": str(args.mvtec) if args.mvtec else
        f"generated (models/data/synthetic.py, seed 24, 256 px): {args.train} training, {args.test_good} unseen normal, "
        f"{args.defect_images} x {len(DEFECTS + MORE_DEFECTS)} defect images ({', '.join(DEFECTS + MORE_DEFECTS)}) per category",
        "grid": args.grid, "categories": categories, "seeds": seeds, "false_alarm_rate": args.false_alarm_rate,
        "seconds": round(time.time() - started), "summary": summary, "costs": costs, "product_check": check,
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


def measure_category(root: Path, base: PadimConfig, seeds: list[int], false_alarm_rate: float, grid: str = "full"
                     ) -> list[dict]:
    """Every option on one category: a row per (preprocessing, reduction, neighbourhood, seed or ensemble,
    image score, sigma)."""
    train = list_images(root / "train" / "good")
    samples = read_mvtec_category(root)
    labels = np.array([s.is_anomalous for s in samples])
    rows = []
    main = grid == "main"
    for crop in (None,) if main else (None, CROP):
        fit = Fit.start(base)
        train_features = features(fit, train, crop)
        test_features = features(fit, [s.path for s in samples], crop)
        masks = load_masks(samples, base.image_size, crop)
        combos = [("random", 1), ("random", 3)] + \
            ([("semi_orthogonal", 1), ("semi_orthogonal", 3)] if crop is None and not main else [])
        for reduction, neighbourhood in combos:
            config = base.replace(reduction=reduction, neighbourhood=neighbourhood)
            members = []
            for seed in seeds:
                embedding = Embedding.create(config.spec, config.layers, config.embedding_dim_or_default(), reduction,
                                             seed, neighbourhood)
                oof, test = distances(embedding, train_features, test_features, config.epsilon)
                members.append((oof, test))
                # the blur is measured on the main axis (plain resize, random subset); the rest at sigma 4
                sigmas = MAIN_SIGMAS if main else SIGMAS if crop is None and reduction == "random" else (4.0,)
                rows += evaluate(root.name, {"crop": crop, "reduction": reduction, "neighbourhood": neighbourhood,
                                             "seed": seed}, oof, test, labels, masks, samples, config, false_alarm_rate,
                                 sigmas)
            if reduction == "random" and len(seeds) > 1 and not main:
                oof, test = ensemble(members, config, false_alarm_rate)
                rows += evaluate(root.name, {"crop": crop, "reduction": reduction, "neighbourhood": neighbourhood,
                                             "seed": f"ensemble of {len(seeds)}"}, oof, test, labels, masks, samples,
                                 config, false_alarm_rate, (4.0,), squared=False)
        del train_features, test_features
    return rows


def features(fit: Fit, paths: list[Path], crop: float | None) -> list[torch.Tensor]:
    """The backbone's stages of every image, ``[(N, C_l, H_l, W_l)]``, as the product preprocesses them."""
    out = []
    for start in range(0, len(paths), 32):
        images = [cropped(Image.open(p).convert("RGB"), crop) for p in paths[start : start + 32]]
        out.append(fit.embedder.extractor(fit.embedder.preprocess(images)))
    return [torch.cat(parts) for parts in zip(*out)]


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


def distances(embedding: Embedding, train: list[torch.Tensor], test: list[torch.Tensor], epsilon: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out squared distances of the training images ``(N, P)`` and the test images' ``(T, P)``."""
    x = embed(embedding, train)
    state = batch_state(x.double())
    oof = torch.empty(x.shape[0], x.shape[1], dtype=torch.float64)
    for start in range(0, x.shape[1], 256):  # pixel slices, as the fit does
        stop = min(start + 256, x.shape[1])
        oof[:, start:stop] = out_of_fold_squared_distances(
            covariance(state, start, stop), state.mean[start:stop], x.shape[0], x[:, start:stop], [1] * x.shape[0],
            epsilon)
    mean, factor = finalise(state, epsilon)
    y = embed(embedding, test)
    test_squared = torch.cat([squared_mahalanobis(y[i : i + 32], mean, factor) for i in range(0, len(y), 32)])
    return oof.float(), test_squared


def ensemble(members, config: PadimConfig, false_alarm_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Average of the members' distance grids, each divided by its own calibrated ``map_max`` threshold."""
    oof_sum, test_sum = 0, 0
    for oof, test in members:
        side = int(round(oof.shape[1] ** 0.5))
        scores = image_scores(anomaly_maps(oof, (side, side), config.image_size, config.blur_sigma)).double()
        threshold = Calibration.from_scores(scores, false_alarm_rate).threshold
        oof_sum = oof_sum + oof.clamp_min(0).sqrt() / threshold
        test_sum = test_sum + test.clamp_min(0).sqrt() / threshold
    return oof_sum / len(members), test_sum / len(members)


def evaluate(category: str, option: dict, oof: torch.Tensor, test: torch.Tensor, labels: np.ndarray, masks: np.ndarray,
             samples, config: PadimConfig, false_alarm_rate: float, sigmas=SIGMAS, squared: bool = True) -> list[dict]:
    """Rows for every sigma and image score of one set of distances (``squared``: else plain distances)."""
    if not squared:  # an ensemble's averaged distances: square them, as the maps take squared distances
        oof, test = oof.square(), test.square()
    side = int(round(oof.shape[1] ** 0.5))
    good = labels == 0
    defect_kinds = sorted({s.defect for s in samples} - {"good"})
    rows = []
    for sigma in sigmas:
        test_maps = torch.cat([anomaly_maps(test[i : i + 32], (side, side), config.image_size, sigma)
                               for i in range(0, len(test), 32)])
        maps = test_maps.numpy()
        pixel_auroc, pro = pixel_metrics(maps, masks)
        for method in IMAGE_SCORES:
            scores = np.concatenate([image_scores(test_maps[i : i + 64], method, test[i : i + 64]).numpy()
                                     for i in range(0, len(test), 64)])
            oof_scores = torch.cat([image_scores(anomaly_maps(oof[i : i + 64], (side, side), config.image_size, sigma),
                                                 method, oof[i : i + 64]) for i in range(0, len(oof), 64)]).double()
            threshold = Calibration.from_scores(oof_scores, false_alarm_rate).threshold
            flagged = scores >= threshold
            rows.append({
                "category": category, **option, "sigma": sigma, "image_score": method,
                "image_auroc": float(roc_auc_score(labels, scores)), "pixel_auroc": pixel_auroc, "pro": pro,
                "recall": float(flagged[~good].mean()), "false_alarms": float(flagged[good].mean()),
                "recall_by_defect": {d: float(flagged[np.array([s.defect == d for s in samples])].mean())
                                     for d in defect_kinds},
            })
    return rows


def pixel_metrics(maps: np.ndarray, masks: np.ndarray) -> tuple[float, float]:
    """Pixel AUROC (sklearn) and PRO to 30% FPR (the product's :func:`per_region_overlap`) of ``(N, S, S)`` maps."""
    return float(roc_auc_score(masks.ravel(), maps.ravel())), per_region_overlap(maps, masks)


# ---------------------------------------------------------------------- summaries
def option_key(row: dict) -> tuple:
    return (row["crop"], row["reduction"], row["neighbourhood"], "ensemble" if str(row["seed"]).startswith("ensemble")
            else "single", row["image_score"], row["sigma"])


def option_name(key: tuple) -> str:
    crop, reduction, neighbourhood, members, method, sigma = key
    return (f"{'crop' if crop else 'resize'} {reduction[:4]} nb{neighbourhood} {members[:3]} {method} s{sigma:g}")


def summarise(rows: list[dict]) -> list[dict]:
    """Per option: mean and spread over seeds of each category's metric, then the mean over categories."""
    by_option: dict = {}
    for row in rows:
        by_option.setdefault(option_key(row), {}).setdefault(row["category"], []).append(row)
    out = []
    for key, per_category in by_option.items():
        entry = {"option": option_name(key), "crop": key[0], "reduction": key[1], "neighbourhood": key[2],
                 "members": key[3], "image_score": key[4], "sigma": key[5], "by_category": {}}
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
    return next(e for e in summary if e["crop"] is None and e["reduction"] == "random" and e["neighbourhood"] == 1
                and e["members"] == "single" and e["image_score"] == "map_max" and e["sigma"] == 4.0)


def best_product_option(summary: list[dict]) -> dict:
    """The best single-model option that is product configuration (no crop: that is preprocessing)."""
    candidates = [e for e in summary if e["crop"] is None and e["members"] == "single"]
    best = max(candidates, key=lambda e: (e["image_auroc"] + e["recall"]))
    return {"reduction": best["reduction"], "neighbourhood": best["neighbourhood"], "image_score": best["image_score"],
            "blur_sigma": best["sigma"]}


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
            model = PadimModel(start.embedder, mean, factor, config.blur_sigma, method, config.top_fraction)
            seconds = median_seconds(lambda: model(batch), 5)
            reference = reference or seconds
            costs[f"nb{neighbourhood} {method}"] = {"seconds_per_batch16": round(seconds, 4),
                                                     "relative": round(seconds / reference, 3)}
    plan = plan_fit(base, 100, spool=True)
    model_bytes = pixels * (dim * (dim + 1) // 2) * 2 + pixels * dim * 4  # float16 packed factors + mean
    with torch.inference_mode():
        backbone = median_seconds(lambda: fit.embedder(batch), 5)
        maha = median_seconds(lambda: squared_mahalanobis(torch.zeros(16, pixels, dim), mean, factor), 5)
    costs["ensemble of k"] = {"seconds_per_batch16": f"{backbone:.4f} + k x {maha:.4f} (backbone once, a Gaussian per member)",
                              "model_file_bytes": f"k x {model_bytes}"}
    costs["model_file_bytes_slim"] = model_bytes
    costs["fit_memory_bytes"] = plan.total
    costs["note"] = "neighbourhood and image score change neither the model file's size nor the fit's memory"
    costs["default vs paper"] = default_versus_paper(base, batch, mean, factor)
    return costs


def default_versus_paper(base: PadimConfig, batch: torch.Tensor, mean: torch.Tensor, factor: torch.Tensor,
                         rounds: int = 9) -> dict:
    """Scoring time of today's default (``PadimConfig()``'s scoring) and of the paper's, in interleaved rounds."""
    today = PadimConfig()
    configs = {"default": base.replace(neighbourhood=today.neighbourhood, blur_sigma=today.blur_sigma,
                                       image_score=today.image_score), "paper": base.replace(**PAPER)}
    models = {name: PadimModel(Fit.start(c).embedder, mean, factor, c.blur_sigma, c.image_score, c.top_fraction)
              for name, c in configs.items()}
    times = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, model in models.items():
                times[name].append(median_seconds(lambda model=model: model(batch), 3))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {**{f"{name}_seconds_per_batch16": round(m, 4) for name, m in medians.items()},
            "default_relative_to_paper": round(medians["default"] / medians["paper"], 3),
            "default": {k: getattr(configs["default"], k) for k in PAPER}, "rounds": rounds}


def product_check(config: PadimConfig, root: Path) -> dict:
    """``padim.fit`` and ``Detector.scores`` with ``config``: the same scores as this script's path."""
    import padim

    train = list_images(root / "train" / "good")
    test = list_images(root / "test")[:24]
    detector = padim.fit(train, config=config.replace(calibration_folds="loo"), progress=False)
    ours = np.array([prediction.raw_score for prediction in detector.predict(test)])
    fit = Fit.start(config)
    embedding = Embedding.create(config.spec, config.layers, config.embedding_dim_or_default(), config.reduction,
                                 config.seed, config.neighbourhood)
    _, squared = distances(embedding, features(fit, train, None), features(fit, test, None), config.epsilon)
    side = int(round(squared.shape[1] ** 0.5))
    expected = image_scores(anomaly_maps(squared, (side, side), config.image_size, config.blur_sigma),
                            config.image_score, squared, config.top_fraction).numpy()
    difference = float(np.max(np.abs(ours - expected) / np.abs(expected)))
    return {"config": {k: getattr(config, k) for k in ("reduction", "neighbourhood", "image_score", "blur_sigma")},
            "max_relative_score_difference": difference, "images": len(test)}


def print_table(result: dict) -> None:
    summary = result["summary"]
    base = baseline(summary)
    print(f"weights: {result['weights']}; {len(result['categories'])} categories, seeds {result['seeds']}; "
          f"recall and false alarms at the threshold calibrated for {result['false_alarm_rate']:.0%}")
    print(f"{'option':44} {'img AUROC':>12} {'px AUROC':>9} {'PRO':>6} {'recall':>7} {'FA':>6}")
    for e in summary[:25] + ([base] if base not in summary[:25] else []):
        today = PadimConfig()
        mark = "  <- the paper" if e is base else "  <- today's default" if (
            e["crop"] is None and e["reduction"] == "random" and e["members"] == "single"
            and (e["neighbourhood"], e["image_score"], e["sigma"]) == (today.neighbourhood, today.image_score,
                                                                     today.blur_sigma)) else ""
        print(f"{e['option']:44} {e['image_auroc']:.3f}±{e['image_auroc_seed_spread']:.3f} {e['pixel_auroc']:9.3f} "
              f"{e['pro']:6.3f} {e['recall']:7.3f} {e['false_alarms']:6.3f}{mark}")
    print("costs:", json.dumps(result["costs"]))
    print("product check:", json.dumps(result["product_check"]))


if __name__ == "__main__":
    main()
