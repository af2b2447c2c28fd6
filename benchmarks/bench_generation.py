"""Cost per generated token as the output grows, per engine: ms/token at 32, 224 and the context's full length.

    .venv/bin/python benchmarks/bench_generation.py                    # the `small` preset (the default bundle's)
    .venv/bin/python benchmarks/bench_generation.py --threads 1 --repeats 5

A model of the preset with random weights (speed does not depend on training), exported with the export stage's
own functions (``bench_generate.py``'s set-up), generates greedily from one prompt of ``--prompt`` tokens, ids
only (no detokenization), through ``LanguageModel.stream_ids`` on every engine this CPU runs; ONNX Runtime with
the in-place decode graph the server runs (``inplace.py``) and with the converted graph's growing cache. A flat cost
per token shows as a ratio near 1 in the last column (issue 38's goal: 224 tokens within 1.3x of 32).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time

import bench_generate
import numpy as np
from bench_generate import EOS, build

WORK = bench_generate.WORK.with_name("generation")
bench_generate.WORK = WORK  # its build() writes the checkpoint here, apart from a bench_generate run


def _greedy(row: int, logits: np.ndarray) -> int:
    logits = logits.copy()
    logits[EOS] = -np.inf  # every sequence runs to the number of new tokens asked for
    return int(np.argmax(logits))


def engines(args, context: int) -> dict:
    """The LanguageModel of each engine this CPU runs, on the preset's random model."""
    from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
    from train_deploy.export.config import ServerConfig
    from train_deploy.export.edge import INT8_FILE, ONNX_FILE, convert_to_onnx, quantize_int8
    from train_deploy.export.graph import DECODE_MODEL, load_inference_model, save_server_model
    from train_deploy.export.inplace import INPLACE_DECODE, save_inplace_decode
    from train_deploy.export.probe import fused_kernels
    from train_deploy.export.runtime import LanguageModel

    model = load_inference_model(build(args.preset, args.vocab))
    source = save_server_model(model, WORK / "server_portable", portable=True)
    (WORK / "edge").mkdir()
    inplace = save_inplace_decode(model, WORK / "edge" / ONNX_FILE.replace("model", INPLACE_DECODE, 1))
    quantize_int8(inplace, WORK / "edge" / INT8_FILE.replace("model", INPLACE_DECODE, 1), per_channel=False)
    for graph in (source, source.with_name(DECODE_MODEL)):
        onnx_file = convert_to_onnx(graph, WORK / "edge" / ONNX_FILE.replace("model", graph.name, 1), opset=17)
        quantize_int8(onnx_file, WORK / "edge" / INT8_FILE.replace("model", graph.name, 1), per_channel=False)
    server = ServerConfig(cpu_threads=args.threads)
    forms = {}
    if fused_kernels().runs:
        forms["paddle_inference"] = PaddleInferenceBackend(save_server_model(model, WORK / "server"), server, context)
    forms |= {"paddle_portable": PaddleInferenceBackend(source, server, context),
              "onnx_fp32": OnnxRuntimeBackend(WORK / "edge" / ONNX_FILE, args.threads),  # in place, as served
              "onnx_int8": OnnxRuntimeBackend(WORK / "edge" / INT8_FILE, args.threads),
              "onnx_fp32 growing cache": OnnxRuntimeBackend(WORK / "edge" / ONNX_FILE, args.threads, in_place=False),
              "onnx_int8 growing cache": OnnxRuntimeBackend(WORK / "edge" / INT8_FILE, args.threads, in_place=False)}
    return {name: LanguageModel(form, None, context=context, eos_id=EOS) for name, form in forms.items()}


def ms_per_token(model, prompt: list[int], new: int, repeats: int) -> float:
    """The best of ``repeats`` wall milliseconds per new token (prefill included, as a caller waits for it): on a
    shared machine, other processes only ever add to a run's time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        made = sum(1 for _ in model.stream_ids([prompt], new, _greedy))
        times.append((time.perf_counter() - start) * 1000 / made)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=4500, help="the default tokenizer's vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (the end-of-document id included)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from train_deploy.training.config import PRESETS

    context = PRESETS[args.preset]["max_position_embeddings"]
    news = [32, 224, context - args.prompt]
    shutil.rmtree(WORK, ignore_errors=True)
    try:
        models = engines(args, context)
        prompt = [EOS, *np.random.default_rng(0).integers(3, args.vocab, args.prompt - 1).tolist()]
        out = sys.stdout.write
        out(f"\npreset {args.preset} (context {context}), prompt {args.prompt} tokens, batch 1, {args.threads} "
            f"threads, greedy ids, best of {args.repeats}: ms per new token\n\n")
        out("| engine | " + " | ".join(f"{n} new" for n in news) + " | 224 ÷ 32 |\n|---|" + "---:|" * (len(news) + 1)
            + "\n")
        for name, model in models.items():
            sum(1 for _ in model.stream_ids([prompt], 4, _greedy))  # warm-up: first runs allocate, pick kernels
            cost = [ms_per_token(model, prompt, new, args.repeats) for new in news]
            out(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cost) + f" | {cost[1] / cost[0]:.2f} |\n")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
