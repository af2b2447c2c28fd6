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
exit $status
