"""Watching a training run: VisualDL logs from rank 0, and MLflow's system metrics on the run (``training.monitoring``).

- :class:`VisualDLLog`: rank 0 of the worker writes each reported step's loss, validation loss, learning rate,
  tokens/s, gradient norm, MFU and memory as VisualDL scalars into ``<training logs>/visualdl`` (beside
  ``metrics.jsonl``); ``train-deploy visualdl`` (``make visualdl``) serves them on 127.0.0.1.
- :func:`monitored_training`: around the launch, the training node samples CPU, memory, disk and network (GPU
  where present) into the MLflow run every ``system_metrics_interval`` seconds (``system/*`` metrics, MLflow's
  ``SystemMetricsMonitor``), and afterwards logs the VisualDL folder to the run (artifact ``visualdl/``) and tags
  the run with where it is on disk (``visualdl.logdir``).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

logger = logging.getLogger(__name__)

VISUALDL_DIR = "visualdl"
DEFAULT_LOGS = "data/08_reporting/training_logs"
"""The catalog's ``training_logs`` folder (``conf/base/catalog.yml``), what ``make visualdl`` serves."""
"""The VisualDL log folder inside a run's training log folder."""
SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr",
           "tokens_per_second": "train/tokens_per_second", "grad_norm": "train/grad_norm", "mfu": "train/mfu",
           "memory_mb": "train/memory_mb"}
"""The worker's metric names (``metrics.jsonl``) and the VisualDL tags they are written under."""


# A pydantic dataclass rather than a BaseModel: TrainingConfig is one (a pydantic dataclass), and the project writes
# it with dataclasses.asdict / handoffs.to_json (run.json, each checkpoint's state.json), which a nested BaseModel
# would break; the validation (extra keys refused, frozen, defaults and ranges in the type) is pydantic v2's either way.
@dataclass(config=ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True), kw_only=True)
class MonitoringConfig:
    """``training.monitoring``: what watches the run besides the log and ``metrics.jsonl``."""

    visualdl: bool = True
    """Rank 0 writes VisualDL scalars to `<training logs>/visualdl`; the MLflow run gets the folder (`visualdl/`)."""
    system_metrics: bool = True
    """MLflow system metrics (`system/cpu_utilization_percentage`, memory, disk, network, GPU) on the training run."""
    system_metrics_interval: float = Field(10.0, gt=0)
    """Seconds between two system metric samples (MLflow's default: 10)."""


class VisualDLLog:
    """The VisualDL scalars of :data:`SCALARS`, written under ``folder`` by rank 0 (a no-op when not ``enabled``)."""

    def __init__(self, folder: Path, enabled: bool) -> None:
        self._writer: Any = None
        if enabled:
            from visualdl import LogWriter

            self._writer = LogWriter(logdir=str(folder), file_name="vdlrecords.train.log")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for name, tag in SCALARS.items():
            if metrics.get(name) is not None:
                self._writer.add_scalar(tag=tag, step=step, value=float(metrics[name]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@contextlib.contextmanager
def monitored_training(config: MonitoringConfig, run_id: str | None, logs: Path) -> Iterator[None]:
    """System metrics into the MLflow run ``run_id`` while the block runs (when configured and there is a run);
    afterwards the VisualDL folder under ``logs`` as its ``visualdl/`` artifacts and ``visualdl.logdir`` tag."""
    monitor = None
    if run_id and config.system_metrics:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=config.system_metrics_interval)
        monitor.start()
    try:
        yield
    finally:
        if monitor is not None:
            monitor.finish()
        board = Path(logs) / VISUALDL_DIR
        if run_id and config.visualdl and board.is_dir():
            _attach_visualdl(run_id, board)


def _attach_visualdl(run_id: str, board: Path) -> None:
    """The VisualDL folder as the run's ``visualdl/`` artifacts and its path as a tag; an unreachable tracking
    server costs a warning, not the finished training."""
    import mlflow

    try:
        client = mlflow.MlflowClient()
        client.set_tag(run_id, "visualdl.logdir", str(board.resolve()))
        client.log_artifacts(run_id, str(board), VISUALDL_DIR)
    except Exception as exc:  # noqa: BLE001 - any client or transport error; the logs stay on disk
        logger.warning("VisualDL logs not sent to the MLflow run (%s); they stay in %s", type(exc).__name__, board)


def visualdl_command(logdir: Path, port: int) -> list[str]:
    """VisualDL's own server over ``logdir`` (every run's ``visualdl/`` folder below it), on 127.0.0.1 only."""
    return [str(Path(sys.executable).with_name("visualdl")), "--logdir", str(logdir), "--host", "127.0.0.1",
            "--port", str(port)]


@click.command(name="visualdl", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--logdir", type=click.Path(file_okay=False, path_type=Path), default=Path(DEFAULT_LOGS),
              show_default=True, help="The training log folder; each run's visualdl/ below it is a VisualDL run.")
@click.option("--port", type=click.IntRange(1, 65535), default=8040, show_default=True)
def serve_visualdl(logdir: Path, port: int) -> None:
    """Serve the training runs' VisualDL logs on http://127.0.0.1:PORT (Ctrl-C stops it)."""
    if not logdir.is_dir():
        raise click.UsageError("--logdir: not a folder; train first (make run), or name the training log folder")
    click.echo(f"VisualDL: http://127.0.0.1:{port}/ (logs under {logdir})")
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(subprocess.call(visualdl_command(logdir, port)))


if __name__ == "__main__":
    serve_visualdl()
