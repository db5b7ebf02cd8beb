"""Evaluation on an MVTec AD-layout category: image/pixel AUROC, PRO and F1.

PRO (Bergmann et al., MVTec AD, 2021): for each threshold, the mean over ground-truth regions
(connected components of every mask) of the share of the region above the threshold, plotted
against the false-positive rate on normal pixels; the area under that curve up to 30% FPR,
divided by 0.3. Computed exactly from one sort of all pixels: every pixel of region ``r`` adds
``1 / (|r| * R)`` to the mean overlap when the threshold passes below it, every normal pixel
adds ``1 / N_normal`` to the FPR.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from scipy import ndimage
from sklearn.metrics import f1_score, precision_recall_curve, roc_auc_score
from tqdm.auto import tqdm

from padim.models.choices import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS
from padim.models.data.framing import Framing
from padim.models.data.images import IMAGE_SUFFIXES, iter_for_model, list_images
from padim.models.errors import UsageError
from padim.models.scorer import Scorer


@dataclass(frozen=True)
class Sample:
    path: Path
    defect: str  # "good" for normal images
    mask_path: Path | None

    @property
    def is_anomalous(self) -> bool:
        return self.defect != "good"

    @property
    def has_pixel_truth(self) -> bool:
        """Whether its pixels' truth is known: a good picture's are all normal; a defect's needs its mask."""
        return not self.is_anomalous or self.mask_path is not None


def pixel_truth(samples: list[Sample]) -> np.ndarray:
    """``(N,)`` bool: which pictures the pixel metrics read (:attr:`Sample.has_pixel_truth`)."""
    return np.array([s.has_pixel_truth for s in samples], dtype=bool)


def unmasked(samples: list[Sample]) -> dict[str, int]:
    """Defect pictures without a mask in ``ground_truth/<defect>/``, counted by defect folder: they count by image
    (image AUROC, F1) and are left out of the pixel metrics, whose truth they lack."""
    counts: dict[str, int] = {}
    for sample in samples:
        if not sample.has_pixel_truth:
            counts[sample.defect] = counts.get(sample.defect, 0) + 1
    return counts


def read_mvtec_category(root: str | Path) -> list[Sample]:
    """The test samples of an MVTec-layout category, sorted by defect type and name."""
    root = Path(root)
    test = root / "test"
    if not test.is_dir():
        raise UsageError(
            f"{root}: not an MVTec-layout category (no test/ directory; expected train/good, test/<good|defect>, "
            "ground_truth/<defect>)"
        )
    samples = []
    for defect_dir in sorted(d for d in test.iterdir() if d.is_dir()):
        for path in list_images(defect_dir):
            mask = None
            if defect_dir.name != "good":
                candidates = [root / "ground_truth" / defect_dir.name / f"{path.stem}_mask{s}" for s in IMAGE_SUFFIXES]
                mask = next((c for c in candidates if c.exists()), None)
            samples.append(Sample(path, defect_dir.name, mask))
    if not samples:
        raise UsageError(f"{root}: no test images under test/")
    return samples


def pro_curve(maps: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The whole PRO curve: ``(fpr, pro)``, one point per distinct threshold, from (0, 0).

    Args:
        maps: ``(N, H, W)`` anomaly scores.
        masks: ``(N, H, W)`` boolean ground truth.
    """
    weights_region = np.zeros(masks.shape, dtype=np.float64)
    regions = []
    for i in range(masks.shape[0]):
        labels, count = ndimage.label(masks[i])
        for r in range(1, count + 1):
            regions.append((i, labels == r))
    if not regions:
        raise UsageError("PRO needs at least one anomalous region")
    for i, region in regions:
        weights_region[i][region] = 1.0 / (region.sum() * len(regions))
    normal = ~masks
    weights_normal = normal / normal.sum()
    order = np.argsort(-maps.ravel(), kind="stable")
    scores = maps.ravel()[order]
    pro = np.cumsum(weights_region.ravel()[order])
    fpr = np.cumsum(weights_normal.ravel()[order])
    # one point per distinct threshold: the last pixel of each run of equal scores
    last = np.r_[scores[1:] != scores[:-1], True]
    return np.r_[0.0, fpr[last]], np.r_[0.0, pro[last]]


def per_region_overlap(maps: np.ndarray, masks: np.ndarray, max_fpr: float = 0.3) -> float:
    """Normalised area under the PRO curve up to ``max_fpr``.

    Args:
        maps: ``(N, H, W)`` anomaly scores.
        masks: ``(N, H, W)`` boolean ground truth.
    """
    fpr, pro = pro_curve(maps, masks)
    cut = np.searchsorted(fpr, max_fpr, side="right")
    fpr_c, pro_c = fpr[:cut], pro[:cut]
    if cut < len(fpr):  # interpolate the curve at exactly max_fpr
        f0, f1, p0, p1 = fpr[cut - 1], fpr[cut], pro[cut - 1], pro[cut]
        p_at = p0 + (p1 - p0) * (max_fpr - f0) / (f1 - f0) if f1 > f0 else p1
        fpr_c, pro_c = np.r_[fpr_c, max_fpr], np.r_[pro_c, p_at]
    return float(np.trapezoid(pro_c, fpr_c) / max_fpr)


@dataclass
class Scored:
    """A category's test images, scored: what the metrics and the report are computed from.

    Attributes:
        samples: the test images, in order.
        raw_scores: ``(N,)`` raw image scores.
        maps: ``(N, S, S)`` raw maps at the model's input size.
        raw_threshold: the model's threshold (raw units), ``None`` without a calibration.
    """

    samples: list[Sample]
    raw_scores: np.ndarray
    maps: np.ndarray
    raw_threshold: float | None
    framing: Framing | None = None

    @cached_property
    def masks(self) -> np.ndarray:
        """``(N, S, S)`` ground truth on the model input (framed as the pictures were), read once
        (metrics and report share it)."""
        return load_masks(self.samples, self.framing or tuple(self.maps.shape[-2:]))


def score_category(
    detector: Scorer,
    root: str | Path,
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int = DEFAULT_WORKERS,
    progress: bool = True,
) -> Scored:
    """Score every test image of a category (any runtime's detector)."""
    samples = read_mvtec_category(root)
    raw_scores, maps = [], []
    with tqdm(total=len(samples), desc="evaluate", unit="img", disable=not progress, leave=False) as bar:
        for chunk, images in iter_for_model([s.path for s in samples], detector.config, batch_size, workers):
            out = detector.score(detector.preprocess(images))
            raw_scores.append(out.raw_scores.cpu())
            maps.append(out.maps.cpu())
            bar.update(len(chunk))
    threshold = detector.calibration.threshold if detector.calibration else None
    return Scored(
        samples, torch.cat(raw_scores).numpy(), torch.cat(maps).numpy(), threshold, Framing.of(detector.config)
    )


def load_masks(samples: list[Sample], size: int | tuple[int, int] | Framing) -> np.ndarray:
    """Ground-truth masks ``(N, H_in, W_in)`` (nearest; all False for good images), framed as the model frames
    pictures when ``size`` is a :class:`~padim.models.data.framing.Framing` (region, resize mode, tiles): a
    defect outside the region is not counted, as the model never sees it. ``size``: else the maps' side, or
    their ``(height, width)``."""
    framing = size if isinstance(size, Framing) else None
    if isinstance(size, Framing):
        shape = size.input_shape
    elif isinstance(size, int):
        shape = (size, size)
    else:
        shape = (size[0], size[1])
    masks = []
    for sample in samples:
        if sample.mask_path is None:
            masks.append(torch.zeros(*shape, dtype=torch.bool))
            continue
        if framing is not None and not framing.is_whole_picture:
            masks.append(torch.from_numpy(framing.to_square_mask(Image.open(sample.mask_path))))
            continue
        mask = torch.from_numpy(np.asarray(Image.open(sample.mask_path).convert("L")) > 127)
        masks.append(F.interpolate(mask[None, None].float(), size=shape, mode="nearest")[0, 0] > 0.5)
    return torch.stack(masks).numpy()


def compute_metrics(
    samples: list[Sample],
    raw_scores: np.ndarray,
    maps: np.ndarray,
    threshold: float | None = None,
    masks: np.ndarray | None = None,
) -> dict:
    """Image AUROC, pixel AUROC, PRO and F1 from any detector's scores ``(N,)`` and maps ``(N, S, S)``.

    The pixel metrics read the pictures whose pixels' truth is known: good ones, and defect ones with a mask; a
    defect picture without a mask counts by image only (``unmasked_defect_images``), never as all-normal pixels.

    Args:
        masks: ``(N, S, S)`` ground truth, if already read (:attr:`Scored.masks`).
    """
    scores = np.asarray(raw_scores, dtype=np.float64)
    mask_array = load_masks(samples, tuple(maps.shape[-2:])) if masks is None else masks
    labels = np.array([s.is_anomalous for s in samples])
    has_both = labels.any() and not labels.all()
    known = pixel_truth(samples)
    pixel_masks, pixel_maps = mask_array[known], maps[known]
    has_pixels = pixel_masks.any() and not pixel_masks.all()
    result: dict = {
        "images": len(samples),
        "anomalous_images": int(labels.sum()),
        "unmasked_defect_images": int((~known).sum()),
        "image_auroc": float(roc_auc_score(labels, scores)) if has_both else None,
        "pixel_auroc": float(roc_auc_score(pixel_masks.ravel(), pixel_maps.ravel())) if has_pixels else None,
        "pro_0.3": per_region_overlap(pixel_maps, pixel_masks) if has_pixels else None,
        **threshold_metrics(samples, scores, threshold),
    }
    if has_both:
        precision, recall, thresholds = precision_recall_curve(labels, scores)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / np.maximum(precision + recall, 1e-12), 0)[:-1]
        best = int(np.argmax(f1))
        result["f1_optimal"] = float(f1[best])
        result["f1_optimal_raw_threshold"] = float(thresholds[best])
        result["image_auroc_by_defect"] = {
            d: float(roc_auc_score(labels[mask_d], scores[mask_d]))
            for d in sorted({s.defect for s in samples} - {"good"})
            if (mask_d := np.array([s.defect in ("good", d) for s in samples])).any()
        }
    return result


def threshold_metrics(samples: list[Sample], raw_scores: np.ndarray, threshold: float | None) -> dict:
    """What a threshold gives on scores ``(N,)``: F1, the confusion counts, and how many of each type it flags."""
    scores = np.asarray(raw_scores, dtype=np.float64)
    labels = np.array([s.is_anomalous for s in samples])
    has_both = labels.any() and not labels.all()
    result: dict = {
        "raw_threshold": threshold,
        "f1_at_threshold": float(f1_score(labels, scores >= threshold)) if threshold is not None and has_both else None,
    }
    if threshold is not None:
        flagged = scores >= threshold
        result["confusion_at_threshold"] = {
            "true_negatives": int((~flagged & ~labels).sum()),
            "false_positives": int((flagged & ~labels).sum()),
            "false_negatives": int((~flagged & labels).sum()),
            "true_positives": int((flagged & labels).sum()),
        }
        result["flagged_by_defect"] = {
            d: [int(flagged[mask_d].sum()), int(mask_d.sum())]
            for d in sorted({s.defect for s in samples})
            if (mask_d := np.array([s.defect == d for s in samples])).any()
        }
    return result
