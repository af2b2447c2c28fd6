"""GPU check of the export stage's server path: every engine built, judged and timed on its own.

    .venv/bin/python benchmarks/gpu_export_check.py                   # paddlepaddle-gpu and a visible GPU
    .venv/bin/python benchmarks/gpu_export_check.py --tensorrt-fp32   # also a TensorRT fp32 engine

Builds the `small` preset (random weights: parity and latency do not depend on training) as a checkpoint
and saves its server graph with the export stage's own functions. The reference is that checkpoint in
Paddle eager mode on the GPU in float32 with TF32 off (``hardware.disable_tf32``). Then, one engine at a
time: the eager reference itself, Paddle Inference GPU fp32 (TF32 off), Paddle Inference GPU fp16 (the
mixed-precision pass), and TensorRT fp16 (and fp32 on request) through ``paddle.tensorrt`` when the wheel
has it. Each is built, judged with the export stage's per-precision rule (``checks.parity_report``: fp32
within ``max_logit_diff``; fp16 and TensorRT by their perplexity increase over the reference, their
|logit diff| only reported) on 4 windows of 128 tokens, and timed at batch 1 and 8, sequence 128, inside
its own ``try``: an engine that fails prints its row with the error and the others' rows still appear.
Exits 1 when a present engine failed. About a minute on one H200 (most of it TensorRT's engine build).
Run by ``benchmarks/gpu_check.sh`` after the training check.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_export import WORK, build  # noqa: E402

VOCAB, CONTEXT, SEQ = 8000, 256, 128
HEADER = ("| engine | precision | parity | max abs logit diff | perplexity vs reference | batch 1 p50 ms | "
          "batch 8 p50 ms |\n|---|---|---|---:|---:|---:|---:|\n")


def engine_row(name: str, precision: str, build_engine: Callable[[], Callable], reference: Callable,
               windows: np.ndarray, vocab: int, parity=None, latency=None) -> tuple[bool, str]:
    """Build one engine, judge its parity against ``reference`` by the rule of ``precision``, time it.

    Returns (passed, table row). Whatever fails, building, running or timing, becomes this row's error
    (the exception's first line) instead of numbers: the caller's next engine still runs.
    """
    from train_deploy.export.checks import latency_report, parity_report
    from train_deploy.export.config import LatencyConfig, ParityConfig

    parity = parity or ParityConfig()
    latency = latency or LatencyConfig(batch_sizes=[1, 8], seq_length=SEQ, warmup=5, repeats=30, rounds=1)
    try:
        run = build_engine()
        report = parity_report(windows, reference, {name: run}, vocab, parity, precisions={name: precision})
        timing = latency_report({name: run}, vocab, 10**9, latency)["forms"][name]
    except Exception as exc:  # noqa: BLE001 - the row reports any engine's failure; the next engine runs
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        return False, f"| {name} | {precision} | error: {type(exc).__name__}: {reason} | | | | |\n"
    diff = report["max_abs_logit_diff"][name]
    change = report["perplexity"][name] / report["perplexity"]["trained"] - 1
    verdict = "pass" if report["passed"] else "FAIL: " + "; ".join(report["failures"])
    if report["warnings"]:
        verdict += " (" + "; ".join(report["warnings"]) + ")"
    cells = " | ".join(f"{timing[f'batch_{b}']['p50']:.2f}" if f"batch_{b}" in timing else "" for b in (1, 8))
    return report["passed"], f"| {name} | {precision} | {verdict} | {diff:.2e} | {change:+.3%} | {cells} |\n"


def _has_tensorrt() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("paddle.tensorrt", "tensorrt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensorrt-fp32", action="store_true", help="also build a TensorRT fp32 engine")
    args = parser.parse_args()

    import paddle

    from train_deploy.export.backends import PaddleInferenceBackend
    from train_deploy.export.config import ServerConfig
    from train_deploy.export.graph import eager_logits, load_inference_model, save_server_model
    from train_deploy.export.hardware import disable_tf32
    from train_deploy.training.evaluation import load_model

    assert paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0, "no CUDA device"
    shutil.rmtree(WORK, ignore_errors=True)
    try:
        paddle.set_device("cpu")
        checkpoint = build("small", VOCAB)
        prefix = save_server_model(load_inference_model(checkpoint), WORK / "server")
        paddle.set_device("gpu")
        disable_tf32()
        trained = load_model(checkpoint)
        reference = lambda ids, mask: eager_logits(trained, ids)  # noqa: E731
        windows = np.random.default_rng(0).integers(3, VOCAB, size=(4, SEQ + 1), dtype=np.int64)

        def server(**settings) -> Callable[[], Callable]:
            return lambda: PaddleInferenceBackend(prefix, ServerConfig(device="gpu", **settings), CONTEXT)

        engines = [("eager GPU (reference)", "fp32", lambda: reference),
                   ("Paddle Inference GPU", "fp32", server()),
                   ("Paddle Inference GPU", "fp16", server(precision="fp16")),
                   ("TensorRT", "tensorrt_fp16", server(tensorrt=True, tensorrt_precision="fp16"))]
        if args.tensorrt_fp32:
            engines.append(("TensorRT", "tensorrt_fp32", server(tensorrt=True, tensorrt_precision="fp32")))
        sys.stdout.write(f"\n{paddle.device.cuda.get_device_name()}, preset small, vocabulary {VOCAB}, "
                         f"sequence {SEQ}; reference: eager fp32, TF32 off\n\n{HEADER}")
        failed = []
        for name, precision, make in engines:
            if precision.startswith("tensorrt") and not _has_tensorrt():
                sys.stdout.write(f"| {name} | {precision} | not present: no paddle.tensorrt or tensorrt | | | | |\n")
                continue
            passed, row = engine_row(name, precision, make, reference, windows, VOCAB)
            sys.stdout.write(row)
            sys.stdout.flush()
            failed += [] if passed else [f"{name} {precision}"]
            paddle.device.cuda.empty_cache()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
