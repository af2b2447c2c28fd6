"""Elastic training (``training.launch.elastic``) on Paddle's launcher with a real etcd on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from tests.helpers.etcd import etcd  # noqa: F401  (the fixture)
from tests.helpers.training import launch, run_spec, training_params
from tests.mlflow_server import free_port
from train_deploy.config import ConfigError
from train_deploy.handoffs import DataSpec, write_json
from train_deploy.run_control.processes import stop_process_tree
from train_deploy.training.config import Layout, TrainingConfig
from train_deploy.training.elastic import FORMATIONS_FILE, ElasticConfig, check_layout
from train_deploy.training.launch import (
    check_elastic,
    join_main,
    launcher_command,
    run_training,
    worker_environment,
)
from train_deploy.training.spec import RunSpec
from train_deploy.training.worker import micro_batch_start

pytest_plugins = ["tests.mlflow_server"]


def _etcd3(url: str, code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` with an ``etcd3`` client ``c`` of ``url`` in a fresh interpreter (protobuf's implementation is
    chosen once per process, at its first import)."""
    host, port = url.removeprefix("etcd://").split(":")
    script = f"import etcd3\nc = etcd3.client(host={host!r}, port={port})\n{code}"
    variables = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**variables, **env})


def test_etcd_fixture_serves_the_client_paddle_imports(etcd):  # noqa: F811
    """The fixture's etcd answers the ``etcd3`` client Paddle's ETCDMaster imports, with the launcher's setting."""
    done = _etcd3(etcd, "c.put('/train_deploy/probe', b'42')\nprint(c.get('/train_deploy/probe')[0].decode())",
                  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    assert (done.returncode, done.stdout.strip()) == (0, "42"), done.stderr[-2000:]


def test_etcd3_needs_the_python_protobuf_setting(etcd):  # noqa: F811
    """Without PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, etcd3 0.12's generated code does not import: the
    reason the elastic launcher's environment sets it."""
    done = _etcd3(etcd, "print('imported')")
    assert done.returncode != 0 and "Descriptors cannot be created directly" in done.stderr, done.stderr[-2000:]


# --- part 1: elastic mode by configuration ---------------------------------------------------------------------


def _spec(tmp_path: Path, elastic: dict | None, **blocks) -> RunSpec:
    data = DataSpec(train_prefix=str(tmp_path / "train"), valid_prefix=str(tmp_path / "valid"), dtype="uint16",
                    vocab_size=512, eos_id=2, corpus_fingerprint="c", tokenizer_hash="t")
    launch = {"nproc_per_node": 1, "elastic": elastic, **blocks.pop("launch", {})}
    config = TrainingConfig.from_params(training_params(1, launch=launch, **blocks))
    layout = Layout(dp=1, mp=1, pp=1, sharding_stage=0, accumulation_steps=2)  # the launch checks its own
    return RunSpec(run_name="elastic", training=config, layout=layout, data=data,
                   checkpoints=str(tmp_path / "checkpoints"), logs=str(tmp_path / "logs"))


def test_elastic_job_launches_under_paddles_etcd_master(tmp_path):
    """Every node's launcher gets Paddle's elastic arguments, no rank (etcd orders the nodes), and the protobuf
    setting etcd3 needs; without elastic neither."""
    spec = _spec(tmp_path, {"min_nodes": 1, "max_nodes": 3, "etcd": "etcd://10.0.0.5:2379", "timeout_s": 12})
    command = launcher_command(spec.training, tmp_path / "run.json", tmp_path / "logs")
    start = command.index("--master")
    assert command[start:start + 8] == ["--master", "etcd://10.0.0.5:2379", "--nnodes", "1:3",
                                        "--elastic_level", "1", "--elastic_timeout", "12"]
    assert "--rank" not in command
    assert worker_environment(spec.training)["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] == "python"
    plain = _spec(tmp_path, None).training
    assert "--master" not in launcher_command(plain, tmp_path / "run.json", tmp_path / "logs")
    assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" not in worker_environment(plain)


def test_elastic_block_has_its_defaults_and_refuses_unknown_keys(tmp_path):
    assert _spec(tmp_path, {}).training.launch.elastic == ElasticConfig(
        min_nodes=1, max_nodes=2, etcd="etcd://127.0.0.1:2379", timeout_s=30)
    with pytest.raises(ConfigError, match=r"^training\.launch\.elastic"):
        _spec(tmp_path, {"min_node": 1})


# --- part 2: refusals before launch ----------------------------------------------------------------------------


def test_elastic_refuses_pipeline_parallel():
    with pytest.raises(ConfigError) as refused:
        check_layout(ElasticConfig(), pp=2, mp=1, dp=-1, nproc_per_node=1, nnodes=1)
    assert str(refused.value) == ("training.parallel.pp: elastic training cannot run pipeline parallel (pp = 2): a "
                                  "lost node takes whole stages with it; set pp: 1 or training.launch.elastic: null")


@pytest.mark.parametrize(("blocks", "message"), [
    ({"parallel": {"mp": 2}, "launch": {"nproc_per_node": 1}},
     "training.parallel.mp: mp = 2 spans nodes (launch.nproc_per_node = 1); elastic training needs model parallel "
     "within a node, since a lost node takes shards of every layer with it"),
    ({"parallel": {"dp": 2}, "launch": {"nproc_per_node": 2}},
     "training.parallel.dp: is fixed at 2, but elastic training changes the data-parallel degree with the nodes; "
     "set dp: -1 (inferred)"),
    ({"batch": {"micro_batch_size": 4, "global_batch_size": 8}, "elastic": {"max_nodes": 3}},
     "training.batch.global_batch_size: 8 is not a multiple of micro_batch_size × dp = 4 × 3 = 12 "
     "(training.launch.elastic: at world size 3, which the job may re-form at)"),
    ({"elastic": {"min_nodes": 3, "max_nodes": 2}},
     "training.launch.elastic.max_nodes: 2 is below min_nodes = 3; raise it or lower min_nodes"),
    ({"elastic": {"etcd": "etcd://alice:S3cret@127.0.0.1:1"}},
     "training.launch.elastic.etcd: etcd://127.0.0.1:1 is not etcd://HOST:PORT (Paddle's launcher takes no "
     "credentials, path or TLS)"),
])
def test_elastic_refusals_are_one_line_before_launch(tmp_path, blocks, message):
    """Each refusal comes from run_training before the launcher starts (no run.json is written)."""
    elastic = {"etcd": "etcd://127.0.0.1:1", **blocks.pop("elastic", {})}
    spec = _spec(tmp_path, elastic, **blocks)
    with pytest.raises(ConfigError) as refused:
        run_training(spec)
    assert str(refused.value) == message
    assert not (Path(spec.logs) / "run.json").exists()


def test_elastic_refuses_an_etcd_nobody_answers_at(tmp_path):
    spec = _spec(tmp_path, {"etcd": f"etcd://127.0.0.1:{free_port()}"})
    with pytest.raises(ConfigError) as refused:
        check_elastic(spec)
    assert str(refused.value) == (f"training.launch.elastic.etcd: cannot reach {spec.training.launch.elastic.etcd} "
                                  "(Connection refused); start etcd there or correct the URL")


@pytest.mark.parametrize("rank", ["0", "3"])
def test_a_joining_node_names_itself_below_max_nodes(tmp_path, capsys, rank):
    """With elastic, train-deploy-join takes --node-rank 1 .. max_nodes - 1 (it names the node's log folder)."""
    spec = _spec(tmp_path, {"max_nodes": 3})
    write_json(tmp_path / "run.json", spec)
    with pytest.raises(SystemExit) as refused:
        join_main(["--run", str(tmp_path / "run.json"), "--node-rank", rank])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        f"train-deploy-join: --node-rank {rank}: the job has training.launch.elastic.max_nodes = 3, so the other "
        "machines join as 1 .. 2 (node 0 runs kedro run)\n")


def test_elastic_accepts_a_reachable_etcd(tmp_path, etcd):  # noqa: F811
    check_elastic(_spec(tmp_path, {"etcd": etcd, "max_nodes": 2}))


# --- part 3: the same training whatever the world size ---------------------------------------------------------


def _samples_of_step(consumed: int, layout: Layout, micro: int) -> list[int]:
    """Every sample index the ranks of ``layout`` read for the global batch starting at ``consumed``."""
    return [micro_batch_start(consumed, k, rank, layout, micro) + i for k in range(layout.accumulation_steps)
            for rank in range(layout.dp) for i in range(micro)]


def test_data_order_is_the_same_across_re_forms():
    """A run that re-forms 2 -> 1 -> 4 data-parallel ranks (resuming each time from its last checkpoint, the steps
    after it thrown away) reads every sample of the epoch once and in the same global batches as a run that never
    re-formed: the worker's micro_batch_start is a pure function of the global batch, not of the world size."""
    micro, global_batch, epoch_steps = 2, 8, 12

    def layout(dp: int) -> Layout:
        return Layout(dp=dp, mp=1, pp=1, sharding_stage=0, accumulation_steps=global_batch // (micro * dp))

    # (data-parallel degree, first step, last step run, step of the checkpoint it is resumed from next)
    formations = [(2, 0, 5, 4), (1, 4, 9, 8), (4, 8, epoch_steps, epoch_steps)]
    kept: dict[int, list[int]] = {}
    for dp, first, last, checkpoint in formations:
        for step in range(first, last):
            batch = _samples_of_step(step * global_batch, layout(dp), micro)  # consumed_samples = step × batch
            if step < checkpoint:
                kept[step] = batch
    reference = {step: _samples_of_step(step * global_batch, layout(1), micro) for step in range(epoch_steps)}
    assert {step: sorted(batch) for step, batch in kept.items()} == reference
    everything = sorted(i for batch in kept.values() for i in batch)
    assert everything == list(range(epoch_steps * global_batch))
    assert _samples_of_step(0, layout(2), micro) == [0, 1, 2, 3, 4, 5, 6, 7]  # k=0: ranks 0,1; k=1: ranks 0,1


# --- part 3: real elastic runs on CPU ---------------------------------------------------------------------------

REFORM_STEPS = 300  # tiny model, 8 windows of 64 tokens a step: the run at one node must outlast a join


def _formations(logs: Path) -> list[dict]:
    path = logs / FORMATIONS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


class _Node:
    """A further machine of the job: Paddle's launcher as ``train-deploy-join`` starts it, in a session of its own."""

    def __init__(self, spec: RunSpec, spec_file: Path, rank: int) -> None:
        command = launcher_command(spec.training, spec_file, Path(spec.logs), node_rank=rank)
        self.log = open(Path(spec.logs) / f"node{rank}.launcher.log", "w")  # noqa: SIM115 - closed by stop()
        self.launcher = subprocess.Popen(command, env=worker_environment(spec.training), stdin=subprocess.DEVNULL,
                                         stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """The machine is gone: SIGKILL to the launcher's process group and to every worker it started (Paddle
        gives each worker a session of its own)."""
        processes = [self.launcher.pid, *(p.pid for p in psutil.Process(self.launcher.pid).children(recursive=True))]
        os.killpg(self.launcher.pid, signal.SIGKILL)
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.launcher.wait(30)

    def stop(self) -> None:
        if self.launcher.poll() is None:
            stop_process_tree(self.launcher, 10.0)
        self.log.close()


@pytest.mark.slow
def test_lost_node_re_forms_at_one_and_a_joining_node_is_taken_in(tmp_path, tiny_tokens, etcd,  # noqa: F811
                                                                   mlflow_server, monkeypatch):
    """Two nodes (--nnodes 1:2); one is SIGKILLed after the first checkpoint: the other re-forms at world size 1
    and resumes from the newest complete checkpoint; a third node joins and the job re-forms at 2 and finishes.
    Each re-form is logged and reaches the MLflow run (world sizes, the step resumed from, its time)."""
    params = training_params(1, batch={"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 64},
                             schedule={"max_steps": REFORM_STEPS, "log_every": 20, "eval_every": REFORM_STEPS,
                                       "eval_batches": 1, "checkpoint_every": 10, "keep_last": 2},
                             launch={"elastic": {"min_nodes": 1, "max_nodes": 2, "etcd": etcd, "timeout_s": 5},
                                     "max_restart": 5, "job_id": "elastic_test"})
    spec = run_spec(tmp_path, tiny_tokens, params)
    logs, checkpoints = Path(spec.logs), Path(spec.checkpoints)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    mlflow.set_tracking_uri(mlflow_server.uri)
    run_id = mlflow.MlflowClient().create_run(experiment_id="0").info.run_id
    outcome: dict = {}
    node0 = threading.Thread(target=lambda: outcome.update(result=run_training(spec, mlflow_run_id=run_id)))
    # Node 1 starts first, from the run.json node 0 is about to write: a launcher alone for timeout_s forms alone.
    logs.mkdir(parents=True, mode=0o700)
    write_json(logs / "run.json", spec)
    nodes = [_Node(spec, logs / "run.json", 1)]
    node0.start()
    try:
        _wait_for(lambda: any(checkpoints.glob("step_*")), 240, "no checkpoint at world size 2")
        assert [f["world_size"] for f in _formations(logs)] == [2]
        nodes[0].kill()
        outcome["newest_at_kill"] = max(int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*"))
        _wait_for(lambda: len(_formations(logs)) == 2, 240, "no re-form after the lost node")
        nodes.append(_Node(spec, logs / "run.json", 2))
        _wait_for(lambda: len(_formations(logs)) == 3, 240, "no re-form with the joining node")
        node0.join(600)
    finally:
        for node in nodes:
            node.stop()
        node0.join(60)
        mlflow.set_tracking_uri(None)
    formations = _formations(logs)
    assert [f["world_size"] for f in formations] == [2, 1, 2]
    saved = sorted(int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*"))
    # each re-form resumed from a checkpoint written before it (every 10 steps), the first at or after the kill's
    assert formations[1]["step"] >= outcome["newest_at_kill"] > 0 and formations[1]["step"] % 10 == 0
    assert formations[2]["step"] >= formations[1]["step"] and formations[2]["step"] % 10 == 0
    assert outcome["result"].finished and outcome["result"].step == REFORM_STEPS and saved[-1] == REFORM_STEPS
    assert nodes[1].launcher.returncode == 0
    client = mlflow.MlflowClient(mlflow_server.uri)
    sizes = {m.step: m.value for m in client.get_metric_history(run_id, "train.elastic_world_size")}
    previous = {m.step: m.value for m in client.get_metric_history(run_id, "train.elastic_previous_world_size")}
    assert sizes == {formations[1]["step"]: 1.0, formations[2]["step"]: 2.0}
    assert previous == {formations[1]["step"]: 2.0, formations[2]["step"]: 1.0}
    times = [m.value for m in client.get_metric_history(run_id, "train.elastic_reform_time")]
    assert sorted(times) == pytest.approx([formations[1]["time"], formations[2]["time"]])
    # The same samples in every step and the same schedule as a run that never re-formed: the validation loss
    # differs only by the order of float sums (gloo's all-reduce against accumulation, re-taken steps).
    uninterrupted = launch(tmp_path / "uninterrupted", tiny_tokens, {**params, "launch": {"nproc_per_node": 1}})
    assert outcome["result"].val_loss == pytest.approx(uninterrupted.val_loss, rel=1e-6)
    worker_log = (logs / "node0" / "workerlog.0").read_text()
    assert "Elastic re-form 1: world size 2 -> 1, resumed from step" in worker_log + (
        logs / "node2" / "workerlog.0").read_text()
