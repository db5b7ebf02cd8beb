"""Categories cut from photographed materials, in the MVTec layout, for the quality benchmarks.

The photographs are the ones scikit-image ships in its wheel (``skimage.data``; their sources and licences in
its documentation): brick, grass and gravel (textures, CC0), stained tissue (``immunohistochemistry``, a
microscope slide) and the moon's surface (NASA, public domain). Each 512 x 512 photograph is split in two
regions: the training crops and the *exchangeable* normal test crops come from the left half, the
*other-region* normal test crops from the right half (the same material, positions never seen: cell density,
stain and lighting differ a little, as on a real line's next batch). Defects are drawn on crops of both regions
with the product's own defect generator (:func:`padim.models.data.synthetic.add_defect`: scratch, stain, hole,
crack, speck), their masks under ``ground_truth``.

Layout of a category (``--root/<material>``: MVTec AD's, and its other region as a category of its own)::

    train/good/              training crops (left half)
    test/good/               unseen normal crops of the same half (exchangeable)
    test/<defect>/           defects drawn on crops of the left half
    ground_truth/<defect>/   their masks, ``<name>_mask.png``
    region/test/good/        normal crops of the right half (another region)
    region/test/<defect>/    defects drawn on crops of the right half
    region/ground_truth/<defect>/

    python benchmarks/photographed.py --root /tmp/photographed       # writes every material
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from padim.models.data.synthetic import DEFECTS, MORE_DEFECTS, add_defect

MATERIALS = ("brick", "grass", "gravel", "tissue", "moon")
KINDS = DEFECTS + MORE_DEFECTS
#: Crop side in the 512 px photograph (each half is 256 px wide).
CROP = 160


def photograph(material: str) -> np.ndarray:
    """``(512, 512, 3)`` uint8 RGB photograph of ``material`` from scikit-image's wheel."""
    try:
        from skimage import data
    except ImportError as error:  # pragma: no cover - the benchmark's own dependency
        raise SystemExit("the photographed categories need scikit-image: pip install scikit-image") from error
    loaders = {
        "brick": data.brick,
        "grass": data.grass,
        "gravel": data.gravel,
        "tissue": data.immunohistochemistry,
        "moon": data.moon,
    }
    array = np.asarray(loaders[material]())
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    return np.ascontiguousarray(array[:, :, :3]).astype(np.uint8)


def crops(picture: np.ndarray, half: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` crops of :data:`CROP` px at seeded positions inside the left (0) or right (1) half."""
    height, width = picture.shape[:2]
    left, right = (0, width // 2) if half == 0 else (width // 2, width)
    out = []
    for _ in range(count):
        x = int(rng.integers(left, right - CROP + 1))
        y = int(rng.integers(0, height - CROP + 1))
        out.append(picture[y : y + CROP, x : x + CROP].copy())
    return out


def write_category(
    root: Path,
    material: str,
    train: int = 60,
    good: int = 20,
    region_good: int = 25,
    per_defect: int = 5,
    seed: int = 0,
) -> Path:
    """Write one material's category under ``root``; returns its folder (kept when already complete)."""
    folder = root / material
    done = folder / ".complete"
    if done.exists():
        return folder
    rng = np.random.default_rng([seed, MATERIALS.index(material)])
    picture = photograph(material)

    def save(array: np.ndarray, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(path)

    for i, crop in enumerate(crops(picture, 0, train, rng)):
        save(crop, folder / "train" / "good" / f"{i:03d}.png")
    for i, crop in enumerate(crops(picture, 0, good, rng)):
        save(crop, folder / "test" / "good" / f"{i:03d}.png")
    for i, crop in enumerate(crops(picture, 1, region_good, rng)):
        save(crop, folder / "region" / "test" / "good" / f"{i:03d}.png")
    for half, where in ((0, folder), (1, folder / "region")):
        for kind in KINDS:
            for i, crop in enumerate(crops(picture, half, per_defect, rng)):
                image, mask = add_defect(crop.astype(np.float32) / 255.0, kind, rng)
                save((np.clip(image, 0, 1) * 255).round().astype(np.uint8), where / "test" / kind / f"{i:03d}.png")
                save((mask > 0).astype(np.uint8) * 255, where / "ground_truth" / kind / f"{i:03d}_mask.png")
    done.touch()
    return folder


#: Defects of the tiled set: small ones (a speck 9-20 px across, a crack 2-3 px wide at 448 px).
SMALL_KINDS = ("speck", "crack")


def write_tiled_category(
    root: Path, material: str, side: int = 448, train: int = 60, good: int = 45, per_defect: int = 15, seed: int = 0
) -> Path:
    """``<material>-<side>``: crops of ``side`` px anywhere in the photograph (one region: an exchangeable set)
    with small defects (:data:`SMALL_KINDS`), for a model of 2 x 2 tiles of 224 px (``train --tiles 2x2``)."""
    folder = root / f"{material}-{side}"
    if (folder / ".complete").exists():
        return folder
    rng = np.random.default_rng([seed, MATERIALS.index(material), side])
    picture = photograph(material)

    def cut(count: int) -> list[np.ndarray]:
        height, width = picture.shape[:2]
        out = []
        for _ in range(count):
            x, y = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
            out.append(picture[y : y + side, x : x + side].copy())
        return out

    for i, crop in enumerate(cut(train)):
        Image.fromarray(crop).save(_made(folder / "train" / "good") / f"{i:03d}.png")
    for i, crop in enumerate(cut(good)):
        Image.fromarray(crop).save(_made(folder / "test" / "good") / f"{i:03d}.png")
    for kind in SMALL_KINDS:
        for i, crop in enumerate(cut(per_defect)):
            image, mask = add_defect(crop.astype(np.float32) / 255.0, kind, rng)
            Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).save(
                _made(folder / "test" / kind) / f"{i:03d}.png"
            )
            Image.fromarray((mask > 0).astype(np.uint8) * 255).save(
                _made(folder / "ground_truth" / kind) / f"{i:03d}_mask.png"
            )
    (folder / ".complete").touch()
    return folder


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--materials", default=",".join(MATERIALS))
    args = parser.parse_args()
    for material in args.materials.split(","):
        print(write_category(args.root, material))


if __name__ == "__main__":
    main()
