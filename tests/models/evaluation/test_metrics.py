"""PRO against a threshold-by-threshold reference, the MVTec reader, and pixel metrics without every mask."""

from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage
from sklearn.metrics import roc_auc_score

from padim.models.evaluation.metrics import Sample, compute_metrics, per_region_overlap, read_mvtec_category, unmasked


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


def test_a_defect_picture_without_a_mask_counts_by_image_only(tmp_path):
    """Its pixels' truth is unknown: it is left out of pixel AUROC and PRO, never read as all-normal pixels."""
    rng = np.random.default_rng(3)
    (tmp_path / "m.png").touch()
    samples = [
        Sample(Path("g0.png"), "good", None),
        Sample(Path("g1.png"), "good", None),
        Sample(Path("h0.png"), "hole", tmp_path / "m.png"),
        Sample(Path("h1.png"), "hole", None),  # no mask
    ]
    masks = np.zeros((4, 8, 8), dtype=bool)
    masks[2, 2:5, 2:5] = True
    maps = rng.random((4, 8, 8))
    maps[2, 2:5, 2:5] += 1.0
    maps[3, 4:7, 4:7] += 1.0  # its defect, somewhere its (missing) mask would have said
    scores = maps.reshape(4, -1).max(axis=1)
    result = compute_metrics(samples, scores, maps, masks=masks)
    known = [0, 1, 2]
    assert result["unmasked_defect_images"] == 1 and unmasked(samples) == {"hole": 1}
    assert result["pixel_auroc"] == pytest.approx(roc_auc_score(masks[known].ravel(), maps[known].ravel()))
    assert result["pro_0.3"] == pytest.approx(reference_pro(maps[known], masks[known]))
    as_all_normal = roc_auc_score(masks.ravel(), maps.ravel())  # what counting it as normal pixels would give
    assert result["pixel_auroc"] > as_all_normal + 0.01
    assert result["image_auroc"] == pytest.approx(roc_auc_score([0, 0, 1, 1], scores))  # every picture, by image
