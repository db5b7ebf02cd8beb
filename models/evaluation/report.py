"""``padim evaluate --report DIR``: one self-contained HTML file (images embedded) and the JSON beside it.

What an inspection engineer looks at before trusting a model on a line: the image and pixel ROC
curves with the operating point, the PRO curve, score histograms of good images against each
defect type with the threshold, the confusion counts at the threshold, AUROC per defect type, and
the worst false alarms and missed defects with their heat maps. Plots are drawn by matplotlib
(Agg, no display) into PNGs embedded as data URIs, so the file opens offline and can be mailed.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=True)  # files, never a display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
import numpy as np
import torch
from sklearn.metrics import roc_curve

from padim.models.data.images import open_image
from padim.models.evaluation.metrics import Scored, pixel_truth, pro_curve
from padim.models.evaluation.pages import TEMPLATES, data_uri, write_atomically
from padim.models.scoring.heatmaps import figure
from padim.models.scoring.verdicts import verdict

REPORT_FILE, JSON_FILE = "report.html", "evaluation.json"
#: Longest side of each half of a gallery heat map, in pixels.
GALLERY_SIDE = 320


def write_report(
    directory: str | Path, scored: Scored, metrics: dict, detector, model_label: str, gallery: int = 6
) -> Path:
    """Write ``DIR/report.html`` and ``DIR/evaluation.json`` (each replaced atomically); returns the HTML path.

    Args:
        scored: the category's test images and their scores and maps.
        metrics: :func:`padim.models.evaluation.metrics.compute_metrics` of ``scored`` (plus what the caller adds).
        detector: the detector that scored them (its calibration and weights label are shown).
        model_label: how the model is named in the report (its path).
        gallery: worst false alarms and worst misses shown, each.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    calibration = detector.calibration
    labels = np.array([s.is_anomalous for s in scored.samples])
    per_image = [
        {
            "path": str(s.path),
            "defect": s.defect,
            "raw_score": float(r),
            "score": calibration.score(float(r)),
            "is_anomaly": bool(scored.raw_threshold is not None and r >= scored.raw_threshold),
        }
        for s, r in zip(scored.samples, scored.raw_scores, strict=True)
    ]
    document = {**metrics, "per_image": per_image}
    plots = _plots(scored, labels, metrics)
    page = _page(scored, metrics, detector, model_label, plots, _gallery(scored, labels, detector, gallery))
    write_atomically(directory / JSON_FILE, json.dumps(document, indent=2) + "\n")
    write_atomically(directory / REPORT_FILE, page)
    return directory / REPORT_FILE


# ---------------------------------------------------------------------------------------- plots
def _plots(scored: Scored, labels: np.ndarray, metrics: dict) -> dict[str, str]:
    plots: dict[str, str] = {}
    scores = scored.raw_scores.astype(np.float64)
    if labels.any() and not labels.all():
        plots["image_roc"] = _image_roc(scores, labels, scored.raw_threshold, metrics)
    known = pixel_truth(scored.samples)  # as the metrics: a defect picture without a mask has no pixel truth
    masks, maps = scored.masks[known], scored.maps[known]
    if masks.any() and not masks.all():
        plots.update(_pixel_plots(masks, maps, metrics))
    plots["histogram"] = _histogram(scored, scores)
    return plots


def _image_roc(scores: np.ndarray, labels: np.ndarray, threshold: float | None, metrics: dict) -> str:
    fpr, tpr, _ = roc_curve(labels, scores)
    fig, ax = _axes(
        plt, "Image ROC", "false-positive rate (good images flagged)", "true-positive rate (defects caught)"
    )
    ax.plot(fpr, tpr, color="#1f6feb", lw=2, label=f"AUROC {metrics['image_auroc']:.3f}")
    if threshold is not None:
        flagged = scores >= threshold
        point = (flagged[~labels].mean(), flagged[labels].mean())
        ax.plot(*point, "o", color="#d1242f", ms=8, label=f"at the threshold ({point[0]:.1%}, {point[1]:.1%})")
    ax.plot([0, 1], [0, 1], ":", color="#999")
    ax.legend(loc="lower right")
    return _png(plt, fig)


def _pixel_plots(masks: np.ndarray, maps: np.ndarray, metrics: dict) -> dict[str, str]:
    """The pixel ROC and the PRO curve, on the pictures whose pixels' truth is known (as the metrics)."""
    fpr, tpr, _ = roc_curve(masks.ravel(), maps.ravel())
    fig, ax = _axes(plt, "Pixel ROC", "false-positive rate (normal pixels)", "true-positive rate (defect pixels)")
    ax.plot(fpr, tpr, color="#1f6feb", lw=2, label=f"AUROC {metrics['pixel_auroc']:.3f}")
    ax.plot([0, 1], [0, 1], ":", color="#999")
    ax.legend(loc="lower right")
    plots = {"pixel_roc": _png(plt, fig)}
    fpr, pro = pro_curve(maps, masks)
    fig, ax = _axes(
        plt, "Per-region overlap (PRO)", "false-positive rate (normal pixels)", "mean overlap per defect region"
    )
    ax.plot(fpr, pro, color="#8250df", lw=2, label=f"normalised area to 30% FPR {metrics['pro_0.3']:.3f}")
    ax.axvspan(0, 0.3, color="#8250df", alpha=0.08)
    ax.axvline(0.3, color="#8250df", ls=":", lw=1)
    ax.legend(loc="lower right")
    plots["pro"] = _png(plt, fig)
    return plots


def _histogram(scored: Scored, scores: np.ndarray) -> str:
    """Image scores of the good pictures against each defect type's, with the threshold."""
    threshold = scored.raw_threshold
    defects = sorted({s.defect for s in scored.samples})
    fig, ax = _axes(
        plt,
        "Image scores: good against each defect type",
        "raw score (Mahalanobis distance)",
        "images",
        size=(7.5, 3.6),
        square=False,
    )
    bins = np.histogram_bin_edges(scores, bins=min(40, max(10, len(scores) // 3)))
    colours = ["#2da44e", "#d1242f", "#bf8700", "#8250df", "#1f6feb", "#cf222e", "#0a3069", "#953800"]
    for i, defect in enumerate(["good", *[d for d in defects if d != "good"]]):
        chosen = np.array([s.defect == defect for s in scored.samples])
        if chosen.any():
            ax.hist(
                scores[chosen],
                bins=bins,
                alpha=0.55 if defect != "good" else 0.7,
                color=colours[i % len(colours)],
                label=f"{defect} ({chosen.sum()})",
                histtype="stepfilled",
                edgecolor="none",
            )
    if threshold is not None:
        ax.axvline(threshold, color="black", ls="--", lw=1.5, label=f"threshold {threshold:.3g}")
    ax.legend(fontsize=8, ncols=2)
    return _png(plt, fig)


def _axes(plt, title: str, xlabel: str, ylabel: str, size=(4.6, 4.2), square: bool = True):
    fig, ax = plt.subplots(figsize=size, dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    if square:
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
    return fig, ax


def _png(plt, fig) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return data_uri(buffer.getvalue(), "image/png")


# -------------------------------------------------------------------------------------- gallery
def _gallery(scored: Scored, labels: np.ndarray, detector, count: int) -> dict[str, list[dict]]:
    """The ``count`` highest-scoring good images and lowest-scoring defective ones, with heat maps."""
    order = np.argsort(-scored.raw_scores, kind="stable")
    false_alarms = [i for i in order if not labels[i]][:count]
    misses = [i for i in order[::-1] if labels[i]][:count]
    return {
        "false_alarms": [_card(scored, i, detector) for i in false_alarms],
        "misses": [_card(scored, i, detector) for i in misses],
    }


def _card(scored: Scored, index: int, detector) -> dict:
    sample = scored.samples[index]
    image = open_image(sample.path)
    picture_size = image.size
    if max(image.size) > GALLERY_SIDE:
        image.thumbnail((GALLERY_SIDE, GALLERY_SIDE))
    small = torch.from_numpy(scored.maps[index])
    full = detector.framing.to_picture(small, image.width, image.height, picture_size)  # 0 outside the region
    found = verdict(float(scored.raw_scores[index]), small, detector.calibration)
    picture = figure(
        image,
        detector.calibration.normalise(full.double()).numpy(),
        found,
        label=detector.weights.stamp,
        title=f"{sample.defect}/{sample.path.name}",
        scored=detector.framing.shown_box(image.width, image.height, picture_size),
    )
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", optimize=True)
    return {
        "path": str(sample.path),
        "defect": sample.defect,
        "score": found.score,
        "is_anomaly": found.is_anomaly,
        "image": data_uri(buffer.getvalue(), "image/png"),
    }


# ----------------------------------------------------------------------------------------- page
#: The page, a Jinja2 template beside this module.
TEMPLATE = TEMPLATES.get_template("report.html")
CAPTIONS = {
    "image_roc": "Image ROC: good images flagged against defective ones caught, at every threshold",
    "pixel_roc": "Pixel ROC: normal pixels against defect pixels",
    "pro": "PRO: the share of each defect region found, averaged over regions",
}


def _page(scored: Scored, metrics: dict, detector, model_label: str, plots: dict[str, str], gallery: dict) -> str:
    confusion = metrics.get("confusion_at_threshold")
    if confusion:
        confusion = {
            **confusion,
            "good": confusion["true_negatives"] + confusion["false_positives"],
            "bad": confusion["true_positives"] + confusion["false_negatives"],
        }
    return (
        TEMPLATE.render(
            category_name=Path(metrics["category"]).name,
            category=str(metrics["category"]),
            model_label=model_label,
            weights_label=detector.weights.label,
            runtime=detector.runtime,
            stamp=detector.weights.stamp,
            created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            summary=_summary_rows(scored, metrics, detector.calibration.summary()),
            confusion=confusion,
            defects=_defect_rows(metrics),
            curves=[{"uri": uri, "caption": CAPTIONS[name]} for name, uri in plots.items() if name in CAPTIONS],
            histogram=plots.get("histogram"),
            gallery=gallery,
        )
        + "\n"
    )


def _number(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _summary_rows(scored: Scored, metrics: dict, calibration: dict) -> list[tuple[str, str]]:
    return [
        ("Image AUROC", _number(metrics.get("image_auroc"))),
        ("Pixel AUROC", _number(metrics.get("pixel_auroc"))),
        ("PRO (to 30% FPR)", _number(metrics.get("pro_0.3"))),
        ("F1 at the threshold", _number(metrics.get("f1_at_threshold"))),
        (
            "Best F1 (threshold)",
            f"{_number(metrics.get('f1_optimal'))} ({_number(metrics.get('f1_optimal_raw_threshold'), 4)})"
            if "f1_optimal" in metrics
            else "n/a",
        ),
        ("Threshold (raw)", _number(scored.raw_threshold, 4)),
        (
            "Promised false-alarm rate",
            f"{calibration['promised_false_alarm_rate']:.2%} "
            f"(at most {calibration['false_alarm_bound']:.2%} with {calibration['confidence']:.0%} confidence)",
        ),
        ("Test images", f"{metrics['images']} ({metrics['anomalous_images']} defective)"),
    ]


def _defect_rows(metrics: dict) -> list[dict]:
    by_defect, flagged = metrics.get("image_auroc_by_defect", {}), metrics.get("flagged_by_defect", {})
    rows = []
    for defect in sorted(set(flagged) | set(by_defect), key=lambda d: (d != "good", d)):
        hits, total = flagged.get(defect, (None, None))
        rows.append(
            {
                "defect": defect,
                "images": "" if total is None else total,
                "auroc": "—" if defect == "good" else _number(by_defect.get(defect)),
                "flagged": "n/a"
                if hits is None
                else f"{hits} of {total}" + (" (false alarms)" if defect == "good" else ""),
            }
        )
    return rows
