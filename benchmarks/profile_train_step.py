"""Where one training step's time goes: the default model and micro-batch in this process, one thread.

    .venv/bin/python benchmarks/profile_train_step.py                    # seconds per step, split
    .venv/bin/python benchmarks/profile_train_step.py --profile          # plus Paddle's operator summary
    MKL_DEBUG_CPU_TYPE= .venv/bin/python benchmarks/profile_train_step.py  # the MKL path the workers had before

The `small` model as the training worker builds it (``build_model``: on CPU with its faster norm and rotary
forms), AdamW with clipping, micro-batches of ``--rows`` × 128 tokens from the embedded corpus's token files
(bench_train.py's), no launcher and no distributed tensors. Forward, loss, backward and optimizer are timed
apart after 5 warm-up steps. On AMD CPUs this sets MKL_DEBUG_CPU_TYPE=5 as the launcher does for its
workers, unless the variable is already set (empty: MKL's own choice).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOG_minloglevel", "2")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from bench_train import prepare_tokens  # noqa: E402

from train_deploy.environment import first_cpu, mkl_cpu_type  # noqa: E402

if mkl_cpu_type(first_cpu()):
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", mkl_cpu_type(first_cpu()))  # read when MKL loads, with Paddle below


def main() -> None:
    import paddle

    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.data import TokenWindows
    from train_deploy.training.evaluation import next_token_loss
    from train_deploy.training.model import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--profile", action="store_true", help="print Paddle's operator summary of 10 steps")
    args = parser.parse_args()
    data = prepare_tokens()
    config = TrainingConfig.from_params({})
    paddle.seed(config.schedule.seed)
    model = build_model(config, data.vocab_size, data.eos_id)
    optimizer = paddle.optimizer.AdamW(learning_rate=3.5e-3, parameters=model.parameters(), weight_decay=0.1,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    windows = TokenWindows(Path(data.train_prefix), 128, config.schedule.seed, data.dtype)

    def step(index: int) -> np.ndarray:
        marks = [time.perf_counter()]
        batch = paddle.to_tensor(windows.batch(index * args.rows, args.rows))
        logits = model(input_ids=batch[:, :-1])
        marks.append(time.perf_counter())
        loss = next_token_loss(logits, batch[:, 1:])
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.clear_grad()
        float(loss)
        marks.append(time.perf_counter())
        return np.diff(marks)

    for index in range(5):
        step(index)
    if args.profile:
        import paddle.profiler as profiler

        prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], scheduler=(0, 10))
        prof.start()
        for index in range(10):
            step(5 + index)
            prof.step()
        prof.stop()
        prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, thread_sep=False, time_unit="ms")
    split = np.mean([step(100 + index) for index in range(args.steps)], axis=0)
    sys.stdout.write(f"MKL_DEBUG_CPU_TYPE={os.environ.get('MKL_DEBUG_CPU_TYPE', '(unset)')}: "
                     f"{split.sum():.4f} s/step ({args.rows * 128 / split.sum():,.0f} tokens/s): forward "
                     f"{split[0]:.4f}, loss {split[1]:.4f}, backward {split[2]:.4f}, optimizer {split[3]:.4f}; "
                     f"load average {os.getloadavg()[0]:.1f}\n")


if __name__ == "__main__":
    main()
