"""``padim drift``: a folder of recent images read against a model's calibration, and its HTML report.

The same reading as the service's monitor (:func:`padim.core.drift.assess`: flag rate against the
promise, one-sided score and input drift), for a nightly job over the images a line kept: no
labels needed. The report plots the folder's scores and input distances against the
calibration's normal ones, with the threshold, and lists the highest-scoring images.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=True)  # files, never a display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
import numpy as np
import torch
from tqdm.auto import tqdm

from padim.core.drift import LEVEL, MIN_IMAGES, Drift, assess
from padim.models.data.images import iter_for_model
from padim.models.evaluation.pages import TEMPLATES, data_uri, write_atomically

REPORT_FILE, JSON_FILE = "drift.html", "drift.json"
#: Highest-scoring images listed in the report and the JSON.
LISTED = 20


@dataclass
class Recent:
    """The folder's images as scored: raw scores and input distances (``None``: the scorer has none).

    Attributes:
        names: paths of the images scored, in the order of the values.
        unreadable: ``(path, reason)`` of the images that could not be read (not scored).
    """

    names: list[str] = field(default_factory=list)
    raw_scores: list[float] = field(default_factory=list)
    input_distances: list[float] | None = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


def score_folder(scorer, paths: list[Path], batch_size: int, workers: int, progress: bool = True) -> Recent:
    """Score ``paths`` with ``scorer`` (any runtime) and keep what the drift reading needs."""
    recent, unreadable = Recent(), list[tuple[Path, str]]()
    config = scorer.config
    with tqdm(total=len(paths), desc="drift", unit="img", disable=not progress, leave=False) as bar:
        for chunk, loaded in iter_for_model(paths, config, batch_size, workers, unreadable):
            out = scorer.score(scorer.preprocess(loaded))
            recent.names += [str(p) for p in chunk]
            recent.raw_scores += out.raw_scores.double().cpu().tolist()
            if out.input_distances is None:
                recent.input_distances = None
            elif recent.input_distances is not None:
                recent.input_distances += out.input_distances.double().cpu().tolist()
            bar.update(len(chunk))
        bar.update(len(unreadable))
    recent.unreadable = [(str(p), reason) for p, reason in unreadable]
    return recent


def read_drift(recent: Recent, calibration, level: float = LEVEL, min_images: int = MIN_IMAGES) -> Drift:
    """:func:`padim.core.drift.assess` of the folder, in its file order (a window of every image)."""
    inputs = None if recent.input_distances is None else torch.tensor(recent.input_distances, dtype=torch.float64)
    return assess(torch.tensor(recent.raw_scores, dtype=torch.float64), calibration, inputs, level, min_images)


def write_drift_report(
    directory: str | Path, recent: Recent, drift: Drift, scorer, model_label: str, folder_label: str
) -> Path:
    """Write ``DIR/drift.html`` and ``DIR/drift.json`` (each replaced atomically); returns the HTML path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    calibration = scorer.calibration
    order = np.argsort(-np.asarray(recent.raw_scores), kind="stable")[:LISTED]
    highest = [
        {
            "path": recent.names[i],
            "raw_score": recent.raw_scores[i],
            "score": calibration.score(recent.raw_scores[i]),
            "is_anomaly": recent.raw_scores[i] >= calibration.threshold,
        }
        for i in order
    ]
    document = {
        "model": model_label,
        "folder": folder_label,
        **drift.to_dict(),
        "calibration": calibration.summary(),
        "unreadable": [{"path": p, "reason": r} for p, r in recent.unreadable],
        "highest": highest,
    }
    page = (
        TEMPLATE.render(
            model_label=model_label,
            folder=folder_label,
            weights_label=scorer.weights.label,
            stamp=scorer.weights.stamp,
            runtime=scorer.runtime,
            created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            drift=drift,
            rows=_rows(drift),
            plot=_plot(recent, calibration),
            highest=highest,
            unreadable=recent.unreadable,
        )
        + "\n"
    )
    write_atomically(directory / JSON_FILE, json.dumps(document, indent=2) + "\n")
    write_atomically(directory / REPORT_FILE, page)
    return directory / REPORT_FILE


TEMPLATE = TEMPLATES.get_template("drift.html")


def _rows(drift: Drift) -> list[dict]:
    """One table row per test: what it compares, its statistic, p-value and whether it fired."""
    rows = []
    if drift.flag_rate is not None:
        flag = drift.flag_rate
        rows.append(
            {
                "test": "flag rate (one-sided binomial)",
                "value": f"{flag.flags} of {drift.images} flagged "
                f"({flag.rate:.1%}); normal images give at most {flag.normal_rate:.1%} ({flag.basis})",
                "p_value": f"{flag.p_value:.3g}",
                "alarm": flag.alarm,
            }
        )
    for name, shift in (
        ("score drift (one-sided KS)", drift.score_drift),
        ("input drift (one-sided KS)", drift.input_drift),
    ):
        if shift is None:
            continue
        psi = f", PSI {shift.psi:.3f}" if shift.psi is not None else ""
        rows.append(
            {
                "test": name,
                "value": f"D+ {shift.statistic:.3f}, median x{shift.median_ratio:.3f}{psi}",
                "p_value": f"{shift.p_value:.3g}",
                "alarm": shift.alarm,
            }
        )
    return rows


def _plot(recent: Recent, calibration) -> str:
    """Scores (0..1 scale, the threshold at 0.5) and input distances: the folder's against the calibration's."""
    panels = 2 if recent.input_distances and calibration.input_distances else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.2), dpi=100, squeeze=False)
    edges = np.linspace(0.0, 1.0, 41)
    folder = calibration.normalise(torch.tensor(recent.raw_scores, dtype=torch.float64)).numpy()
    normal = calibration.normalise(torch.tensor(calibration.reference_scores, dtype=torch.float64)).numpy()
    ax = axes[0, 0]
    ax.hist(normal, bins=edges, density=True, alpha=0.5, color="#8c959f", label=f"calibration ({len(normal)} normal)")
    ax.hist(folder, bins=edges, density=True, alpha=0.6, color="#0969da", label=f"this folder ({len(folder)})")
    ax.axvline(0.5, color="#cf222e", linewidth=2, label="threshold")
    ax.set_xlabel("score (0..1)")
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0, 1]
        both = np.concatenate([recent.input_distances, calibration.input_distances])
        bins = np.linspace(both.min(), both.max(), 41)
        ax.hist(calibration.input_distances, bins=bins, density=True, alpha=0.5, color="#8c959f", label="calibration")
        ax.hist(recent.input_distances, bins=bins, density=True, alpha=0.6, color="#0969da", label="this folder")
        ax.set_xlabel("input distance (mean squared distance a pixel)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return data_uri(buffer.getvalue(), "image/png")
