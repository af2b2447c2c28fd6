"""The measured learning curve: validation loss against wall time and tokens seen, beside the n-gram baselines.

The measurement in docs/benchmarks.md (the default preset, then the next one up, whose steps take about 40 s):

    .venv/bin/python benchmarks/bench_learning_curve.py --minutes 45 --max-steps 9700
    .venv/bin/python benchmarks/bench_learning_curve.py --preset 350m --minutes 30 --max-steps 30 --eval-every 5

The training stage (Paddle's launcher) runs the default run's `training` block (conf/base: `make run`'s; the
dataclass defaults) on the default corpus's token files (the embedded People's Daily corpus, bench_train.py's),
with these changes: ``model.preset`` (``--preset``), ``schedule.eval_every`` (``--eval-every``), a checkpoint
only at the end, no resume, and ``schedule.max_steps``, the cosine schedule's length: ``--max-steps``, by default
the steps ``--minutes`` holds at the default run's pace on 2 cores (1,400 steps in about 6.5 minutes), so the
rate decays over the budget as it does over a default run (another preset's pace differs: measure it with a
short run first and pass ``--max-steps``). The run is stopped at ``--minutes`` of wall time (launch included) if
its schedule has not ended. Each validation loss is stamped with the wall time it was read at (polled every
second) and the tokens seen (step × global batch × sequence length); the add-k, Kneser–Ney bigram and trigram
baselines are computed on the same validation windows the workers evaluate (``baselines.baselines_for``), and
the first evaluation below each is recorded (or null: not within the time).

Writes ``docs/learning_curve_<preset>.json`` and ``docs/learning_curve_<preset>.png`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_train import WORK, prepare_token_files

from train_deploy.atomic import write_json
from train_deploy.handoffs import DataSpec, TokenManifest
from train_deploy.run_control.processes import stop_process_tree
from train_deploy.training.spec import RunSpec, run_spec

logger = logging.getLogger("bench_learning_curve")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_PACE = 1400 / 390  # steps per second of the default run on 2 cores (README: about 6.5 minutes)


def baselines_of(spec: RunSpec, tokens: TokenManifest) -> dict[str, float | None]:
    """The baselines' losses on the windows the workers evaluate (``worker.validation_set``'s)."""
    from train_deploy.baselines import baselines_for
    from train_deploy.training.evaluation import validation_windows

    b, s = spec.training.batch, spec.training.schedule
    windows = validation_windows(tokens.prefix("valid"), tokens.dtype, b.seq_length,
                                 s.eval_batches * b.global_batch_size)
    rows = b.micro_batch_size * spec.layout.dp
    found = baselines_for(tokens, windows[: len(windows) // rows * rows])
    return {"add-k bigram": found.bigram_loss, "Kneser-Ney bigram": found.kn_bigram_loss,
            "Kneser-Ney trigram": found.kn_trigram_loss}


def train_until(spec: RunSpec, deadline_s: float) -> tuple[list[dict], str, float]:
    """Train ``spec`` in a child process until its schedule ends or ``deadline_s`` of wall time; return the
    evaluations (step, tokens seen, wall time, loss), how it ended and the wall time."""
    from train_deploy.handoffs import to_json

    spec_file = Path(spec.logs).parent / "spec.json"
    write_json(spec_file, to_json(spec))
    spec.metrics_path.unlink(missing_ok=True)
    tokens_per_step = spec.training.batch.global_batch_size * spec.training.batch.seq_length
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, __file__, "--child", str(spec_file)], start_new_session=True)
    points: list[dict] = []
    seen = 0
    while True:
        ended = child.poll() is not None
        wall = time.monotonic() - started
        lines = spec.metrics_path.read_text(encoding="utf-8").splitlines() if spec.metrics_path.exists() else []
        for row in map(json.loads, lines[seen:]):
            if "val_loss" in row:
                points.append({"step": row["step"], "tokens": row["step"] * tokens_per_step,
                               "wall_s": round(wall, 1), "val_loss": row["val_loss"]})
                logger.info("step %d: validation loss %.4f at %.0f s", row["step"], row["val_loss"], wall)
        seen = len(lines)
        if ended:
            if child.returncode != 0:
                raise SystemExit(f"training failed (exit code {child.returncode}); see {spec.logs}")
            return points, "schedule", wall
        if wall >= deadline_s:
            stop_process_tree(child, 30.0)
            return points, "deadline", wall
        time.sleep(1.0)


def crossings(points: list[dict], baselines: dict[str, float | None]) -> dict[str, dict | None]:
    """The first evaluation below each baseline, or None where none was within the time."""
    return {name: next(({"step": p["step"], "tokens": p["tokens"], "wall_s": p["wall_s"]} for p in points
                        if loss is not None and p["val_loss"] < loss), None)
            for name, loss in baselines.items()}


def plot(result: dict, path: Path) -> None:
    """Validation loss against wall time (minutes) and tokens seen, the baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, key, label, scale in ((axes[0], "wall_s", "wall time (minutes)", 60),
                                    (axes[1], "tokens", "tokens seen (millions)", 1e6)):
        axis.plot([p[key] / scale for p in points], [p["val_loss"] for p in points], marker=".",
                  label="validation loss")
        for (name, loss), style in zip(result["baselines"].items(), (":", "--", "-."), strict=True):
            if loss is not None:
                axis.axhline(loss, linestyle=style, color="grey", label=f"{name} {loss:.3f}")
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/token)")
    axes[1].legend(fontsize=8)
    figure.suptitle(f"{result['preset']} preset, {result['ended_by']} after {result['wall_s'] / 60:.1f} min "
                    f"(step {points[-1]['step'] if points else 0} of {result['max_steps']})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-time budget, launch included")
    parser.add_argument("--preset", default="small", help="training.model.preset (the default: small; next: 350m)")
    parser.add_argument("--max-steps", type=int, help="the schedule's length (default: what --minutes holds)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="folder for the JSON and the PNG")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.child:  # the training itself, in a process tree of its own that the deadline stops whole
        from train_deploy.handoffs import from_json
        from train_deploy.training.launch import TrainingStopped, run_training

        try:
            run_training(from_json(RunSpec, json.loads(args.child.read_text(encoding="utf-8")), str(args.child)))
        except TrainingStopped:  # the deadline's SIGTERM: what the parent asked for
            logger.info("training stopped at the deadline")
        return
    tokens = prepare_token_files()
    max_steps = args.max_steps or max(1, round(args.minutes * 60 * DEFAULT_PACE))
    params = {"model": {"preset": args.preset},
              "schedule": {"max_steps": max_steps, "eval_every": args.eval_every, "log_every": 25,
                           "checkpoint_every": max_steps, "resume": "never"}}
    spec = run_spec(WORK / f"learning_curve_{args.preset}", DataSpec.of(tokens), params)
    baselines = baselines_of(spec, tokens)
    points, ended_by, wall = train_until(spec, args.minutes * 60)
    result = {"preset": args.preset, "minutes": args.minutes, "max_steps": max_steps, "eval_every": args.eval_every,
              "ended_by": ended_by, "wall_s": round(wall, 1), "load_average": round(os.getloadavg()[0], 2),
              "cpus": os.cpu_count(), "baselines": baselines, "first_below": crossings(points, baselines),
              "points": points,
              "command": " ".join(["benchmarks/bench_learning_curve.py", *sys.argv[1:]])}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"learning_curve_{args.preset}.json", result)
    plot(result, args.out / f"learning_curve_{args.preset}.png")
    logger.info("first below each baseline: %s", json.dumps(result["first_below"]))


if __name__ == "__main__":
    main()
