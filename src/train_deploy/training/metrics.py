"""What the training workers measure and where it goes: rank 0 writes ``metrics.jsonl`` and the log; the
training node's process, which follows them, sends the lines to the Kedro run's MLflow run
(:class:`MetricsForwarder`), so the workers need no MLflow credentials."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train_deploy.redaction import redact_uri

logger = logging.getLogger("train_deploy.training.worker")  # the worker's log, which the launcher follows
node_logger = logging.getLogger(__name__)

MLFLOW_PREFIX = "train."
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call


class MetricsLog:
    """Per-step metrics to ``metrics.jsonl`` and the log; a no-op unless enabled (rank 0)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.enabled, self.path = enabled, Path(path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or not metrics:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        logger.info("step %d  %s", step, "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


class MetricsForwarder:
    """Send the lines rank 0 appends to ``metrics.jsonl`` to an MLflow run as ``train.<name>`` at their step.

    A thread of the node's process sends the complete lines past an offset every ``interval`` seconds, so
    each line goes once, and the lines already in the file when it starts (earlier runs) never. A failed
    send (server unreachable) keeps its lines for the next try and warns once; closing sends what is left,
    trying every ``interval`` seconds for at most ``final_timeout`` seconds (a server restarting as training
    ends still gets every line). Training never waits on MLflow, and every line stays in the file.
    """

    def __init__(self, path: Path, run_id: str, client: Any = None, interval: float = 1.0,
                 final_timeout: float = 30.0) -> None:
        if client is None:
            from mlflow import MlflowClient

            client = MlflowClient()  # the tracking URI this process uses (kedro-mlflow's)
        self.path, self.run_id, self.client = Path(path), run_id, client
        self.interval, self.final_timeout = interval, final_timeout
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.warned = False
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-to-mlflow", daemon=True)

    def __enter__(self) -> MetricsForwarder:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closing.set()
        self._thread.join(self.final_timeout)
        unsent = len(self._lines())
        if unsent:
            node_logger.warning("%d training metric line(s) were not sent to MLflow run %s; they are in %s",
                                unsent, self.run_id, self.path)

    def send(self) -> bool:
        """Log every complete line past the offset, in batches; stop at the first failure and keep the rest.
        Return whether every complete line is sent."""
        for end, metrics in self._batches():
            try:
                if metrics:
                    self.client.log_batch(self.run_id, metrics=metrics)
            except Exception as exc:  # whatever MLflow raises, it must never fail training
                if not self.warned:
                    self.warned = True
                    reason = redact_uri(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
                    node_logger.warning("Training metrics could not be sent to MLflow (%s); they stay in %s "
                                        "and are sent when it answers", reason[:300], self.path)
                return False
            self.offset = end
        return True

    def _run(self) -> None:
        while not self._closing.wait(self.interval):
            self.send()
        # Closing: one failed try is not the end (MLflow's client may fail fast, e.g. with retries turned off).
        deadline = time.monotonic() + self.final_timeout
        while not self.send() and time.monotonic() + self.interval < deadline:
            time.sleep(self.interval)

    def _lines(self) -> list[tuple[int, bytes]]:
        """The complete lines past the offset, each with the offset just after it."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        lines, end = [], self.offset
        for line in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]:
            end += len(line) + 1
            lines.append((end, line))
        return lines

    def _batches(self):
        """``(offset after the batch, metrics)`` of at most ``_MAX_METRICS_PER_BATCH`` metrics each."""
        from mlflow.entities import Metric

        batch: list = []
        end = self.offset
        for line_end, line in self._lines():
            now = int(time.time() * 1000)
            try:
                record = json.loads(line)
                step = int(record.pop("step"))
                metrics = [Metric(MLFLOW_PREFIX + k, float(v), now, step) for k, v in record.items()
                           if isinstance(v, int | float)]
            except (ValueError, KeyError, TypeError, AttributeError):
                metrics = []  # not a metrics line: skip it
            if batch and len(batch) + len(metrics) > _MAX_METRICS_PER_BATCH:
                yield end, batch
                batch = []
            batch, end = batch + metrics, line_end
        if end != self.offset:
            yield end, batch


@dataclass(slots=True)
class Throughput:
    """Tokens per second, the model FLOP/s they make and the model FLOPs utilisation over the steps since the last
    report, against the peak of all devices together (configured, or :func:`calibrated_peak_flops`)."""

    flops_per_token: float
    peak_flops: float
    """Of all devices together."""
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    warned: bool = False

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> dict[str, float]:
        """``tokens_per_second``, ``mfu``, ``achieved_gflops`` and ``peak_gflops`` since the last report, and start a
        new window. An MFU above 1 cannot be: it warns once that the peak is too low (the two figures cross-check)."""
        tokens_per_second = self.tokens / (time.perf_counter() - self.started)
        self.started, self.tokens = time.perf_counter(), 0
        achieved = tokens_per_second * self.flops_per_token
        mfu = achieved / self.peak_flops
        if mfu > 1 and not self.warned:
            self.warned = True
            logger.warning("MFU %.2f: the model ran at %.1f GFLOP/s, above the peak of %.1f GFLOP/s it is divided by; "
                           "set training.device.peak_tflops to the devices' peak", mfu, achieved / 1e9,
                           self.peak_flops / 1e9)
        return {"tokens_per_second": tokens_per_second, "mfu": mfu, "achieved_gflops": achieved / 1e9,
                "peak_gflops": self.peak_flops / 1e9}


def grad_norm(model) -> float:
    """The global L2 norm of the gradients (a collective over sharded gradients)."""
    import paddle

    total = None
    for p in model.parameters():
        if p.grad is None:
            continue
        square = paddle.sum(paddle.square(p.grad.astype("float32")))
        total = square if total is None else total + square
    return float(paddle.sqrt(total)) if total is not None else 0.0


CALIBRATION_SHAPES = ((512, 512, 512), (1024, 1024, 1024))
"""Float32 matrix products (m, k, n) timed for the peak; the best rate counts."""
CALIBRATION_SECONDS = 0.25
"""How long each shape is timed (CPU seconds on CPU)."""


def calibrated_peak_flops(device: str = "cpu", threads: int = 1) -> float:
    """The peak FLOP/s of this process when none is configured: its best float32 matrix-product rate over
    :data:`CALIBRATION_SHAPES`. A training worker measures it itself, so with the BLAS kernels and threads it
    trains with (``MKL_DEBUG_CPU_TYPE``, ``OMP_NUM_THREADS``: ``training/launch.py``). On CPU the rate is per CPU
    second of the process, times ``threads``: other processes on the same cores slow it in wall time (0.3 s of
    wall time under load measured a third of the peak, and MFU rose to 0.6–0.9), not in CPU time."""
    import paddle

    clock = time.process_time if device == "cpu" else time.perf_counter
    best = 0.0
    for m, k, n in CALIBRATION_SHAPES:
        a, b = paddle.randn([m, k]), paddle.randn([k, n])
        paddle.matmul(a, b).numpy()  # the first product allocates and picks its kernel
        started, runs = clock(), 0
        while clock() - started < CALIBRATION_SECONDS:
            paddle.matmul(a, b).numpy()
            runs += 1
        best = max(best, 2 * m * k * n * runs / (clock() - started))
    return best * (threads if device == "cpu" else 1)


def blas_threads() -> int:
    """The BLAS threads of this process: ``MKL_NUM_THREADS``, else ``OMP_NUM_THREADS`` (the training launcher sets
    both for its workers), else the CPU count."""
    for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def memory_mb(device: str) -> float:
    """Peak GPU memory allocated by this process, or its resident memory on CPU."""
    if device == "gpu":
        import paddle

        return paddle.device.cuda.max_memory_allocated() / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20
