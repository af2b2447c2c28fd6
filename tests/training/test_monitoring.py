"""training.monitoring: VisualDL scalars from rank 0 read back by VisualDL itself, its server, MLflow system metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.mlflow_server import free_port, mlflow_server  # noqa: F401
from train_deploy.config import ConfigError
from train_deploy.training.config import TrainingConfig
from train_deploy.training.monitoring import SCALARS, MonitoringConfig, monitored_training

pytestmark = pytest.mark.slow


def _metrics(run_logs: Path) -> list[dict]:
    return [json.loads(line) for line in (run_logs / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def test_rank_0_writes_every_reported_metric_as_visualdl_scalars_that_visualdl_reads_back(tiny_run):
    from visualdl import LogReader

    logs = Path(tiny_run.checkpoints).parent / "logs"
    records = list((logs / "visualdl").glob("vdlrecords.*"))
    assert len(records) == 1  # rank 0 alone
    reader = LogReader(file_path=str(records[0]))
    assert set(reader.get_tags()["scalar"]) == set(SCALARS.values())
    written = _metrics(logs)
    for name, tag in SCALARS.items():
        expected = [(row["step"], row[name]) for row in written if name in row]
        found = [(record.id, record.value) for record in reader.get_data("scalar", tag)]
        assert [step for step, _ in found] == [step for step, _ in expected], tag
        assert [value for _, value in found] == pytest.approx([value for _, value in expected], rel=1e-6), tag
    assert [r.id for r in reader.get_data("scalar", "train/val_loss")] == [3, 6]  # eval_every: 3


def test_make_visualdl_serves_the_runs_on_127_0_0_1_and_prints_the_url(tiny_run):
    logs = Path(tiny_run.checkpoints).parent / "logs"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "train_deploy.training.monitoring", "--logdir", str(logs),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline() == f"VisualDL: http://127.0.0.1:{port}/ (logs under {logs})\n"
        api = f"http://127.0.0.1:{port}/app/api"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{api}/runs", timeout=5) as answer:
                    runs = json.load(answer)["data"]
                break
            except OSError:
                assert time.monotonic() < deadline, "VisualDL did not answer within 60 s"
                time.sleep(0.5)
        assert runs == [str(logs / "visualdl")]  # VisualDL names a run by its folder
        query = urllib.parse.urlencode({"run": runs[0], "tag": "train/loss"})
        with urllib.request.urlopen(f"{api}/scalar/list?{query}", timeout=10) as answer:
            points = json.load(answer)["data"]
        assert [point[1] for point in points] == [row["step"] for row in _metrics(logs)]
    finally:
        server.terminate()
        server.wait(timeout=15)


def test_visualdl_without_a_log_folder_says_to_train_first(tmp_path):
    done = subprocess.run([sys.executable, "-m", "train_deploy.training.monitoring", "--logdir",
                           str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Error: --logdir: not a folder; train first (make run), or name the training log folder" in done.stderr


def test_the_training_run_gets_system_metrics_and_the_visualdl_folder(mlflow_server, tmp_path):  # noqa: F811
    import mlflow

    mlflow.set_tracking_uri(mlflow_server.uri)
    mlflow.set_experiment("monitoring")  # not an experiment id an earlier test of this worker left active
    board = tmp_path / "logs" / "visualdl"
    board.mkdir(parents=True)
    (board / "vdlrecords.train.log").write_bytes(b"records")
    with mlflow.start_run() as run:
        with monitored_training(MonitoringConfig(system_metrics_interval=0.5), run.info.run_id, tmp_path / "logs"):
            time.sleep(2.5)
    client = mlflow.MlflowClient()
    metrics = client.get_run(run.info.run_id).data.metrics
    for name in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                 "system/disk_usage_percentage", "system/network_receive_megabytes"):
        assert name in metrics
    assert len(client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")) >= 2
    assert client.get_run(run.info.run_id).data.tags["visualdl.logdir"] == str(board.resolve())
    assert [a.path for a in client.list_artifacts(run.info.run_id, "visualdl")] == ["visualdl/vdlrecords.train.log"]


def test_with_both_off_the_run_gets_neither(mlflow_server, tmp_path):  # noqa: F811
    import mlflow

    mlflow.set_tracking_uri(mlflow_server.uri)
    mlflow.set_experiment("monitoring")  # not an experiment id an earlier test of this worker left active
    (tmp_path / "logs" / "visualdl").mkdir(parents=True)
    (tmp_path / "logs" / "visualdl" / "vdlrecords.train.log").write_bytes(b"records")
    off = MonitoringConfig(visualdl=False, system_metrics=False, system_metrics_interval=0.5)
    with mlflow.start_run() as run:
        with monitored_training(off, run.info.run_id, tmp_path / "logs"):
            time.sleep(1.5)
    client = mlflow.MlflowClient()
    assert not [name for name in client.get_run(run.info.run_id).data.metrics if name.startswith("system/")]
    assert client.list_artifacts(run.info.run_id) == []


def test_the_monitoring_block_has_its_defaults_and_refuses_what_is_not_a_setting():
    assert TrainingConfig.from_params({}).monitoring == MonitoringConfig(visualdl=True, system_metrics=True,
                                                                         system_metrics_interval=10.0)
    with pytest.raises(ConfigError,
                       match=r"^training\.monitoring\.system_metrics_interval: must be positive \(got 0\)$"):
        TrainingConfig.from_params({"monitoring": {"system_metrics_interval": 0}})
    with pytest.raises(ConfigError, match=r"^training\.monitoring\.board: unknown key"):
        TrainingConfig.from_params({"monitoring": {"board": True}})


def test_of_two_workers_only_rank_0_writes_visualdl_logs(dp2_run):
    from visualdl import LogReader

    records = list((dp2_run / "logs" / "visualdl").glob("vdlrecords.*"))
    assert len(records) == 1
    reader = LogReader(file_path=str(records[0]))
    assert [r.id for r in reader.get_data("scalar", "train/loss")] == [1, 2, 3, 4, 5, 6]  # once per step, not twice
