"""Latency and size of the exported forms against the trained model in Paddle eager mode, in one run.

    .venv/bin/python benchmarks/bench_export.py                     # the `small` preset, 2 threads
    .venv/bin/python benchmarks/bench_export.py --preset tiny --threads 1

Builds a model of the preset (random weights: latency and size do not depend on training) with the
default tokenizer's vocabulary, writes it as a training checkpoint, and exports it with the export
stage's own functions. Then, with the same thread count for every engine, times one forward pass
(full logits) at sequence 128 for batch 1 and 8: (a) Paddle eager (the training model,
``LlamaForCausalLMNet``), (b) Paddle Inference, (c) ONNX Runtime fp32, (d) ONNX Runtime int8. Prints
p50/p95, speed-ups over (a), files' sizes and the int8/fp32 size ratio. Work files go under
benchmarks/.work/export and are removed afterwards.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

WORK = Path(__file__).resolve().parent / ".work" / "export"


def build(preset: str, vocab: int) -> Path:
    """A checkpoint of the preset with random weights; return its folder."""
    import paddle

    from train_deploy.training.checkpoint import write_checkpoint
    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.model import build_model

    config = TrainingConfig.from_params({"model": {"preset": preset}})
    paddle.seed(0)
    model = build_model(config, vocab_size=vocab, eos_id=2)
    parameters = sum(int(p.size) for p in model.parameters())
    return write_checkpoint(WORK / "checkpoints", 1, dict(model.named_parameters()), {},
                            {"step": 1, "model_config": model.config.to_dict(), "parameters": parameters}, keep_last=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=8000, help="the default tokenizer's vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the forms")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import paddle

    from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
    from train_deploy.export.checks import latency_report
    from train_deploy.export.config import LatencyConfig, ServerConfig
    from train_deploy.export.edge import INT8_FILE, ONNX_FILE, convert_to_onnx, quantize_int8
    from train_deploy.export.graph import eager_logits, load_inference_model, save_server_model
    from train_deploy.export.probe import fused_kernels
    from train_deploy.training.evaluation import load_model

    shutil.rmtree(WORK, ignore_errors=True)
    try:
        checkpoint = build(args.preset, args.vocab)
        model = load_inference_model(checkpoint)
        # the fused kernels only where the probe says they run (Paddle 3.3.1's CPU fused_rms_norm needs AVX-512)
        prefix = save_server_model(model, WORK / "server", portable=not fused_kernels("cpu").runs)
        source = save_server_model(model, WORK / "onnx_source", portable=True)  # the graph ONNX is made from
        (WORK / "edge").mkdir()
        onnx_file = convert_to_onnx(source, WORK / "edge" / ONNX_FILE, opset=17)
        int8_file = quantize_int8(onnx_file, WORK / "edge" / INT8_FILE, per_channel=False)

        paddle.base.core.set_num_threads(args.threads)
        trained = load_model(checkpoint)
        forms = {
            "(a) Paddle eager": lambda ids, mask: eager_logits(trained, ids),
            "(b) Paddle Inference": PaddleInferenceBackend(prefix, ServerConfig(cpu_threads=args.threads)),
            "(c) ONNX Runtime fp32": OnnxRuntimeBackend(onnx_file, args.threads),
            "(d) ONNX Runtime int8": OnnxRuntimeBackend(int8_file, args.threads),
        }
        timing = LatencyConfig(batch_sizes=[1, 8], seq_length=args.seq, warmup=3, repeats=args.repeats,
                               rounds=args.rounds)
        latency = latency_report(forms, args.vocab, 10**9, timing)
        sizes = {"(a) Paddle eager": checkpoint / "model.safetensors", "(b) Paddle Inference": prefix.with_suffix(
            ".pdiparams"), "(c) ONNX Runtime fp32": onnx_file, "(d) ONNX Runtime int8": int8_file}
        report(args, latency, {name: path.stat().st_size for name, path in sizes.items()})
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def report(args, latency: dict, sizes: dict[str, int]) -> None:
    out = sys.stdout.write
    out(f"\npreset {args.preset}, vocabulary {args.vocab}, sequence {latency['seq_length']}, {args.threads} threads, "
        f"{args.repeats} timed calls each (ms)\n\n")
    out("| form | batch 1 p50 | batch 1 p95 | batch 8 p50 | batch 8 p95 | speed-up b1 | speed-up b8 | file MB |\n")
    out("|---|---:|---:|---:|---:|---:|---:|---:|\n")
    base = latency["forms"]["(a) Paddle eager"]
    for name, rows in latency["forms"].items():
        b1, b8 = rows["batch_1"], rows["batch_8"]
        out(f"| {name} | {b1['p50']:.1f} | {b1['p95']:.1f} | {b8['p50']:.1f} | {b8['p95']:.1f} | "
            f"{base['batch_1']['p50'] / b1['p50']:.2f}× | {base['batch_8']['p50'] / b8['p50']:.2f}× | "
            f"{sizes[name] / 1e6:.1f} |\n")
    forms = latency["forms"]
    out(f"\n(b) vs (a): {base['batch_1']['p50'] / forms['(b) Paddle Inference']['batch_1']['p50']:.2f}× at batch 1, "
        f"{base['batch_8']['p50'] / forms['(b) Paddle Inference']['batch_8']['p50']:.2f}× at batch 8 (target ≥ 2×)\n")
    out(f"(d) size / (c) size: {sizes['(d) ONNX Runtime int8'] / sizes['(c) ONNX Runtime fp32']:.2f} "
        "(target ≤ 0.35)\n")


if __name__ == "__main__":
    main()
