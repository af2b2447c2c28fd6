"""Wall time of an elastic re-form on this machine: a node lost, the survivor re-formed; a node joining.

    .venv/bin/python benchmarks/bench_elastic_reform.py               # timeout_s 5, as the slow test
    .venv/bin/python benchmarks/bench_elastic_reform.py --timeout-s 10

A real etcd (Debian's etcd-server) on 127.0.0.1 and two nodes, each Paddle's elastic launcher with one CPU worker
(``--nnodes 1:2``), the tiny model on the embedded corpus. After the first checkpoint node 1 is SIGKILLed (its
launcher and worker, as a machine that is gone); then a third node joins. Printed, in seconds:

- kill -> restart: until the survivor's launcher has started a new worker (its lease expiry and ``timeout_s``);
- restart -> training: until that worker has built the model, resumed and recorded the formation (``time`` in
  ``elastic_formations.jsonl``, written just before its first step);
- join: from the joining launcher's start to the formation at world size 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from bench_train import prepare_tokens  # noqa: E402  (the embedded corpus's token files, kept when unchanged)
from tests.helpers.etcd import etcd_server  # noqa: E402

from train_deploy.handoffs import write_json  # noqa: E402
from train_deploy.run_control.processes import stop_process_tree  # noqa: E402
from train_deploy.training.elastic import FORMATIONS_FILE  # noqa: E402
from train_deploy.training.launch import launcher_command, worker_environment  # noqa: E402
from train_deploy.training.spec import run_spec  # noqa: E402

logger = logging.getLogger("bench_elastic_reform")
WORK = REPO / "benchmarks" / ".work" / "elastic"


def _params(etcd: str, timeout_s: int) -> dict:
    return {"model": {"preset": "tiny"},
            "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 64},
            "schedule": {"max_steps": 100_000, "log_every": 20, "eval_every": 100_000, "eval_batches": 1,
                         "checkpoint_every": 10, "keep_last": 2},
            "launch": {"elastic": {"min_nodes": 1, "max_nodes": 2, "etcd": etcd, "timeout_s": timeout_s},
                       "max_restart": 5, "job_id": "bench_elastic"}}


def _start(spec, spec_file: Path, rank: int) -> subprocess.Popen:
    command = launcher_command(spec.training, spec_file, Path(spec.logs), node_rank=rank)
    with open(Path(spec.logs) / f"node{rank}.launcher.log", "w") as log:
        return subprocess.Popen(command, env=worker_environment(spec.training), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _formations(logs: Path) -> list[dict]:
    path = logs / FORMATIONS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _workers(launcher: subprocess.Popen) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(launcher.pid).children(recursive=True) if "worker.py" in " ".join(
            p.cmdline())}
    except psutil.Error:
        return set()


def _wait(condition, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(0.1)
    return time.time()


def _kill(launcher: subprocess.Popen) -> None:
    """The machine is gone: SIGKILL to the launcher's group and to every worker (each has a session of its own)."""
    pids = [launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(30)


def measure(timeout_s: int) -> dict[str, float]:
    """One run: the kill -> restart, restart -> training and join times, in seconds."""
    data = prepare_tokens()
    with etcd_server(WORK / "etcd") as etcd:
        spec = run_spec(WORK / "run", data, _params(etcd, timeout_s))
        logs, checkpoints = Path(spec.logs), Path(spec.checkpoints)
        logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json(logs / "run.json", spec)
        nodes = [_start(spec, logs / "run.json", 1), _start(spec, logs / "run.json", 0)]
        try:
            _wait(lambda: any(checkpoints.glob("step_*")) and _formations(logs), 300, "no first checkpoint")
            before = _workers(nodes[1])
            killed = time.time()
            _kill(nodes[0])
            restarted = _wait(lambda: _workers(nodes[1]) - before, 120, "no restart on the survivor")
            _wait(lambda: len(_formations(logs)) == 2, 120, "no re-form at world size 1")
            training = _formations(logs)[1]["time"]
            joined_at = time.time()
            nodes.append(_start(spec, logs / "run.json", 2))
            _wait(lambda: len(_formations(logs)) == 3, 180, "no re-form with the joining node")
            joined = _formations(logs)[2]["time"]
        finally:
            for node in nodes:
                if node.poll() is None:
                    stop_process_tree(node, 10.0)
    return {"kill_to_restart_s": restarted - killed, "restart_to_training_s": training - restarted,
            "join_s": joined - joined_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=int, default=5, help="training.launch.elastic.timeout_s")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    figures = measure(args.timeout_s)
    logger.info("| timeout_s | kill -> restart | restart -> training | join |")
    logger.info("|---|---|---|---|")
    logger.info("| %d | %.1f s | %.1f s | %.1f s |", args.timeout_s, figures["kill_to_restart_s"],
                figures["restart_to_training_s"], figures["join_s"])


if __name__ == "__main__":
    main()
