"""Wall time of a scheduled run with nothing new (skipped) against a full run on the same corpus.

    .venv/bin/python benchmarks/bench_retrain.py                    # the project's conf/base (`small` preset)
    .venv/bin/python benchmarks/bench_retrain.py --params training.schedule.max_steps=20 --repeats 3

In a copy of the project's configuration under benchmarks/.work/retrain, with its own SQLite MLflow store:
(1) a full ``kedro run --pipelines train_deploy`` (no champion yet: it trains, exports and registers version 1);
(2) the same command again, ``--repeats`` times: nothing changed, so each is recorded as a skipped run;
(3) the reference: ``kedro run --pipelines corpus --nodes plan_corpus_inputs``, ``--repeats`` times — Kedro's
start-up, an MLflow run and one read of every corpus input, which is what a skipped run must cost.
Targets (issue 19): skipped ≤ 10% of the full run and ≤ 1.5× the reference (medians). Each command is a real
``kedro run`` process, timed from start to exit. The work folder is removed afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "retrain"
KEDRO = [sys.executable, "-m", "kedro", "run"]
logger = logging.getLogger("bench_retrain")


def make_project(folder: Path) -> dict[str, str]:
    """A copy of the project's configuration in ``folder``; returns the environment its runs use."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(REPO / "conf", folder / "conf", ignore=shutil.ignore_patterns("local"))
    (folder / "conf" / "local").mkdir()
    shutil.copy(REPO / "pyproject.toml", folder / "pyproject.toml")
    (folder / "src").mkdir()  # kedro wants a source folder; the package itself is installed
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlruns.db'}", "KEDRO_DISABLE_TELEMETRY": "1"}


def timed(command: list[str], folder: Path, env: dict[str, str], expect: str | None = None,
          log: Path | None = None) -> float:
    """Seconds ``command`` took in ``folder``; it must succeed (and print ``expect`` when given). Its output goes
    to ``log`` when given."""
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if log is not None:
        log.write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0 or (expect and expect not in done.stdout):
        raise SystemExit(f"{' '.join(command[2:])} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="", help="kedro run --params for every run (e.g. a shorter training)")
    parser.add_argument("--repeats", type=int, default=3, help="skipped and reference runs to take the median of")
    parser.add_argument("--log", type=Path, help="keep the full run's console output in this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    params = ["--params", args.params] if args.params else []
    env = make_project(WORK)
    try:
        full = timed([*KEDRO, "--pipelines", "train_deploy", *params], WORK, env, expect="Registered", log=args.log)
        logger.info("full run: %.1f s", full)
        skipped, reference = [], []
        for _ in range(args.repeats):  # alternate, so both see the same machine
            skipped.append(timed([*KEDRO, "--pipelines", "train_deploy", *params], WORK, env,
                                 expect="Skipped: nothing to retrain"))
            reference.append(timed([*KEDRO, "--pipelines", "corpus", "--nodes", "plan_corpus_inputs", *params],
                                   WORK, env))
            logger.info("skipped run %.1f s, reference %.1f s", skipped[-1], reference[-1])
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    skip, ref = statistics.median(skipped), statistics.median(reference)
    sys.stdout.write(
        "| run | wall time (s) | ratio |\n|---|---:|---:|\n"
        f"| full `train_deploy` (trains, exports, registers) | {full:.1f} | |\n"
        f"| skipped (nothing new), median of {args.repeats} | {skip:.1f} | {skip / full:.1%} of full "
        f"(target ≤ 10%) |\n"
        f"| reference: start-up + one read of the inputs, median | {ref:.1f} | skipped = {skip / ref:.2f}× "
        f"(target ≤ 1.5×) |\n")


if __name__ == "__main__":
    main()
