"""Small defects on big pictures: the whole picture squashed to the model input, against a region of
interest (squashed, or padded to keep its aspect ratio), measured through the product (``padim.fit``,
``Detector.predict``).

Generated pictures (``--width`` x ``--height``, default 1536 x 1024): a generated texture part
(``models/data/synthetic.py``, its defects drawn at the part's scale: a speck is 0.03-0.15% of the
part) placed at a fixed spot on a conveyor background whose clutter (bolts, cable, glare) moves
from picture to picture, as it does on a line. The region of interest is the part. Per framing
it prints image AUROC, pixel AUROC (maps at a quarter of the picture's side), the defect recall and
the false-alarm rate on unseen normal pictures at the threshold ``train`` calibrates for 1%, fit
time, and scoring time per picture. Pixel AUROC is computed inside the region for every framing (a
region's map is 0 outside it by design, which would count as easy negatives). Seeded random resnet18 weights (ImageNet weights cannot be
fetched here) unless ``--weights`` names a state_dict file.

    python benchmarks/high_resolution.py                          # 3 categories, 100/100/5 x 12 pictures
    python benchmarks/high_resolution.py --quick                  # 1 category, fewer pictures
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from sklearn.metrics import roc_auc_score

import padim
from padim.models import PadimConfig
from padim.models.data.synthetic import DEFECTS, MORE_DEFECTS, add_defect, texture
from timing import machine_name, seeded_resnet18, work_folder

HERE = Path(__file__).resolve().parent
FRAMINGS = {"whole picture, squashed": {}, "region, squashed": {"roi": True, "resize": "squash"},
            "region, padded": {"roi": True, "resize": "pad"}}
MAP_SCALE = 4  # pixel AUROC on maps at 1/4 of the picture's side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--categories", default="weave,leather,pill")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--part", type=int, default=640, help="side of the square part (pixels)")
    parser.add_argument("--train", type=int, default=100)
    parser.add_argument("--test-good", type=int, default=100)
    parser.add_argument("--defect-images", type=int, default=12, help="per defect kind (5 kinds)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--weights", default="random")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.categories, args.train, args.test_good, args.defect_images = "weave", 40, 40, 4
    work = work_folder(args.workdir, "padim-highres-")
    weights = str(seeded_resnet18(work / "resnet18-seed0.pth")) if args.weights == "random" else args.weights
    left, top = (args.width - args.part) // 2 + 97, (args.height - args.part) // 2 - 41  # off-centre, fixed
    roi = (left, top, args.part, args.part + args.part // 4)  # the part and a strip of belt below it
    rows = []
    for c, category in enumerate(args.categories.split(",")):
        root = work / "data" / category
        if not (root / "done").exists():
            make_pictures(root, category, args, (left, top), seed=c)
            (root / "done").write_text("")
        train = sorted((root / "train").glob("*.png"))
        tests = sorted((root / "test").rglob("*.png"))
        labels = np.array(["/good/" not in str(p) for p in tests])
        masks = [load_mask(root, p, args) for p in tests]
        for name, framing in FRAMINGS.items():
            options = {"resize": framing.get("resize", "squash"), **({"roi": roi} if framing.get("roi") else {})}
            config = PadimConfig(weights=weights, image_size=args.image_size, device="cpu", **options)
            started = time.perf_counter()
            detector = padim.fit(train, config=config, progress=False)
            fit_seconds = time.perf_counter() - started
            started = time.perf_counter()
            predictions = detector.predict(tests)
            score_seconds = (time.perf_counter() - started) / len(tests)
            scores = np.array([p.raw_score for p in predictions])
            flagged = np.array([p.is_anomaly for p in predictions])
            # pixel AUROC inside the region for every framing: outside it a region's map is 0 by design
            inside = region_pixels(roi, args)
            maps = [small(p.anomaly_map, args)[inside] for p in predictions]
            pixel = roc_auc_score(np.concatenate([m[inside] for m in masks]), np.concatenate(maps))
            row = {"category": category, "framing": name, "image_auroc": roc_auc_score(labels, scores),
                   "pixel_auroc": pixel, "recall": float(flagged[labels].mean()),
                   "false_alarms": float(flagged[~labels].mean()), "normal_pictures": int((~labels).sum()),
                   "defect_pictures": int(labels.sum()), "fit_seconds": round(fit_seconds, 1),
                   "seconds_per_picture": round(score_seconds, 4)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for name in FRAMINGS:
        part = [r for r in rows if r["framing"] == name]
        summary[name] = {k: round(float(np.mean([r[k] for r in part])), 4) for k in
                         ("image_auroc", "pixel_auroc", "recall", "false_alarms", "fit_seconds", "seconds_per_picture")}
    result = {"machine": machine_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "weights": "seeded random resnet18 (seed 0), not ImageNet" if args.weights == "random" else args.weights,
              "pictures": f"{args.width}x{args.height}, part {args.part} px at {left},{top}; region of interest {roi}",
              "per_category": f"{args.train} training, {args.test_good} unseen normal, {args.defect_images} x "
                              f"{len(DEFECTS + MORE_DEFECTS)} defect pictures",
              "image_size": args.image_size, "summary": summary, "rows": rows}
    output = args.output or HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{machine_name()}-high-resolution.json"
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'framing':26} {'img AUROC':>9} {'px AUROC':>9} {'recall':>7} {'FA':>6} {'fit s':>7} {'s/picture':>9}")
    for name, s in summary.items():
        print(f"{name:26} {s['image_auroc']:9.3f} {s['pixel_auroc']:9.3f} {s['recall']:7.3f} {s['false_alarms']:6.3f} "
              f"{s['fit_seconds']:7.1f} {s['seconds_per_picture']:9.3f}")
    print(f"results: {output}")


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


def make_pictures(root: Path, category: str, args, place: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng([seed, 26])

    def picture(part: np.ndarray, mask: np.ndarray | None, path: Path) -> None:
        canvas = belt(args.width, args.height, rng)
        canvas.paste(Image.fromarray((part * 255 + 0.5).astype(np.uint8)), place)
        path.parent.mkdir(parents=True, exist_ok=True)
        canvas.save(path)
        if mask is not None:
            full = Image.new("L", (args.width, args.height), 0)
            full.paste(Image.fromarray(mask.astype(np.uint8) * 255), place)
            target = root / "ground_truth" / path.parent.name / f"{path.stem}_mask.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            full.save(target)

    for i in range(args.train):
        picture(texture(category, args.part, rng), None, root / "train" / f"{i:03d}.png")
    for i in range(args.test_good):
        picture(texture(category, args.part, rng), None, root / "test" / "good" / f"{i:03d}.png")
    for defect in DEFECTS + MORE_DEFECTS:
        for i in range(args.defect_images):
            image, mask = add_defect(texture(category, args.part, rng), defect, rng)
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
    inside[y:y + h, x:x + w] = True
    return inside


def small(anomaly_map: np.ndarray, args) -> np.ndarray:
    side = (args.width // MAP_SCALE, args.height // MAP_SCALE)
    return np.asarray(Image.fromarray(anomaly_map.astype(np.float32), mode="F").resize(side, Image.BILINEAR))


if __name__ == "__main__":
    main()
