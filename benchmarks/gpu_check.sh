#!/usr/bin/env bash
# Single-GPU check, the first hour on a GPU machine: what the CPU suite cannot prove (≤ 8 minutes on one H200).
#
#   bash benchmarks/gpu_check.sh [PEAK_TFLOPS]     # default 989 (H100/H200 SXM dense bf16)
#
# Needs the project environment with Paddle's GPU wheel in place of the CPU one:
#   make venv DEVICE=gpu     # CUDA=cu126 unless given (cu118, cu126, cu129, cu130); README, "GPU"
#
# 1. benchmarks/gpu_train_check.py: the environment; bf16 O2 tokens/s and MFU of the 350M preset through the
#    stage, wrapped in auto-parallel and plain (same batch); an O2 stop-at-20 / resume-to-40 whose losses must
#    continue the uninterrupted run's; the O2 checkpoint evaluated in float32 with portable attention; a
#    device: cpu job of 2 processes on the GPU wheel (gloo).
# 2. benchmarks/gpu_export_check.py: Paddle Inference fp32 (TF32 off) and fp16, TensorRT fp16 where the wheel
#    has it, each built, judged by its precision's parity rule and timed on its own.
# 3. training.layout: auto on this GPU: the choice for the 350m preset (1 device, global batch 8 x 2048 tokens,
#    float32) and its memory estimate against the peak paddle.device.cuda.max_memory_allocated() after two real
#    steps at that choice (docs/training.md, "A layout chosen for the user"; LAYOUT_DEVICE=cpu LAYOUT_PRESET=tiny
#    runs the same check on a CPU).
# Prints markdown tables; exits non-zero when a check failed (after running the rest).
set -uo pipefail
cd "$(dirname "$0")/.."
PEAK="${1:-989}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
status=0
"$PY" benchmarks/gpu_train_check.py --peak-tflops "$PEAK" || status=1
"$PY" benchmarks/gpu_export_check.py || status=1
LAYOUT_DEVICE="${LAYOUT_DEVICE:-gpu}" LAYOUT_PRESET="${LAYOUT_PRESET:-350m}" "$PY" - <<'LAYOUT' || status=1
import os, subprocess
import numpy as np, paddle, psutil
from paddle.base import core
from train_deploy.training.config import TrainingConfig
from train_deploy.training.layout import Devices, Workload, choose_layout, describe
from train_deploy.training.model import build_model
from train_deploy.training.worker import build_optimizer
kind, preset, vocab = os.environ["LAYOUT_DEVICE"], os.environ["LAYOUT_PRESET"], 32000
paddle.set_device(kind)
memory = (int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout.split()[0]) * 2**20
          if kind == "gpu" else psutil.virtual_memory().available)
seq = TrainingConfig.from_params({"model": {"preset": preset}}).model.shape()["max_position_embeddings"]
config = TrainingConfig.from_params({"model": {"preset": preset}, "device": {"type": kind},
                                     "batch": {"global_batch_size": 8, "micro_batch_size": 8, "seq_length": seq}})
devices = Devices(kind=kind, world=1, per_node=1, memory_bytes=memory)
choice = choose_layout(Workload(config.model.shape(), vocab, 8, seq), devices)
print(describe(choice, devices))
config = TrainingConfig.from_params({**{"model": {"preset": preset}, "device": {"type": kind}}, "batch": {
    "global_batch_size": 8, "micro_batch_size": choice.micro_batch_size, "seq_length": seq},
    "precision": {"recompute": choice.recompute}})
base = core.host_memory_stat_current_value("Allocated", 0) if kind == "cpu" else 0
model = build_model(config, vocab, 2)
optimizer, _ = build_optimizer(model, config)
ids = paddle.to_tensor(np.random.default_rng(0).integers(0, vocab, (choice.micro_batch_size, seq + 1)))
for _ in range(2):
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    (loss[0] if isinstance(loss, (tuple, list)) else loss).backward()
    optimizer.step()
    optimizer.clear_grad()
peak = (paddle.device.cuda.max_memory_allocated() if kind == "gpu"
        else core.host_memory_stat_peak_value("Allocated", 0) - base)
print(f"| layout auto, {preset} | estimate {choice.memory_bytes / 2**30:.2f} GiB | measured peak {peak / 2**30:.2f} "
      f"GiB | {100 * (choice.memory_bytes - peak) / peak:+.1f}% |")
LAYOUT
exit $status
