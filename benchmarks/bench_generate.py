"""Generation speed: full recomputation against the KV cache on each engine and server graph, in one run.

    .venv/bin/python benchmarks/bench_generate.py                   # the `small` preset, 2 threads
    .venv/bin/python benchmarks/bench_generate.py --preset tiny --threads 1 --new 8 16 --repeats 1
    .venv/bin/python benchmarks/bench_generate.py --no-full --new 32 224   # the graphs side by side, quicker

Builds a model of the preset (random weights: speed does not depend on training) with the default
tokenizer's vocabulary, writes it as a training checkpoint and exports its prefill and decode graphs with
the export stage's own functions. Then, with the same thread count for every engine, generates greedily
from random prompts of ``--prompt`` tokens, batch 1 and 8, for each number of new tokens (end of document
is never chosen, so every sequence runs to the end): (a) full recomputation of the window for every token
on Paddle Inference (the path before the cache), (b) Paddle Inference with the cache on the fused graph
(``server/``: Paddle's fused CPU kernels, which need AVX-512 on CPU), (p) the same on the portable graph
(``server_portable/``: what a CPU without AVX-512 runs, and what ONNX is converted from), (c) ONNX Runtime
fp32 with the cache, (d) ONNX Runtime int8 with the cache. Prints new tokens/s (median of ``--repeats``),
the time per new token at the most new tokens against the fewest, what the fused kernels buy against the
portable graph and what the portable graph costs against ONNX Runtime; then the same per second of the
process's CPU time, which other processes on a shared machine move less. Work files go under
benchmarks/.work/generate and are removed afterwards. On a CPU where the kernel probe fails, the fused forms
are left out.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

WORK = Path(__file__).resolve().parent / ".work" / "generate"
EOS = 2
FULL, PADDLE, PORTABLE, ONNX, INT8 = ("(a) full recompute, Paddle Inference fused", "(b) Paddle Inference fused, cache",
                                      "(p) Paddle Inference portable, cache", "(c) ONNX Runtime fp32, cache",
                                      "(d) ONNX Runtime int8, cache")


def build(preset: str, vocab: int) -> Path:
    """A checkpoint of the preset with random weights; return its folder."""
    import paddle

    from train_deploy.training.checkpoint import write_checkpoint
    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.model import build_model

    config = TrainingConfig.from_params({"model": {"preset": preset}})
    paddle.seed(0)
    model = build_model(config, vocab_size=vocab, eos_id=EOS)
    parameters = sum(int(p.size) for p in model.parameters())
    return write_checkpoint(WORK / "checkpoints", 1, dict(model.named_parameters()), {},
                            {"step": 1, "model_config": model.config.to_dict(), "parameters": parameters}, keep_last=1)


def _greedy(row: int, logits: np.ndarray) -> int:
    logits = logits.copy()
    logits[EOS] = -np.inf  # every sequence runs to max_new_tokens
    return int(np.argmax(logits))


def full_recompute(form, prompts: list[list[int]], new: int, context: int) -> int:
    """Greedy tokens by one full pass over each whole window per token; returns the tokens made."""
    ids = np.asarray(prompts, dtype=np.int64)
    for _ in range(new):
        window = ids[:, -context:]
        logits = form(window, np.ones_like(window))[:, -1]
        ids = np.concatenate([ids, np.asarray([[_greedy(0, row)] for row in logits])], axis=1)
    return len(prompts) * new


def cached(model, prompts: list[list[int]], new: int, context: int) -> int:
    return sum(1 for _ in model.stream_ids(prompts, new, _greedy))


Speeds = dict[tuple[str, int, int], float]


def measure(runs: dict, prompts_by_batch: dict[int, list[list[int]]], news: list[int], repeats: int,
            context: int) -> tuple[Speeds, Speeds]:
    """New tokens per second of wall time and per second of this process's CPU time (all its threads; less
    moved by other processes on a shared machine), medians of ``repeats``, per (form, batch, new tokens);
    forms interleaved in each round."""
    wall: dict[tuple[str, int, int], list[float]] = {}
    cpu: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(repeats):
        for batch, prompts in prompts_by_batch.items():
            for new in news:
                for name, (run, target) in runs.items():
                    time.sleep(0.25)  # let the previous engine's spinning threads stop
                    start, used = time.perf_counter(), time.process_time()
                    made = run(target, prompts, new, context)
                    wall.setdefault((name, batch, new), []).append(made / (time.perf_counter() - start))
                    cpu.setdefault((name, batch, new), []).append(made / (time.process_time() - used))
    return ({key: statistics.median(values) for key, values in wall.items()},
            {key: statistics.median(values) for key, values in cpu.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=4500, help="the default tokenizer's vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (the end-of-document id included)")
    parser.add_argument("--new", type=int, nargs="+", default=[32, 128, 224], help="new tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-full", action="store_true", help="leave out (a), full recomputation")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
    from train_deploy.export.config import ServerConfig
    from train_deploy.export.edge import INT8_FILE, ONNX_FILE, convert_to_onnx, quantize_int8
    from train_deploy.export.graph import DECODE_MODEL, load_inference_model, save_server_model
    from train_deploy.export.probe import fused_kernels
    from train_deploy.export.runtime import LanguageModel

    shutil.rmtree(WORK, ignore_errors=True)
    try:
        checkpoint = build(args.preset, args.vocab)
        model = load_inference_model(checkpoint)
        context = model.rope.shape[0]
        fused = fused_kernels().runs
        prefix = save_server_model(model, WORK / "server") if fused else None
        source = save_server_model(model, WORK / "server_portable", portable=True)  # also what ONNX is made from
        (WORK / "edge").mkdir()
        for graph in (source, source.with_name(DECODE_MODEL)):
            onnx_file = convert_to_onnx(graph, WORK / "edge" / ONNX_FILE.replace("model", graph.name, 1), opset=17)
            quantize_int8(onnx_file, WORK / "edge" / INT8_FILE.replace("model", graph.name, 1), per_channel=False)
        server = ServerConfig(cpu_threads=args.threads)

        def language_model(form) -> LanguageModel:
            return LanguageModel(form, None, context=context, eos_id=EOS)

        runs = {}
        if fused:
            paddle_form = PaddleInferenceBackend(prefix, server, context)
            runs |= ({} if args.no_full else {FULL: (full_recompute, paddle_form)}) | {
                PADDLE: (cached, language_model(paddle_form))}
        runs |= {PORTABLE: (cached, language_model(PaddleInferenceBackend(source, server, context))),
                 ONNX: (cached, language_model(OnnxRuntimeBackend(WORK / "edge" / ONNX_FILE, args.threads))),
                 INT8: (cached, language_model(OnnxRuntimeBackend(WORK / "edge" / INT8_FILE, args.threads)))}
        rng = np.random.default_rng(0)
        prompts = {batch: [[EOS, *rng.integers(3, args.vocab, args.prompt - 1).tolist()] for _ in range(batch)]
                   for batch in args.batches}
        for run, target in runs.values():  # warm-up: first runs allocate and pick kernels
            run(target, prompts[args.batches[0]], 4, context)
        wall, cpu = measure(runs, prompts, args.new, args.repeats, context)
        report(args, wall, list(runs), "new tokens/s over all sequences")
        report(args, cpu, list(runs), "new tokens per CPU second of this process")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def report(args, speed: Speeds, forms: list[str], unit: str) -> None:
    out = sys.stdout.write
    low, high = min(args.new), max(args.new)
    out(f"\npreset {args.preset}, vocabulary {args.vocab}, prompt {args.prompt} tokens, {args.threads} threads, "
        f"greedy, median of {args.repeats} ({unit})\n\n")
    out("| form | batch | " + " | ".join(f"{n} new" for n in args.new) + f" | ms/token {high} ÷ {low} |\n")
    out("|---|---:|" + "---:|" * len(args.new) + "---:|\n")
    for batch in args.batches:
        for name in forms:
            cells = " | ".join(f"{speed[name, batch, n]:.0f}" for n in args.new)
            out(f"| {name} | {batch} | {cells} | {speed[name, batch, low] / speed[name, batch, high]:.2f} |\n")
    middle = sorted(args.new)[len(args.new) // 2]
    first = args.batches[0]
    if FULL in forms:
        gain = speed[PADDLE, first, middle] / speed[FULL, first, middle]
        out(f"\n(b) ÷ (a) at {middle} new tokens, batch {first}: {gain:.1f}× (target ≥ 10×)\n")
    for batch in args.batches:
        for new in args.new:
            line = f"batch {batch}, {new} new tokens:"
            if PADDLE in forms:
                line += (f" fused ÷ portable {speed[PADDLE, batch, new] / speed[PORTABLE, batch, new]:.2f}×,"
                         f" fused ÷ ONNX fp32 {speed[PADDLE, batch, new] / speed[ONNX, batch, new]:.2f}×,")
            out(f"{line} ONNX fp32 ÷ portable {speed[ONNX, batch, new] / speed[PORTABLE, batch, new]:.2f}×\n")


if __name__ == "__main__":
    main()
