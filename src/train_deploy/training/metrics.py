"""What the training workers measure and where rank 0 reports it: ``metrics.jsonl``, the log and MLflow."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from train_deploy.handoffs import MlflowTarget

logger = logging.getLogger("train_deploy.training.worker")  # the worker's log, which the launcher follows


class MetricsLog:
    """Per-step metrics to ``metrics.jsonl``, the log and the Kedro run's MLflow run; a no-op unless enabled."""

    def __init__(self, path: Path, mlflow: MlflowTarget | None, enabled: bool) -> None:
        self.enabled, self.path = enabled, Path(path)
        self.client = self.run_id = None
        if enabled and mlflow is not None and mlflow.run_id:
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(tracking_uri=mlflow.tracking_uri), mlflow.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or not metrics:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        logger.info("step %d  %s", step, "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        if self.client is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(f"train.{k}", float(v), now, step)
                                                        for k, v in metrics.items()])


@dataclass(slots=True)
class Throughput:
    """Tokens per second and model FLOPs utilisation over the steps since the last report."""

    flops_per_token: float
    peak_flops: float
    """Of all devices together."""
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> dict[str, float]:
        """``tokens_per_second`` and ``mfu`` since the last report, and start a new window."""
        tokens_per_second = self.tokens / (time.perf_counter() - self.started)
        self.started, self.tokens = time.perf_counter(), 0
        mfu = tokens_per_second * self.flops_per_token / self.peak_flops
        return {"tokens_per_second": tokens_per_second, "mfu": mfu}


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


def calibrated_peak_flops() -> float:
    """Measured float32 matmul FLOP/s of this process: the "peak" when none is configured."""
    import paddle

    n = 512
    a, b = paddle.randn([n, n]), paddle.randn([n, n])
    paddle.matmul(a, b)
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < 0.3:
        paddle.matmul(a, b).numpy()
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - started)


def memory_mb(device: str) -> float:
    """Peak GPU memory allocated by this process, or its resident memory on CPU."""
    if device == "gpu":
        import paddle

        return paddle.device.cuda.max_memory_allocated() / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20
