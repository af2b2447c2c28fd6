"""Tokens/s of the default training configuration (conf/base: `make run`'s), for a few steps, side by side.

    .venv/bin/python benchmarks/bench_train_default.py --steps 150
    # an older commit's code under the same load: its src/ first on the path, the same token files
    git archive <commit> src | tar -x -C /tmp/old && \
        PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/bench_train_default.py --steps 150 --name old

The training stage (Paddle's launcher, ``launch.nproc_per_node`` workers) runs the `training` block's defaults
with ``max_steps`` = ``--steps`` (the cosine schedule shortened with it: tokens/s does not depend on the rate)
on the embedded corpus's token files (bench_train.py's). Tokens/s is averaged over the logging windows after the
first (start-up, first-step allocations); the wall time includes the launch. Interleave runs of two commits to
compare them on a shared machine, and write ``uptime``'s load beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from bench_train import WORK, prepare_tokens

from train_deploy.training.launch import run_training
from train_deploy.training.spec import run_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--name", default="default", help="label of this run in the output")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    data = prepare_tokens()
    params = {"schedule": {"max_steps": args.steps, "log_every": 25, "eval_every": 10_000,
                           "checkpoint_every": 10_000, "resume": "never"}}
    folder = WORK / f"default_{args.name}"
    spec = run_spec(folder, data, params)
    spec.metrics_path.unlink(missing_ok=True)
    started = time.perf_counter()
    run_training(spec)
    wall = time.perf_counter() - started
    rows = [row for row in map(json.loads, spec.metrics_path.read_text().splitlines()) if "tokens_per_second" in row]
    rate = sum(row["tokens_per_second"] for row in rows[1:]) / max(1, len(rows) - 1)
    sys.stdout.write(f"{args.name}: {rate:,.0f} tokens/s after the first logging window, to step {rows[-1]['step']}; "
                     f"wall {wall:.1f} s with the launch; loss {rows[-1]['loss']:.4f}; "
                     f"load average {os.getloadavg()[0]:.1f}\n")


if __name__ == "__main__":
    main()
