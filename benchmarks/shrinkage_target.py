"""What a calibration that keeps the pooled target costs: leave-one-out scores with the fitted model's ``T`` (as
``train --shrinkage`` computes them, :func:`padim.core.out_of_fold.out_of_fold_squared_distances`) against
brute-force refits that leave each picture out of ``T`` too, in float64, on real embeddings.

Per category (photographed, :mod:`photographed`) it embeds the training crops with the product's embedder
(seeded random resnet18, 224 px, neighbourhood 1), computes both sets of leave-one-out distances and prints the
largest relative difference of a pixel's distance and of a picture's score (the map's maximum over the feature
grid), and how far the threshold the product would set moves (:class:`padim.core.calibration.Calibration`).

    python benchmarks/shrinkage_target.py --categories tissue,brick --train 40     # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from photographed import MATERIALS, write_category
from PIL import Image
from timing import work_folder

from padim.core.calibration import Calibration
from padim.core.out_of_fold import out_of_fold_squared_distances
from padim.core.statistics import Shrinkage, batch_state, covariance, downdate_state_, pooled_comoment
from padim.models import Fit, PadimConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--categories", default="tissue,brick")
    parser.add_argument("--train", type=int, default=40)
    parser.add_argument("--shrinkage", type=float, default=0.5)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    root = work_folder(args.workdir, "padim-target-")
    config = PadimConfig(weights="random", neighbourhood=1, expect="", shrinkage=args.shrinkage)
    fit = Fit.start(config)
    epsilon = config.gaussian.epsilon
    for name in args.categories.split(","):
        if name not in MATERIALS:
            raise SystemExit(f"{name}: one of {', '.join(MATERIALS)}")
        folder = write_category(root, name, train=args.train)
        paths = sorted((folder / "train" / "good").glob("*.png"))[: args.train]
        with torch.no_grad():
            x = torch.cat(
                [
                    fit.reading.embed(
                        [p.name for p in paths[i : i + 16]], [Image.open(p).convert("RGB") for p in paths[i : i + 16]]
                    )
                    for i in range(0, len(paths), 16)
                ]
            ).double()  # (N, P, D)
        n, pixels, dim = x.shape
        state = batch_state(x)
        shrunk = Shrinkage.of(state, epsilon, args.shrinkage)
        kept = out_of_fold_squared_distances(covariance(state), state.mean, n, x, [1] * n, shrunk)  # (N, P)
        refitted = torch.empty_like(kept)
        for i in range(n):
            rest = downdate_state_(state.clone(), x[i : i + 1])
            own = Shrinkage.pooled(pooled_comoment(rest), n - 1, pixels, epsilon, args.shrinkage)
            cholesky = own.cholesky(covariance(rest))
            delta = (x[i] - rest.mean).unsqueeze(2)  # (P, D, 1)
            refitted[i] = torch.linalg.solve_triangular(cholesky, delta, upper=False).square().sum(dim=(1, 2))
        pixel_difference = float(((kept - refitted).abs() / refitted).max())
        scores_kept, scores_refitted = kept.amax(dim=1), refitted.amax(dim=1)
        score_difference = float(((scores_kept - scores_refitted).abs() / scores_refitted).max())
        low = float(((scores_kept - scores_refitted) / scores_refitted).min())
        threshold_kept = Calibration.from_scores(scores_kept, 0.01).threshold
        threshold_refitted = Calibration.from_scores(scores_refitted, 0.01).threshold
        print(
            f"{name}: {n} pictures, P={pixels}, D={dim}, shrinkage {args.shrinkage}: largest relative difference "
            f"of a pixel's distance {pixel_difference:.2e}, of a picture's score {score_difference:.2e} "
            f"(kept target lower by at most {-low:.2e}); threshold {threshold_kept:.4f} kept vs "
            f"{threshold_refitted:.4f} refitted ({(threshold_kept / threshold_refitted - 1) * 100:+.3f}%)"
        )


if __name__ == "__main__":
    main()
