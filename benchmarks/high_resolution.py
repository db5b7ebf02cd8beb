"""Small defects on big pictures: the whole picture squashed to the model input, against a region of
interest, and against tiles (each tile position its own statistics, or one set all tiles share),
measured through the product (``padim.fit``, ``Detector.predict``).

Generated pictures (``--width`` x ``--height``, default 1536 x 1024) of two scenes, each category a
generated texture or placed part (``models/data/synthetic.py``):

- ``surface``: the texture or part fills the picture (a web, a sheet, a large part); defects are
  drawn at the scale of a 512 px window anywhere on it, so that they cover 0.05-0.5% of the
  picture (the measured range is printed and saved). Framings: squashed whole, 2x3 and 3x4 tiles
  with either statistics, and 2x3 shared with a quarter overlap.
- ``conveyor``: a 640 px part at a fixed spot on a conveyor whose clutter (bolts, cable, glare)
  moves from picture to picture, as on a line; its defects at the part's scale (a speck is
  0.03-0.15% of the part). The region of interest is the part and a strip of belt. Framings:
  squashed whole, the region (squashed or padded), 2x3 tiles of the whole picture, the region in
  2x2 tiles.

Per framing it prints image AUROC, pixel AUROC (maps at a quarter of the picture's side; inside
the region for every conveyor framing, as a region's map is 0 outside it by design), the defect
recall and the false-alarm rate on unseen normal pictures at the threshold ``train`` calibrates
for 1%, fit time, scoring time per picture, the fit's planned memory, the peak resident memory
after the fit and after scoring (each framing in a fresh process; predictions streamed) and the
model file's size. Seeded random resnet18 weights (ImageNet weights cannot be fetched here) unless
``--weights`` names a state_dict file.

    python benchmarks/high_resolution.py                          # both scenes, weave and pill, 100/100/48-60
    python benchmarks/high_resolution.py --quick                  # weave, fewer pictures
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from sklearn.metrics import roc_auc_score
from timing import machine_name, seeded_resnet18, work_folder

import padim
from padim.models import PadimConfig
from padim.models.data.synthetic import DEFECTS, MORE_DEFECTS, add_defect, texture

HERE = Path(__file__).resolve().parent
#: Framings of each scene: ``roi`` True takes the scene's region of interest.
SCENES = {
    # a part on a conveyor whose clutter moves from picture to picture
    "conveyor": {
        "whole picture, squashed": {},
        "region, squashed": {"roi": True},
        "region, padded": {"roi": True, "resize": "pad"},
        "whole picture, 2x3 tiles, position": {"tiles": (2, 3), "tile_statistics": "position"},
        "region, 2x2 tiles, position": {"roi": True, "tiles": (2, 2), "tile_statistics": "position"},
        "region, 2x2 tiles, shared": {"roi": True, "tiles": (2, 2), "tile_statistics": "shared"},
    },
    # the surface fills the picture (a web, a sheet, a large part), small defects anywhere on it
    "surface": {
        "whole picture, squashed": {},
        "2x3 tiles, position": {"tiles": (2, 3), "tile_statistics": "position"},
        "2x3 tiles, shared": {"tiles": (2, 3), "tile_statistics": "shared"},
        "2x3 tiles, shared, overlap 0.25": {"tiles": (2, 3), "tile_statistics": "shared", "tile_overlap": 0.25},
        "3x4 tiles, position": {"tiles": (3, 4), "tile_statistics": "position"},
        "3x4 tiles, shared": {"tiles": (3, 4), "tile_statistics": "shared"},
    },
}
#: Surface scene: defects are drawn at the scale of a window of this many pixels (``add_defect`` draws
#: at its image's scale), so that they cover 0.05-0.5% of a 1536 x 1024 picture (measured and reported).
DEFECT_WINDOW = 512
SURFACE_DEFECTS = ("scratch", "stain", "hole", "crack")
MAP_SCALE = 4  # pixel AUROC on maps at 1/4 of the picture's side
SUMMARY = (
    "image_auroc",
    "pixel_auroc",
    "recall",
    "false_alarms",
    "fit_seconds",
    "seconds_per_picture",
    "planned_fit_bytes",
    "fit_peak_rss_bytes",
    "score_peak_rss_bytes",
    "model_file_bytes",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenes", default="surface,conveyor", help="surface, conveyor or both (comma-separated)")
    parser.add_argument("--categories", default="weave,pill")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--part", type=int, default=640, help="conveyor scene: side of the square part (pixels)")
    parser.add_argument("--train", type=int, default=100)
    parser.add_argument("--test-good", type=int, default=100)
    parser.add_argument("--defect-images", type=int, default=12, help="per defect kind")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--weights", default="random")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--framings", help="framing names to run, separated by ; (default: all of each scene)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.categories, args.train, args.test_good, args.defect_images = "weave", 40, 40, 4
    work = work_folder(args.workdir, "padim-highres-")
    weights = str(seeded_resnet18(work / "resnet18-seed0.pth")) if args.weights == "random" else args.weights
    left, top = (args.width - args.part) // 2 + 97, (args.height - args.part) // 2 - 41  # off-centre, fixed
    roi = (left, top, args.part, args.part + args.part // 4)  # the part and a strip of belt below it
    wanted = None if not args.framings else set(args.framings.split(";"))
    rows, areas = [], {}
    for scene in args.scenes.split(","):
        for c, category in enumerate(args.categories.split(",")):
            root = work / "data" / scene / category
            if not (root / "done").exists():
                make_pictures(root, scene, category, args, (left, top), seed=c)
                (root / "done").write_text("")
            train = sorted((root / "train").glob("*.png"))
            tests = sorted((root / "test").rglob("*.png"))
            labels = np.array(["/good/" not in str(p) for p in tests])
            full_masks = [load_mask(root, p, args) for p in tests]
            areas[f"{scene}/{category}"] = defect_areas(full_masks, labels)
            # pixel AUROC inside the region for every conveyor framing: outside it a region's map is 0 by design
            inside = region_pixels(roi, args) if scene == "conveyor" else np.ones_like(full_masks[0], dtype=bool)
            masks = np.concatenate([m[inside] for m in full_masks])
            for name, framing in SCENES[scene].items():
                if wanted is not None and name not in wanted:
                    continue
                options = {k: v for k, v in framing.items() if k != "roi"}
                if framing.get("roi"):
                    options["roi"] = roi
                config = PadimConfig(weights=weights, image_size=args.image_size, device="cpu", **options)
                # a fresh process per framing: its peak resident memory is this framing's alone
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    measured = pool.submit(measure, config, train, tests, args).result()
                scores, flagged, maps = measured.pop("scores"), measured.pop("flagged"), measured.pop("maps")
                pixel = roc_auc_score(masks, np.concatenate([m[inside] for m in maps]))
                row = {
                    "scene": scene,
                    "category": category,
                    "framing": name,
                    "image_auroc": roc_auc_score(labels, scores),
                    "pixel_auroc": pixel,
                    "recall": float(flagged[labels].mean()),
                    "false_alarms": float(flagged[~labels].mean()),
                    "normal_pictures": int((~labels).sum()),
                    "defect_pictures": int(labels.sum()),
                    **measured,
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for scene in SCENES:
        for name in SCENES[scene]:
            part = [r for r in rows if r["scene"] == scene and r["framing"] == name]
            if part:
                summary[f"{scene}: {name}"] = {k: round(float(np.mean([r[k] for r in part])), 4) for k in SUMMARY}
    result = {
        "machine": machine_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "weights": "seeded random resnet18 (seed 0), not ImageNet" if args.weights == "random" else args.weights,
        "pictures": f"{args.width}x{args.height}; conveyor: part {args.part} px at {left},{top}, region of "
        f"interest {roi}; surface: the texture fills the picture, defects drawn at the scale of a "
        f"{DEFECT_WINDOW} px window",
        "per_category": f"{args.train} training, {args.test_good} unseen normal, {args.defect_images} defect "
        "pictures per defect kind",
        "defect_area_share_of_picture": areas,
        "image_size": args.image_size,
        "summary": summary,
        "rows": rows,
    }
    output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-high-resolution.json"
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{'framing':50} {'img AUROC':>9} {'px AUROC':>9} {'recall':>7} {'FA':>6} {'fit s':>6} {'s/pic':>6} "
        f"{'plan GB':>7} {'fit GB':>6} {'score GB':>8} {'file MB':>7}"
    )
    for name, s in summary.items():
        print(
            f"{name:50} {s['image_auroc']:9.3f} {s['pixel_auroc']:9.3f} {s['recall']:7.3f} {s['false_alarms']:6.3f} "
            f"{s['fit_seconds']:6.1f} {s['seconds_per_picture']:6.3f} {s['planned_fit_bytes'] / 1e9:7.2f} "
            f"{s['fit_peak_rss_bytes'] / 1e9:6.2f} {s['score_peak_rss_bytes'] / 1e9:8.2f} "
            f"{s['model_file_bytes'] / 1e6:7.1f}"
        )
    print(f"defect area, share of the picture: {json.dumps(areas)}")
    print(f"results: {output}")


def measure(config: PadimConfig, train: list[Path], tests: list[Path], args) -> dict:
    """In a child process: fit, then score every test picture; scores, verdicts, quarter-side maps and the costs.

    Peak resident memory after the fit, and after scoring (predictions streamed, a quarter-side map kept of each).
    """
    started = time.perf_counter()
    detector = padim.fit(train, config=config, progress=False)
    fit_seconds = time.perf_counter() - started
    fit_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    scores, flagged, maps = [], [], []
    for prediction in detector.predict(tests):
        scores.append(prediction.raw_score)
        flagged.append(prediction.is_anomaly)
        maps.append(small(prediction.anomaly_map, args))
    score_seconds = (time.perf_counter() - started) / len(tests)
    return {
        "scores": np.array(scores),
        "flagged": np.array(flagged),
        "maps": maps,
        "fit_seconds": round(fit_seconds, 1),
        "seconds_per_picture": round(score_seconds, 4),
        "planned_fit_bytes": detector.report.plan.total,
        "fit_peak_rss_bytes": fit_peak,
        "score_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "model_file_bytes": detector.source.stat().st_size,
        "input_shape": list(config.input_shape),
    }


def defect_areas(masks: list[np.ndarray], labels: np.ndarray) -> dict:
    """Defect area as a share of the picture: min, median, max over the defect pictures."""
    shares = np.array([m.mean() for m, label in zip(masks, labels, strict=True) if label])
    return {
        "min": round(float(shares.min()), 5),
        "median": round(float(np.median(shares)), 5),
        "max": round(float(shares.max()), 5),
    }


def belt(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """A dark conveyor with clutter that moves between pictures: bolts, a cable, a glare."""
    base = 0.22 + 0.03 * rng.standard_normal((height // 8, width // 8))
    image = Image.fromarray((np.clip(base, 0, 1) * 255).astype(np.uint8)).resize((width, height), Image.BILINEAR)
    image = image.convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 7))):  # bolts
        x, y, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(8, 20)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(150, 150, 155))
    points = [(rng.uniform(0, width), rng.uniform(0, height)) for _ in range(4)]  # a cable
    draw.line(points, fill=(20, 20, 60), width=int(rng.integers(6, 14)))
    x, y = rng.uniform(0, width), rng.uniform(0, height)  # a glare
    draw.ellipse([x - 120, y - 60, x + 120, y + 60], fill=(235, 235, 225))
    return image.filter(ImageFilter.GaussianBlur(1.5))


def make_pictures(root: Path, scene: str, category: str, args, place: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng([seed, 26, 0 if scene == "conveyor" else 1])

    def picture(part: np.ndarray, mask: np.ndarray | None, path: Path) -> None:
        if scene == "conveyor":
            canvas = belt(args.width, args.height, rng)
            canvas.paste(Image.fromarray((part * 255 + 0.5).astype(np.uint8)), place)
        else:
            canvas = Image.fromarray((part * 255 + 0.5).astype(np.uint8))
        path.parent.mkdir(parents=True, exist_ok=True)
        canvas.save(path)
        if mask is not None:
            full = Image.new("L", (args.width, args.height), 0)
            full.paste(Image.fromarray(mask.astype(np.uint8) * 255), place if scene == "conveyor" else (0, 0))
            target = root / "ground_truth" / path.parent.name / f"{path.stem}_mask.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            full.save(target)

    def normal() -> np.ndarray:
        if scene == "conveyor":
            return texture(category, args.part, rng)
        side = max(args.width, args.height)  # the texture at the picture's scale, cut to its shape
        return texture(category, side, rng)[
            (side - args.height) // 2 : (side + args.height) // 2, (side - args.width) // 2 : (side + args.width) // 2
        ]

    def with_defect(defect: str) -> tuple[np.ndarray, np.ndarray]:
        image = normal()
        if scene == "conveyor":
            return add_defect(image, defect, rng)
        # drawn on a window anywhere on the surface, at the window's scale: small on the picture
        x = int(rng.integers(0, args.width - DEFECT_WINDOW))
        y = int(rng.integers(0, args.height - DEFECT_WINDOW))
        window, small_mask = add_defect(image[y : y + DEFECT_WINDOW, x : x + DEFECT_WINDOW].copy(), defect, rng)
        image = image.copy()
        image[y : y + DEFECT_WINDOW, x : x + DEFECT_WINDOW] = window
        mask = np.zeros(image.shape[:2], dtype=bool)
        mask[y : y + DEFECT_WINDOW, x : x + DEFECT_WINDOW] = small_mask
        return image, mask

    for i in range(args.train):
        picture(normal(), None, root / "train" / f"{i:03d}.png")
    for i in range(args.test_good):
        picture(normal(), None, root / "test" / "good" / f"{i:03d}.png")
    for defect in DEFECTS + MORE_DEFECTS if scene == "conveyor" else SURFACE_DEFECTS:
        for i in range(args.defect_images):
            image, mask = with_defect(defect)
            picture(image, mask, root / "test" / defect / f"{i:03d}.png")


def load_mask(root: Path, path: Path, args) -> np.ndarray:
    side = (args.width // MAP_SCALE, args.height // MAP_SCALE)
    if path.parent.name == "good":
        return np.zeros((side[1], side[0]), dtype=bool)
    mask = Image.open(root / "ground_truth" / path.parent.name / f"{path.stem}_mask.png")
    return np.asarray(mask.resize(side, Image.NEAREST)) > 127


def region_pixels(roi, args) -> np.ndarray:
    """The region of interest on the quarter-side maps, as a boolean mask."""
    inside = np.zeros((args.height // MAP_SCALE, args.width // MAP_SCALE), dtype=bool)
    x, y, w, h = (v // MAP_SCALE for v in roi)
    inside[y : y + h, x : x + w] = True
    return inside


def small(anomaly_map: np.ndarray, args) -> np.ndarray:
    side = (args.width // MAP_SCALE, args.height // MAP_SCALE)
    return np.asarray(Image.fromarray(anomaly_map.astype(np.float32), mode="F").resize(side, Image.BILINEAR))


if __name__ == "__main__":
    main()
