#!/usr/bin/env bash
# Single-GPU check: bf16 tokens/s and MFU of the ~350M preset, through the real training stage; then the
# export stage's Paddle Inference GPU and TensorRT fp16 paths (benchmarks/gpu_export_check.py).
#
#   bash benchmarks/gpu_check.sh [PEAK_TFLOPS]     # default 989 (H100/H200 SXM dense bf16)
#
# Needs the project environment with Paddle's GPU wheel in place of the CPU one:
#   make venv DEVICE=gpu     # CUDA=cu126 unless given (cu118, cu126, cu129, cu130); README, "GPU"
# Prints one table row; the full metrics are in benchmarks/.work/gpu_check/logs/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
PEAK="${1:-989}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
"$PY" - "$PEAK" <<'PY'
import json, sys, time
from pathlib import Path
import paddle
assert paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0, "no CUDA device visible to Paddle"
from train_deploy.datasets import ArtifactFolderDataset
from train_deploy.handoffs import DataSpec, RunSpec
from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs, prepare_tokenizer
from train_deploy.training.config import TrainingConfig
from train_deploy.training.launch import run_training

work = Path("benchmarks/.work/gpu_check")

def publish(node_work, folder, description):
    dataset = ArtifactFolderDataset(path=str(folder), description=f"train_deploy.handoffs.{description}")
    dataset.save(node_work)
    return dataset.load()

config, plan = plan_inputs({"tokenizer": {"vocab_size": 8192}, "encoding": {"progress": False}})
tokenizer = publish(prepare_tokenizer(config, plan), work / "tokenizer", "TokenizerInfo")
tokens = publish(encode_tokens(config, plan, tokenizer), work / "tokens", "TokenManifest")
params = {
    "model": {"preset": "350m"},
    "batch": {"micro_batch_size": 8, "global_batch_size": 8, "seq_length": 1024},
    "precision": {"amp": True, "dtype": "bfloat16", "level": "O2"},
    "schedule": {"max_steps": 40, "log_every": 10, "eval_every": 100000, "checkpoint_every": 100000, "resume": "never"},
    "device": {"type": "gpu", "peak_tflops": float(sys.argv[1])},
    "launch": {"nproc_per_node": 1},
}
spec = RunSpec(run_name="gpu_check", training=params, data=DataSpec.of(tokens),
               checkpoints=str(work / "checkpoints"), logs=str(work / "logs"))
spec.metrics_path.unlink(missing_ok=True)
run_training(TrainingConfig.from_params(params), spec)
rows = [json.loads(l) for l in spec.metrics_path.read_text().splitlines()][1:]
tps = sum(r["tokens_per_second"] for r in rows) / len(rows)
mfu = sum(r["mfu"] for r in rows) / len(rows)
mem = max(r["memory_mb"] for r in rows)
print(f"| {paddle.device.cuda.get_device_name()} | 350m bf16 O2 | seq 1024 × 8 | {tps:,.0f} tokens/s | MFU {mfu:.1%} | {mem:,.0f} MB |")
PY
"$PY" benchmarks/gpu_export_check.py
