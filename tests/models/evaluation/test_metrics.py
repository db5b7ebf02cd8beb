"""PRO against a threshold-by-threshold reference, and the MVTec reader."""

import numpy as np
import pytest
from scipy import ndimage

from padim.models.evaluation.metrics import per_region_overlap, read_mvtec_category


def reference_pro(maps, masks, max_fpr=0.3):
    """The definition, one threshold at a time (as MVTec's and anomalib's reference code)."""
    thresholds = np.unique(maps)[::-1]
    regions = []
    for i in range(len(masks)):
        labels, n = ndimage.label(masks[i])
        regions += [(i, labels == r) for r in range(1, n + 1)]
    normal = ~masks
    fprs, pros = [0.0], [0.0]
    for t in thresholds:
        above = maps >= t
        fprs.append((above & normal).sum() / normal.sum())
        pros.append(np.mean([above[i][r].mean() for i, r in regions]))
    fprs, pros = np.array(fprs), np.array(pros)
    keep = fprs <= max_fpr
    f, p = fprs[keep], pros[keep]
    nxt = np.argmax(~keep)
    if not keep.all():
        f1, p1 = fprs[nxt], pros[nxt]
        p = np.r_[p, p[-1] + (p1 - p[-1]) * (max_fpr - f[-1]) / (f1 - f[-1])]
        f = np.r_[f, max_fpr]
    return np.trapezoid(p, f) / max_fpr


def test_pro_matches_reference():
    rng = np.random.default_rng(0)
    masks = np.zeros((3, 12, 12), dtype=bool)
    masks[0, 2:5, 2:6] = True
    masks[0, 8:11, 8:10] = True
    masks[1, 5:9, 1:3] = True
    maps = rng.random((3, 12, 12)) + masks * rng.random((3, 12, 12)) * 0.8
    maps = np.round(maps, 2)  # ties, as real maps have
    assert per_region_overlap(maps, masks) == pytest.approx(reference_pro(maps, masks), rel=1e-9)


def test_pro_perfect_and_inverted():
    masks = np.zeros((2, 10, 10), dtype=bool)
    masks[0, 3:6, 3:6] = True
    assert per_region_overlap(masks.astype(float), masks) == pytest.approx(1.0, abs=1e-9)
    assert per_region_overlap(1.0 - masks, masks) < 0.05


def test_read_mvtec_category(dataset):
    samples = read_mvtec_category(dataset)
    defects = {s.defect for s in samples}
    assert defects == {"good", "scratch", "stain", "hole"}
    assert all((s.mask_path is None) == (s.defect == "good") for s in samples)
    with pytest.raises(ValueError, match="MVTec-layout"):
        read_mvtec_category(dataset / "train")
