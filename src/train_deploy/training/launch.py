"""Start the training workers with Paddle's own launcher, stream their progress, and wait.

:func:`run_training` writes the run's :class:`~train_deploy.handoffs.RunSpec` as ``<logs>/run.json`` and
runs::

    python -m paddle.distributed.launch --nproc_per_node G [--nnodes N --master HOST:PORT --rank R]
        --log_dir <logs>/node<R> --max_restart K .../worker.py --run <logs>/run.json

The other machines of a multi-node job join with ``train-deploy-join --run <logs>/run.json --node-rank R``
(the log folder on storage every node sees): the same launcher command with their own rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from train_deploy.handoffs import RunSpec, TrainingResult, read_json, write_json
from train_deploy.training import worker
from train_deploy.training.config import TrainingConfig

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"


class TrainingFailed(RuntimeError):
    """A worker died or raised; the message names the rank and ends with the tail of its log."""


def run_training(config: TrainingConfig, spec: RunSpec) -> TrainingResult:
    """Run (or resume) the job ``spec`` describes on this node's workers; return rank 0's result.

    Writes ``<spec.logs>/run.json`` for the workers (and the nodes that join), relaunches failed workers
    up to ``launch.max_restart`` times, and raises :class:`TrainingFailed` when they still fail.
    """
    spec_file = Path(spec.logs) / RUN_FILE
    write_json(spec_file, spec)
    run_launcher(config, spec_file, Path(spec.logs))
    return read_json(TrainingResult, spec.result_path)


def launcher_command(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None = None) -> list[str]:
    """Paddle's launcher for this node; its logs go to ``<log_dir>/node<rank>``."""
    la = config.launch
    rank = la.node_rank if node_rank is None else node_rank
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(la.nproc_per_node),
               "--log_dir", str(Path(log_dir) / f"node{rank}"), "--job_id", la.job_id,
               "--max_restart", str(la.max_restart)]
    if la.nnodes > 1:
        command += ["--nnodes", str(la.nnodes), "--master", str(la.master), "--rank", str(rank)]
    return command + [worker.__file__, "--run", str(spec_file)]


def worker_environment(config: TrainingConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.device.type == "cpu":
        # One BLAS/OpenMP pool per worker sized to its share of the cores, unless the user chose.
        share = max(1, (os.cpu_count() or 1) // config.launch.nproc_per_node)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, str(share))
    env.setdefault("GLOG_minloglevel", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_launcher(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None = None) -> None:
    """Run the launcher for this node, echoing rank 0's progress; raise :class:`TrainingFailed` on failure.

    Paddle's launcher honours ``--max_restart`` only in elastic mode (an etcd master); otherwise this
    function relaunches failed workers up to ``launch.max_restart`` times, and they resume from the
    last complete checkpoint on their own (``resume: auto``).
    """
    for attempt in range(config.launch.max_restart + 1):
        try:
            _launch_once(config, spec_file, log_dir, node_rank)
            return
        except TrainingFailed as exc:
            if attempt == config.launch.max_restart:
                raise
            logger.warning("%s; restarting the workers (%d of %d), they resume from the last checkpoint",
                           exc, attempt + 1, config.launch.max_restart)


def _launch_once(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None) -> None:
    command = launcher_command(config, spec_file, log_dir, node_rank)
    node_logs = Path(command[command.index("--log_dir") + 1])
    if node_logs.exists():  # keep an earlier attempt's logs beside, not mixed with, this one's
        previous = node_logs.with_name(f"{node_logs.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(node_logs, previous)
    node_logs.mkdir(parents=True)
    logger.info("Launching: %s", " ".join(command))
    with open(node_logs / "launcher.log", "w", encoding="utf-8") as launcher_log:
        process = subprocess.Popen(command, stdout=launcher_log, stderr=subprocess.STDOUT, text=True,
                                   env=worker_environment(config))
        progress = _LogFollower(node_logs / "workerlog.0", total=config.schedule.max_steps)
        try:
            while process.poll() is None:
                time.sleep(0.5)
                progress.echo()
            progress.echo()
        finally:
            progress.close()
    if process.returncode != 0:
        raise TrainingFailed(_failure_message(node_logs, process.returncode))


class _LogFollower:
    """Echo rank 0's progress lines (steps, evaluations, checkpoints) from its log as they appear."""

    _INTERESTING = re.compile(r"step \d+ |Checkpoint|Resumed|Model:|No validation")
    _STEP = re.compile(r"step (\d+) ")

    def __init__(self, path: Path, total: int) -> None:
        from tqdm.auto import tqdm

        self.path, self.offset = path, 0
        self.bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True, mininterval=1.0)

    def close(self) -> None:
        self.bar.close()

    def echo(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            if self._INTERESTING.search(line):
                logger.info("%s", line.split(" - ", 1)[-1].strip())
            if (step := self._STEP.search(line)) and int(step.group(1)) > self.bar.n:
                self.bar.update(int(step.group(1)) - self.bar.n)


_COMMUNICATION = re.compile(r"gloo|IoException|Connection reset|NCCL|Broken pipe|socket", re.IGNORECASE)


def _failure_message(log_dir: Path, code: int) -> str:
    """Name the worker that failed first, with the last lines of its log.

    A worker that raised has a traceback that is not about lost connections; a worker that was killed
    (SIGKILL, out of memory) leaves no error at all while its peers report the broken connection.
    """
    logs = {int(p.suffix[1:]): p.read_text(encoding="utf-8", errors="replace")
            for p in log_dir.glob("workerlog.*") if p.suffix[1:].isdigit()}
    for rank, text in sorted(logs.items()):
        trace = text[text.find("Traceback"):] if "Traceback" in text else ""
        if trace and not _COMMUNICATION.search(trace):
            return f"training worker rank {rank} failed (launcher exit code {code}): {_tail(text)}"
    silent = [rank for rank, text in sorted(logs.items()) if not _COMMUNICATION.search(text)
              and "Traceback" not in text]
    if silent and len(silent) < len(logs):
        return (f"training worker rank {silent[0]} died without an error (killed, out of memory or crashed; "
                f"launcher exit code {code}); the other ranks lost their connection to it. "
                f"{log_dir / f'workerlog.{silent[0]}'}: {_tail(logs[silent[0]])}")
    launcher = (log_dir / "launcher.log").read_text(encoding="utf-8", errors="replace")
    return f"training failed (launcher exit code {code}); logs in {log_dir}: {_tail(launcher)}"


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def join_main(argv: list[str] | None = None) -> None:
    """``train-deploy-join``: run this machine's share of a multi-node job started by ``kedro run``."""
    parser = argparse.ArgumentParser(description=join_main.__doc__)
    parser.add_argument("--run", required=True, help="run.json of the job (in its log folder, on shared storage)")
    parser.add_argument("--node-rank", type=int, required=True, help="this machine's rank, 1 .. nnodes - 1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = read_json(RunSpec, Path(args.run))
    run_launcher(TrainingConfig.from_params(spec.training), Path(args.run), Path(spec.logs), node_rank=args.node_rank)
