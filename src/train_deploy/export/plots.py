"""The pictures of a bundle: training curves from the run's ``metrics.jsonl`` and latency by form and batch.

Both are PNGs in ``<bundle>/plots/`` that ``MODEL_CARD.md`` embeds with relative links. Figures are plain
``matplotlib.figure.Figure`` objects (Agg, never pyplot's global state), saved with fixed size, resolution
and no software metadata, so the same numbers give the same bytes. The training picture shows the rows up to
the exported step only: for a given checkpoint they are fixed, and the bundle fingerprint includes them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train_deploy.hashing import digest

logger = logging.getLogger(__name__)

PLOTS_FOLDER = "plots"
TRAINING_PLOT, LATENCY_PLOT = f"{PLOTS_FOLDER}/training.png", f"{PLOTS_FOLDER}/latency.png"
DPI = 100

# (panel title, y label, metric keys drawn in it); the keys are the training workers' metrics.jsonl keys.
_PANELS = (("loss", "cross-entropy (nats/token)", ("loss", "val_loss")),
           ("learning rate", "learning rate", ("lr",)),
           ("throughput", "tokens/s", ("tokens_per_second",)),
           ("gradient norm", "global L2 norm", ("grad_norm",)))
_LABELS = {"loss": "training loss", "val_loss": "validation loss"}


@dataclass(frozen=True, slots=True)
class TrainingCurves:
    """The training run's per-step metrics up to the exported step, or why there are none."""

    rows: list[dict[str, float]] = field(default_factory=list)
    """One row per step, ascending; for a step logged twice (a resumed run), the later line."""
    source: str = ""
    """The ``metrics.jsonl`` they were read from."""
    missing: str = ""
    """Why there are no rows (no metrics file, a checkpoint from elsewhere); empty when there are."""

    @property
    def digest(self) -> str | None:
        """What the training picture depends on, for the bundle fingerprint; None without rows."""
        if not self.rows:
            return None
        return digest(self.rows)

    def summary(self) -> dict[str, Any]:
        """For ``bundle.json``: where the curves came from and their steps, or why there are none."""
        if not self.rows:
            return {"missing": self.missing or "no training metrics"}
        return {"source": self.source, "rows": len(self.rows), "first_step": int(self.rows[0]["step"]),
                "last_step": int(self.rows[-1]["step"])}


def read_training_curves(metrics_file: Path, up_to_step: int) -> TrainingCurves:
    """The rows of ``metrics_file`` with ``step <= up_to_step``; a missing file gives curves that say so.

    Lines that are not metrics (a line cut by a kill, another writer's text) are skipped with a warning
    naming the file: a picture is never a reason to refuse an export.
    """
    metrics_file = Path(metrics_file)
    try:
        text = metrics_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return TrainingCurves(source=str(metrics_file), missing=f"no training metrics file at {metrics_file}")
    except (OSError, UnicodeDecodeError) as exc:
        return TrainingCurves(source=str(metrics_file), missing=f"{metrics_file}: unreadable ({exc})")
    by_step: dict[int, dict[str, float]] = {}
    skipped = 0
    for line in text.splitlines():
        row = _metrics_row(line)
        if row is None:
            skipped += bool(line.strip())
        elif row["step"] <= up_to_step:
            by_step[int(row["step"])] = row
    if skipped:
        logger.warning("%s: skipped %d line(s) that are not metrics rows", metrics_file, skipped)
    if not by_step:
        return TrainingCurves(source=str(metrics_file),
                              missing=f"{metrics_file} has no metrics up to step {up_to_step}")
    return TrainingCurves(rows=[by_step[s] for s in sorted(by_step)], source=str(metrics_file))


def _metrics_row(line: str) -> dict[str, float] | None:
    try:
        record = json.loads(line)
        row = {"step": int(record["step"])}
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(record, dict):
        return None
    row |= {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    return row


def training_figure(curves: TrainingCurves, title: str = ""):
    """Loss and validation loss, learning rate, tokens/s and gradient norm over steps (2 × 2 panels)."""
    figure = _figure((10, 7))
    axes = figure.subplots(2, 2)
    for axis, (name, ylabel, keys) in zip(axes.flat, _PANELS, strict=True):
        drawn = False
        for key in keys:
            points = [(row["step"], row[key]) for row in curves.rows if key in row]
            if points:
                steps, values = zip(*points, strict=True)
                marker = "o" if key == "val_loss" or len(points) <= 20 else None
                axis.plot(steps, values, marker=marker, markersize=4, label=_LABELS.get(key, key))
                drawn = True
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        if not drawn:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes, color="#888888")
        elif len(keys) > 1:
            axis.legend()
    if not curves.rows:
        figure.text(0.5, 0.5, f"No training curves: {curves.missing}", ha="center", va="center", wrap=True)
    figure.suptitle(title or "training")
    figure.tight_layout()
    return figure


def latency_figure(latency: dict[str, Any]):
    """p50 latency of one forward pass by form (bars) and batch (groups), p95 as the upper whisker."""
    forms = list(latency["forms"])
    batches = list(latency["forms"][forms[0]])
    figure = _figure((min(12.0, max(6.0, 1.2 * len(batches) * len(forms) + 2)), 4))
    axis = figure.subplots()
    width = 0.8 / len(forms)
    for i, form in enumerate(forms):
        rows = latency["forms"][form]
        p50 = [rows[b]["p50"] for b in batches]
        above = [max(rows[b]["p95"] - rows[b]["p50"], 0.0) for b in batches]
        positions = [j + (i - (len(forms) - 1) / 2) * width for j in range(len(batches))]
        axis.bar(positions, p50, width, yerr=[[0.0] * len(batches), above], capsize=3, label=form)
    axis.set_xticks(range(len(batches)), [b.replace("_", " ") for b in batches])
    axis.set_ylabel("ms (p50, whisker p95)")
    axis.set_title(f"latency of one forward pass, sequence {latency['seq_length']}")
    axis.grid(axis="y", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure


def save_png(figure, path: Path) -> None:
    """Write ``figure`` as a PNG with fixed resolution and no metadata that changes between runs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=DPI, metadata={"Software": None})


def write_plots(folder: Path, curves: TrainingCurves, latency: dict[str, Any], title: str = "") -> dict[str, str]:
    """Save the latency picture, and the training picture when there are rows, in ``folder``; return their paths
    relative to ``folder`` by name (``training``, ``latency``)."""
    written = {"latency": LATENCY_PLOT}
    save_png(latency_figure(latency), Path(folder) / LATENCY_PLOT)
    if curves.rows:
        save_png(training_figure(curves, title), Path(folder) / TRAINING_PLOT)
        written["training"] = TRAINING_PLOT
    return dict(sorted(written.items()))


def _figure(size: tuple[float, float]):
    from matplotlib.figure import Figure  # Agg canvas; not registered with pyplot, so nothing to close

    return Figure(figsize=size, dpi=DPI)
