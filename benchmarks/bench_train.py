"""Training throughput and MFU, side by side, in one run on this machine.

    .venv/bin/python benchmarks/bench_train.py              # small preset, 30 steps per row
    .venv/bin/python benchmarks/bench_train.py --steps 20

Same model (the `small` preset), same data (the embedded corpus), same global batch (32 × 128 tokens,
micro-batches of 8: 4 accumulation steps in one process, 2 per rank with dp=2):

  (a) a plain single-process Paddle loop: the model, AdamW, forward/backward/step, nothing else;
  (b) this stage with 1 process (Paddle's launcher, the plain model, metrics, checkpoints);
  (b') the same wrapped in auto-parallel (a mesh of one: ``parallel.single_process: auto_parallel``, the default);
  (c) this stage with dp=2 (2 processes);
  (d) this stage with mp=2 (2 processes).

Every process runs with one thread (OMP/MKL/OPENBLAS_NUM_THREADS=1). Tokens/s excludes the first
logging window (start-up, first-step allocations). MFU is against the measured float32 matmul rate of
one thread (the calibration the stage itself uses when no peak is configured).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from train_deploy.handoffs import DataSpec, TokenManifest, from_json, to_json
from train_deploy.training.spec import run_spec

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

WORK = Path(__file__).resolve().parent / ".work" / "train"
PARAMS = {
    "model": {"preset": "small"},
    "batch": {"micro_batch_size": 8, "global_batch_size": 32, "seq_length": 128},
    "schedule": {"max_steps": 30, "log_every": 5, "eval_every": 10_000, "checkpoint_every": 10_000, "resume": "never"},
}


def prepare_token_files() -> TokenManifest:
    """Token files of the embedded corpus: the corpus stage with its defaults, published as the catalog does
    (kept when unchanged), as their manifest."""
    from train_deploy.datasets import ArtifactFolderDataset
    from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs, prepare_tokenizer

    def publish(work, folder: Path, description: str):
        dataset = ArtifactFolderDataset(path=str(folder), description=f"train_deploy.handoffs.{description}")
        dataset.save(work)
        return dataset.load()

    config, plan = plan_inputs({"encoding": {"progress": False}})
    tokenizer = publish(prepare_tokenizer(config, plan), WORK / "tokenizer", "TokenizerInfo")
    return publish(encode_tokens(config, plan, tokenizer), WORK / "tokens", "TokenManifest")


def prepare_tokens() -> DataSpec:
    """The embedded corpus's token files (:func:`prepare_token_files`) as the training stage's data."""
    return DataSpec.of(prepare_token_files())


def plain_loop(data: DataSpec, steps: int) -> dict:
    """(a): the textbook single-process loop on the same model, data order and batch."""
    import paddle

    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.data import TokenWindows
    from train_deploy.training.model import build_model

    config = TrainingConfig.from_params(PARAMS)
    paddle.seed(config.schedule.seed)
    model = build_model(config, data.vocab_size, data.eos_id)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters(), weight_decay=0.1,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    windows = TokenWindows(Path(data.train_prefix), 128, config.schedule.seed, data.dtype)
    timings = []
    for step in range(steps):
        started = time.perf_counter()
        for k in range(4):  # 4 × 8 sequences = the global batch of 32
            batch = paddle.to_tensor(windows.batch(step * 32 + k * 8, 8))
            logits = model(input_ids=batch[:, :-1])
            loss = paddle.nn.functional.cross_entropy(logits.astype("float32"), batch[:, 1:].unsqueeze(-1)) / 4
            loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        float(loss)
        timings.append(time.perf_counter() - started)
    steady = timings[5:]
    return {"tokens_per_second": 32 * 128 * len(steady) / sum(steady), "loss": float(loss) * 4}


def stage(data: DataSpec, nproc: int, parallel: dict, steps: int) -> dict:
    from train_deploy.training.launch import run_training

    folder = WORK / f"stage_{nproc}_{'_'.join(f'{k}{v}' for k, v in parallel.items())}"
    params = copy.deepcopy(PARAMS)
    params["parallel"] = parallel
    params["schedule"]["max_steps"] = steps
    params["launch"] = {"nproc_per_node": nproc}
    spec = run_spec(folder, data, params)
    spec.metrics_path.unlink(missing_ok=True)
    run_training(spec)
    rows = [json.loads(line) for line in spec.metrics_path.read_text().splitlines()][1:]
    rate = sum(r["tokens_per_second"] for r in rows) / len(rows)
    return {"tokens_per_second": rate, "mfu": sum(r["mfu"] for r in rows) / len(rows), "loss": rows[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:  # child process for (a): one thread, nothing else loaded
        print(json.dumps(plain_loop(from_json(DataSpec, json.loads(args.plain), "--plain"), args.steps)))  # noqa: T201
        return
    import logging

    logging.basicConfig(level=logging.WARNING)
    WORK.mkdir(parents=True, exist_ok=True)
    data = prepare_tokens()
    out = subprocess.run([sys.executable, __file__, "--plain", json.dumps(to_json(data)), "--steps", str(args.steps)],
                         check=True, capture_output=True, text=True).stdout
    plain = json.loads(out.strip().splitlines()[-1])
    rows = [("(a) plain single-process Paddle loop", 1, plain["tokens_per_second"], None)]
    for label, nproc, parallel in (("(b) this stage, 1 process, plain", 1, {"dp": 1, "single_process": "plain"}),
                                   ("(b') this stage, 1 process, auto-parallel", 1,
                                    {"dp": 1, "single_process": "auto_parallel"}),
                                   ("(c) this stage, dp=2", 2, {"dp": 2}),
                                   ("(d) this stage, mp=2", 2, {"dp": 1, "mp": 2})):
        r = stage(data, nproc, parallel, args.steps)
        rows.append((label, nproc, r["tokens_per_second"], r["mfu"]))
    base = rows[1][2]
    lines = ["| run | processes | tokens/s | MFU | × (b) |", "|---|---:|---:|---:|---:|"]
    for label, nproc, rate, mfu in rows:
        mfu_text = f"{mfu:.1%}" if mfu is not None else "–"
        lines.append(f"| {label} | {nproc} | {rate:,.0f} | {mfu_text} | {rate / base:.2f} |")
    lines.append("")
    lines.append(f"(b) / (a) = {rows[1][2] / rows[0][2]:.3f} (target ≥ 0.95); "
                 f"(b') / (b) = {rows[2][2] / base:.2f}; (c) / (b) = {rows[3][2] / base:.2f} (target ≥ 1.7)")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
