"""GPU check of the export stage's server path: Paddle Inference on GPU, plain and TensorRT fp16.

    .venv/bin/python benchmarks/gpu_export_check.py            # needs paddlepaddle-gpu and a visible GPU

Builds the `small` preset (random weights), exports it with the export stage's functions, then compares
the logits of Paddle Inference on GPU (fp32) and with TensorRT fp16 against the model in eager mode on
the same GPU, and times a forward pass at batch 1 and 8, sequence 128. Prints one row per engine.
Run by `benchmarks/gpu_check.sh` after the training check.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_export import WORK, build  # noqa: E402


def main() -> None:
    import paddle

    from train_deploy.evaluation import load_model
    from train_deploy.export.checks import latency_report
    from train_deploy.export.config import LatencyConfig, ServerConfig
    from train_deploy.export.graph import eager_logits, load_inference_model, save_server_model
    from train_deploy.export.runtime import PaddleInferenceBackend

    assert paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0, "no CUDA device"
    shutil.rmtree(WORK, ignore_errors=True)
    try:
        paddle.set_device("cpu")
        checkpoint = build("small", 8000)
        prefix = save_server_model(load_inference_model(checkpoint), WORK / "server")
        paddle.set_device("gpu")
        trained = load_model(checkpoint)
        rng = np.random.default_rng(0)
        ids = rng.integers(3, 8000, size=(4, 128), dtype=np.int64)
        reference = eager_logits(trained, ids)
        engines = {"eager (GPU)": lambda i, m: eager_logits(trained, i),
                   "Paddle Inference GPU fp32": PaddleInferenceBackend(prefix, ServerConfig(device="gpu"), 256),
                   "Paddle Inference TensorRT fp16": PaddleInferenceBackend(
                       prefix, ServerConfig(device="gpu", tensorrt=True, tensorrt_precision="fp16"), 256)}
        out = sys.stdout.write
        out("| engine | max abs logit diff vs eager | batch 1 p50 ms | batch 8 p50 ms |\n|---|---:|---:|---:|\n")
        latency = latency_report(engines, 8000, 256, LatencyConfig(batch_sizes=[1, 8], warmup=5, repeats=30))
        for name, run in engines.items():
            diff = float(np.abs(run(ids, np.ones_like(ids)) - reference).max())
            timing = [latency["forms"][name][f"batch_{b}"]["p50"] for b in (1, 8)]
            out(f"| {name} | {diff:.2e} | {timing[0]:.2f} | {timing[1]:.2f} |\n")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
