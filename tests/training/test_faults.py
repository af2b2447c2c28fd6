"""Faults and multi-node: a killed worker fails the job promptly; two launchers form one job."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time

import numpy as np
import psutil
import pytest

from tests.helpers.training import launch, losses, training_params
from train_deploy.training.launch import TrainingFailed

pytestmark = pytest.mark.slow


def _worker(rank: int, timeout: float = 120.0) -> psutil.Process:
    """The training process of ``rank`` among this test's descendants, once it has started stepping."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in psutil.Process().children(recursive=True):
            try:
                if "worker.py" in " ".join(process.cmdline()) and \
                        process.environ().get("PADDLE_TRAINER_ID") == str(rank):
                    return process
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} appeared")


def test_killed_worker_fails_the_job_within_a_minute_and_a_rerun_completes(tmp_path, tiny_tokens):
    params = training_params(2, parallel={"dp": 2}, schedule={"max_steps": 400, "checkpoint_every": 2})
    outcome: dict = {}

    def run() -> None:
        try:
            launch(tmp_path, tiny_tokens, params)
        except TrainingFailed as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    victim = _worker(1)
    while not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").glob("step_*")):
        time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=90)
    assert not thread.is_alive(), "the job hung after a worker died"
    assert "error" in outcome
    assert outcome["at"] - killed_at < 60
    assert str(outcome["error"]).startswith("training worker rank 1 died without an error (killed")

    params["schedule"]["max_steps"] = 8  # the rerun resumes from the last complete checkpoint
    result = launch(tmp_path, tiny_tokens, params)
    assert result.finished and result.step == 8
    assert "Resumed from" in (tmp_path / "logs" / "node0" / "workerlog.0").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_as_two_nodes_match_data_parallel(tmp_path, tiny_tokens, dp2_run):
    single = dp2_run  # one launcher, two processes (the session's)
    master = f"127.0.0.1:{_free_port()}"
    results: dict = {}

    def node(rank: int) -> None:
        params = training_params(1, parallel={"dp": 2},
                                 launch={"nnodes": 2, "master": master, "node_rank": rank, "job_id": "two_nodes"})
        try:
            results[rank] = launch(tmp_path / "nodes", tiny_tokens, params) if rank == 0 else \
                _join(tmp_path / "nodes", tiny_tokens, params, rank)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[rank] = exc

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not isinstance(results.get(0), Exception), results
    assert results[0].layout["dp"] == 2
    np.testing.assert_allclose(losses(tmp_path / "nodes"), losses(single), rtol=1e-5)


def _join(folder, data, params, rank):
    """What `train-deploy-join --run run.json --node-rank 1` does on the second machine."""
    from train_deploy.training.launch import join_main

    run_file = folder / "logs" / "run.json"
    while not run_file.exists():
        time.sleep(0.1)
    join_main(["--run", str(run_file), "--node-rank", str(rank)])
    return {"joined": rank}


def test_a_worker_that_raises_is_named_with_its_error(tmp_path, tiny_tokens):
    data = dataclasses.replace(tiny_tokens, valid_prefix=str(tmp_path / "missing"),
                               train_prefix=str(tmp_path / "nothing"))
    with pytest.raises(TrainingFailed) as exc:
        launch(tmp_path, data, training_params(1))
    message = str(exc.value)
    assert message.startswith("training worker rank 0 failed (launcher exit code")
    assert "nothing.bin" in message


def test_with_max_restart_the_launcher_restarts_workers_and_they_resume(tmp_path, tiny_tokens):
    params = training_params(2, parallel={"dp": 2},
                             schedule={"max_steps": 40, "checkpoint_every": 2}, launch={"max_restart": 1})
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=launch(tmp_path, tiny_tokens, params)))
    thread.start()
    victim = _worker(1)
    while not any((tmp_path / "checkpoints").glob("step_*")) if (tmp_path / "checkpoints").exists() else True:
        time.sleep(0.2)
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=240)
    assert not thread.is_alive()
    assert outcome["result"].finished and outcome["result"].step == 40
    assert "Resumed from" in (tmp_path / "logs" / "node0" / "workerlog.0").read_text()


def test_a_killed_worker_is_named_from_the_launcher_log_when_its_peers_were_stopped_before_noticing(tmp_path):
    from train_deploy.training.launch import _failure_message

    for rank in (0, 1):  # neither log has an error: rank 0 was stopped (SIGTERM) while it waited in a collective
        (tmp_path / f"workerlog.{rank}").write_text(f"step 2  loss 7.6\nrank {rank} last line\n")
    (tmp_path / "launcher.log").write_text(
        "LAUNCH ERROR 2026-12-01 21:07:19,994 Container failed !!!\nContainer rank 1 status failed cmd ['python', "
        "'-u', 'worker.py'] code -9 log /logs/workerlog.1\nLAUNCH INFO Exit code -15\n")
    assert _failure_message(tmp_path, 241) == (
        "training worker rank 1 died without an error (killed by SIGKILL: out of memory, or a kill; launcher exit "
        f"code 241); the launcher stopped the other ranks. {tmp_path / 'workerlog.1'}: step 2  loss 7.6 | rank 1 "
        "last line")
    (tmp_path / "launcher.log").write_text("LAUNCH INFO Exit code 1\n")  # no container named: the logs alone
    assert _failure_message(tmp_path, 1).startswith("training failed (launcher exit code 1); logs in")
