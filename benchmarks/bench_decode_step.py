"""Where one batched decode step's time goes as the cache grows (issue 38), on ONNX Runtime fp32: the converted decode
graph that returns its cache grown, per operator type, beside the in-place graph (``inplace.py``).

    .venv/bin/python benchmarks/bench_decode_step.py
    .venv/bin/python benchmarks/bench_decode_step.py --batch 1 16 --cached 32 224 --threads 2

The server's iteration-level batching runs one decode step for every sequence in its batch: this measures that
step alone. A model of the preset with random weights (speed does not depend on training) is exported with the
export stage's own functions (``bench_generation.py``'s set-up); for each batch size and number of cached positions
the full graph prefills random ids, and the decode graph then runs ``--steps`` times at that position. It reports
the step's best mean wall time, the bytes of key/value cache the step reads and writes (the decode graph takes each
layer's cache and returns it with one more position: a new tensor each step), numpy's time to copy that many bytes
on this machine (the floor of that copy), and ONNX Runtime's own profile of the step: the share of each operator
type in the summed node time. The in-place graph's step runs on the same prefilled rows through the server's slot
cache (``kv_cache.SlotCache``), its lengths put back to ``cached`` before each call so every step is at that
position.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import bench_generate
import numpy as np
from bench_generate import EOS, build

WORK = bench_generate.WORK.with_name("decode_step")
bench_generate.WORK = WORK  # its build() writes the checkpoint here, apart from other benchmarks' runs


def export(preset: str, vocab: int) -> Path:
    """The preset's random model as the bundle's fp32 ONNX graphs (full, decode and in-place decode); the full
    graph's path."""
    from train_deploy.export.edge import ONNX_FILE, convert_to_onnx
    from train_deploy.export.graph import DECODE_MODEL, load_inference_model, save_server_model
    from train_deploy.export.inplace import INPLACE_DECODE, save_inplace_decode

    model = load_inference_model(build(preset, vocab))
    source = save_server_model(model, WORK / "server_portable", portable=True)
    (WORK / "edge").mkdir()
    save_inplace_decode(model, WORK / "edge" / ONNX_FILE.replace("model", INPLACE_DECODE, 1))
    for graph in (source, source.with_name(DECODE_MODEL)):
        convert_to_onnx(graph, WORK / "edge" / ONNX_FILE.replace("model", graph.name, 1), opset=17)
    return WORK / "edge" / ONNX_FILE


def step_inputs(backend, batch: int, cached: int, vocab: int) -> tuple:
    """The decode step's arguments (ids, mask, keys, values) after prefilling ``batch`` random sequences of
    ``cached`` tokens."""
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.full((batch, 1), EOS), rng.integers(3, vocab, (batch, cached - 1))], axis=1)
    step = backend.prefill(ids, np.ones_like(ids))
    return rng.integers(3, vocab, (batch, 1)), np.ones((batch, cached + 1), np.int64), step.keys, step.values


def in_place_step(backend, inputs: tuple, cached: int):
    """A call of one in-place decode step at ``cached`` positions for the rows of ``inputs`` (as the server's)."""
    from train_deploy.export.backends import Step

    ids, mask = inputs[0], np.ones((len(inputs[0]), cached), np.int64)
    cache = backend.new_cache()
    cache.join(mask, Step(np.zeros(0), inputs[2], inputs[3]), range(len(ids)))

    def step() -> None:
        cache._lengths[:len(ids)] = cached  # every timed step at the same position
        cache.decode(ids)

    return step


def best_mean_ms(run, steps: int, repeats: int = 3) -> float:
    """The best of ``repeats`` mean wall milliseconds of ``steps`` calls (other processes only ever add time)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        times.append((time.perf_counter() - start) * 1000 / steps)
    return min(times)


def operator_shares(decode: Path, feed: dict, threads: int, steps: int) -> dict[str, float]:
    """ONNX Runtime's profile of ``steps`` decode steps: each operator type's share of the summed node time."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server's sessions
    options.enable_profiling, options.profile_file_prefix = True, str(WORK / "profile")
    options.log_severity_level = 3
    session = ort.InferenceSession(str(decode), options, providers=["CPUExecutionProvider"])
    for _ in range(steps):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    totals = Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    whole = sum(totals.values()) or 1
    return {op: us / whole for op, us in totals.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=4500, help="the default tokenizer's vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--cached", type=int, nargs="+", default=[32, 224], help="positions in the cache")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from train_deploy.export.backends import OnnxRuntimeBackend, _cache_feed  # the backend's own feed
    from train_deploy.export.graph import DECODE_MODEL

    shutil.rmtree(WORK, ignore_errors=True)
    out = sys.stdout.write
    try:
        full = export(args.preset, args.vocab)
        decode = full.with_name(full.name.replace("model", DECODE_MODEL, 1))
        backend = OnnxRuntimeBackend(full, args.threads, in_place=False)  # the converted graph's growing cache
        in_place = OnnxRuntimeBackend(full, args.threads)
        out(f"\npreset {args.preset}, ONNX Runtime fp32, {args.threads} threads, mean of {args.steps} decode steps, "
            "best of 3\n\n| batch | cached | growing cache: ms a step | in place: ms a step | ms a sequence (growing, "
            "in place) | growing: cache MB in + out | numpy copy of it, ms | growing: operator types by share of node "
            "time |\n|---:|---:|---:|---:|---:|---:|---:|---|\n")
        for batch in args.batch:
            for cached in args.cached:
                inputs = step_inputs(backend, batch, cached, args.vocab)
                step = best_mean_ms(lambda i=inputs: backend.decode(*i), args.steps)  # the growing cache's step
                inplace = best_mean_ms(in_place_step(in_place, inputs, cached), args.steps)
                cache = [*inputs[2], *inputs[3]]
                moved = 2 * sum(v.nbytes for v in cache) + sum(v.nbytes // v.shape[2] for v in cache)
                copy = best_mean_ms(lambda c=cache: [np.concatenate([v, v[:, :, :1]], axis=2) for v in c], 20)
                shares = operator_shares(decode, _cache_feed(*inputs), args.threads, args.steps)
                top = ", ".join(f"{op} {share:.0%}" for op, share in list(shares.items())[:6])
                out(f"| {batch} | {cached} | {step:.3f} | {inplace:.3f} | {step / batch:.3f}, {inplace / batch:.3f} "
                    f"| {moved / 2**20:.1f} | {copy:.3f} | {top} |\n")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
