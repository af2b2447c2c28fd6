"""Elastic training (``training.launch.elastic``) on Paddle's launcher with a real etcd on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.etcd import etcd  # noqa: F401  (the fixture)
from tests.helpers.training import training_params
from tests.mlflow_server import free_port
from train_deploy.config import ConfigError
from train_deploy.handoffs import DataSpec
from train_deploy.training.config import Layout, TrainingConfig
from train_deploy.training.elastic import ElasticConfig, check_layout
from train_deploy.training.launch import check_elastic, launcher_command, run_training, worker_environment
from train_deploy.training.spec import RunSpec


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


def test_elastic_accepts_a_reachable_etcd(tmp_path, etcd):  # noqa: F811
    check_elastic(_spec(tmp_path, {"etcd": etcd, "max_nodes": 2}))
