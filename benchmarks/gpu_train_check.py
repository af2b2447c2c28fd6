"""GPU check of the training stage, through the real stage (Paddle's launcher, workers, checkpoints).

    .venv/bin/python benchmarks/gpu_train_check.py [--peak-tflops 989]     # run by benchmarks/gpu_check.sh

Prints markdown tables and exits non-zero when a check fails:

1. environment: Paddle, CUDA, cuDNN, the GPU, TensorRT;
2. throughput of the 350M preset, bf16 O2, sequences of 1024, batch 8, 40 steps: the stage wrapped in
   auto-parallel (``parallel.single_process: auto_parallel``) and the plain model (the default at one
   process), same batch: tokens/s, MFU, peak memory;
3. O2 resume, plain and wrapped: stop at step 20, resume to 40 in the same folder, and compare the losses
   after the resume with the uninterrupted run of (2). A resume that lost the float32 master weights jumps
   back towards the initial loss; the check wants the resumed losses within 2% of the uninterrupted ones;
4. the O2 checkpoint (flash attention and fused RoPE in its model configuration, float32 masters in its
   model file) evaluated in float32 by ``evaluation.load_model``: the portable model averaging and export
   use; its loss must be close to the run's own evaluation;
5. a ``device: cpu`` job of 2 processes on this GPU machine (the GPU wheel): gloo, and it finishes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

WORK = Path(os.environ.get("GPU_CHECK_WORK", Path(__file__).resolve().parent / ".work" / "gpu_check"))
O2_350M = {
    "model": {"preset": "350m"},
    "batch": {"micro_batch_size": 8, "global_batch_size": 8, "seq_length": 1024},
    "precision": {"amp": True, "dtype": "bfloat16", "level": "O2"},
    "schedule": {"max_steps": 40, "log_every": 5, "eval_every": 100_000, "eval_batches": 2,
                 "checkpoint_every": 100_000, "resume": "auto"},
    "device": {"type": "gpu"},
    "launch": {"nproc_per_node": 1},
}
SMOKE = {  # --smoke: the same checks on CPU with the tiny model in float32, for the test suite
    "model": {"preset": "tiny"},
    "batch": {"micro_batch_size": 4, "global_batch_size": 4, "seq_length": 32},
    "schedule": {"max_steps": 8, "log_every": 2, "eval_every": 100_000, "eval_batches": 2,
                 "checkpoint_every": 100_000, "resume": "auto"},
    "device": {"type": "cpu"},
    "launch": {"nproc_per_node": 1},
}
FAILED: list[str] = []


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def environment() -> None:
    import paddle

    props = paddle.device.cuda.get_device_properties()
    try:
        import tensorrt

        trt = tensorrt.__version__
    except ImportError:
        trt = "not installed"
    out("| what | value |\n|---|---|")
    for key, value in (("Paddle", f"{paddle.__version__} ({paddle.version.commit[:10]})"),
                       ("CUDA / cuDNN", f"{paddle.version.cuda()} / {paddle.version.cudnn()}"),
                       ("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                               f"compute {props.major}.{props.minor}"),
                       ("TensorRT (Python)", trt), ("Python", sys.version.split()[0])):
        out(f"| {key} | {value} |")
    out()


def tokens(vocab_size: int):
    """The embedded corpus, tokenized with ``vocab_size`` ids, published as the catalog does."""
    from train_deploy.datasets import ArtifactFolderDataset
    from train_deploy.handoffs import DataSpec
    from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs, prepare_tokenizer

    def publish(work, folder: Path, description: str):
        dataset = ArtifactFolderDataset(path=str(folder), description=f"train_deploy.handoffs.{description}")
        dataset.save(work)
        return dataset.load()

    config, plan = plan_inputs({"tokenizer": {"vocab_size": vocab_size}, "encoding": {"progress": False}})
    tokenizer = publish(prepare_tokenizer(config, plan), WORK / "tokenizer", "TokenizerInfo")
    return DataSpec.of(publish(encode_tokens(config, plan, tokenizer), WORK / "tokens", "TokenManifest"))


def read_folder_manifest(folder: Path):
    from train_deploy.handoffs import TokenManifest

    return TokenManifest.read_folder(folder)


def train(name: str, data, params: dict, fresh: bool = True):
    """Run the stage in ``WORK/name``; return its result and metrics rows (this launch's only)."""
    import shutil

    from train_deploy.training.launch import run_training
    from train_deploy.training.spec import run_spec

    folder = WORK / name
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
    spec = run_spec(folder, data, params)
    spec.metrics_path.unlink(missing_ok=True)
    started = time.perf_counter()
    result = run_training(spec)
    rows = [json.loads(line) for line in spec.metrics_path.read_text().splitlines()]
    out(f"<!-- {name}: {time.perf_counter() - started:.0f} s -->")
    return result, rows


def with_blocks(params: dict, **blocks) -> dict:
    params = copy.deepcopy(params)
    for block, values in blocks.items():
        params[block] = {**params.get(block, {}), **values}
    return params


def throughput(data, base: dict) -> dict:
    """(2): the wrapped and the plain model, same batch; return each one's metrics rows by name."""
    runs = {}
    out(f"| model ({base['model']['preset']}, {'bf16 O2' if base.get('precision') else 'fp32'}, "
        f"seq {base['batch']['seq_length']} × {base['batch']['global_batch_size']}) | tokens/s | MFU | "
        f"peak memory MB | loss at {base['schedule']['max_steps']} |")
    out("|---|---:|---:|---:|---:|")
    for name in ("auto_parallel", "plain"):
        _, rows = train(name, data, with_blocks(base, parallel={"single_process": name}))
        steady = rows[1:]
        tps = sum(r["tokens_per_second"] for r in steady) / len(steady)
        mfu = sum(r["mfu"] for r in steady) / len(steady)
        out(f"| {name} | {tps:,.0f} | {mfu:.1%} | {max(r['memory_mb'] for r in rows):,.0f} | {rows[-1]['loss']:.4f} |")
        runs[name] = rows
    faster = max(runs, key=lambda n: sum(r["tokens_per_second"] for r in runs[n][1:]))
    out(f"\nFaster at one process: {faster} (parallel.single_process; the default, auto_parallel, was measured "
        "faster on CPU: docs/benchmarks.md).\n")
    return runs


def resume(data, base: dict, uninterrupted: dict) -> None:
    """(3): stop half-way, resume to the end; the resumed losses must continue the uninterrupted run's."""
    stop, last = base["schedule"]["max_steps"] // 2, base["schedule"]["max_steps"]
    out(f"| resume | first logged loss | loss at {stop} | first loss after resume | uninterrupted there | "
        f"loss at {last} | uninterrupted at {last} | verdict |")
    out("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in ("plain", "auto_parallel"):
        params = with_blocks(base, parallel={"single_process": name})
        _, before = train(f"resume_{name}", data, with_blocks(params, schedule={"stop_after": stop}))
        _, after = train(f"resume_{name}", data, params, fresh=False)
        reference = {r["step"]: r["loss"] for r in uninterrupted[name]}
        resumed = {r["step"]: r["loss"] for r in after}
        first, initial = min(resumed), reference[min(reference)]
        worst = max(abs(resumed[s] - reference[s]) / reference[s] for s in resumed)
        ok = worst <= 0.02 and resumed[first] < initial  # a lost resume climbs back towards the initial loss
        FAILED.extend([] if ok else [f"resume ({name}): worst relative loss difference {worst:.3f}"])
        out(f"| {name} | {initial:.4f} | {before[-1]['loss']:.4f} | {resumed[first]:.4f} (step {first}) | "
            f"{reference[first]:.4f} | {resumed[last]:.4f} | {reference[last]:.4f} | "
            f"{'ok' if ok else 'FAILED'} (worst {worst:.2%}) |")
    out()


def portable(data, base: dict) -> None:
    """(4): the last checkpoint evaluated as averaging and export rebuild it (float32, portable attention)."""
    import paddle

    from train_deploy.training.checkpoint import latest_checkpoint, read_state
    from train_deploy.training.evaluation import load_model, validation_loss, validation_windows

    checkpoint = latest_checkpoint(WORK / "plain" / "checkpoints")
    state = read_state(checkpoint)
    b = base["batch"]
    windows = validation_windows(data.valid_prefix, data.dtype, b["seq_length"],
                                 base["schedule"]["eval_batches"] * b["global_batch_size"])
    paddle.set_device(base["device"]["type"])
    loss = validation_loss(load_model(checkpoint), windows, batch_size=b["micro_batch_size"])
    recorded = state["val_loss"]
    ok = math.isfinite(loss) and abs(loss - recorded) / recorded <= 0.02
    FAILED.extend([] if ok else [f"portable evaluation: {loss} against the run's {recorded}"])
    out("| portable evaluation of the last checkpoint | flags in its config | float32 loss | run's loss | verdict |")
    out("|---|---|---:|---:|---|")
    flags = {k: state["model_config"].get(k) for k in ("use_flash_attention", "use_fused_rope")}
    out(f"| {checkpoint.name} | {flags} | {loss:.4f} | {recorded:.4f} | {'ok' if ok else 'FAILED'} |\n")


def cpu_job(data) -> None:
    """(5): two CPU processes with the GPU wheel installed."""
    params = {"model": {"preset": "tiny"}, "batch": {"micro_batch_size": 2, "global_batch_size": 4, "seq_length": 32},
              "schedule": {"max_steps": 3, "log_every": 1, "eval_every": 3, "checkpoint_every": 3, "resume": "never"},
              "device": {"type": "cpu"}, "launch": {"nproc_per_node": 2}}
    try:
        result, _ = train("cpu_job", data, params)
        ok, note = result.finished, f"finished, loss {result.val_loss}"
    except Exception as exc:  # noqa: BLE001 - reported as the row
        ok, note = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    FAILED.extend([] if ok else [f"device: cpu job: {note}"])
    out(f"| device: cpu, 2 processes, on the GPU wheel | {'ok' if ok else 'FAILED'} | {note} |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100/H200: 989)")
    parser.add_argument("--smoke", action="store_true", help="the same checks on CPU with the tiny model (tests)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokens", type=Path, help="a published token folder to use instead of encoding the corpus")
    args = parser.parse_args()
    import logging

    import paddle

    from train_deploy.handoffs import DataSpec

    logging.basicConfig(level=logging.WARNING)
    base = with_blocks(SMOKE if args.smoke else O2_350M, device={"peak_tflops": args.peak_tflops})
    if not args.smoke:
        assert paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0, "no CUDA device"
        environment()
    WORK.mkdir(parents=True, exist_ok=True)
    data = tokens(args.vocab_size) if args.tokens is None else DataSpec.of(read_folder_manifest(args.tokens))
    runs = throughput(data, base)
    resume(data, base, runs)
    portable(data, base)
    cpu_job(data)
    if FAILED:
        out("FAILED: " + "; ".join(FAILED))
        sys.exit(1)


if __name__ == "__main__":
    main()
