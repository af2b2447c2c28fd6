"""The team tracking server with MLflow's authentication (``mlflow server --app-name basic-auth``), as the README
sets it up: a run without accepted credentials stops as it starts with one line; a member's credentials come from
the environment or ``conf/local/credentials.yml`` and are written nowhere."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from kedro.framework.session import KedroSession

from tests.helpers.project import tiny_runtime_params
from tests.mlflow_server import MlflowAuthServer, MlflowServer, User, free_port
from train_deploy.run_control.preflight import CREDENTIAL_VARIABLES, TrackingServerError, check_tracking_server

pytest_plugins = ["tests.mlflow_server"]
pytestmark = pytest.mark.slow

REFUSED_WITHIN_S = 10  # the check is one request; the rest is a Kedro session starting on 2 busy cores
HOW_TO_AUTHENTICATE = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the "
                       "environment, or server.credentials in conf/local/mlflow.yml naming an entry of "
                       "conf/local/credentials.yml that holds them")


def _run(project: Path, pipelines: list[str], params: dict | None = None) -> None:
    with KedroSession.create(project_path=project, runtime_params=params or tiny_runtime_params()) as session:
        session.run(pipeline_names=pipelines)


def _client_as(user: User | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment a client runs in: ``user``'s credentials, or none."""
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if user is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user.username)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", user.password)


def _refusal(project: Path) -> str:
    started = time.monotonic()
    with pytest.raises(TrackingServerError) as refused:
        _run(project, ["corpus"])
    assert time.monotonic() - started < REFUSED_WITHIN_S
    assert "\n" not in str(refused.value)
    return str(refused.value)


def _written(*roots: Path) -> list[Path]:
    return [path for root in roots for path in root.rglob("*") if path.is_file()]


def _tiny_corpus_and_training_params() -> dict:
    params = tiny_runtime_params()
    params["training"] = {
        "model": {"preset": "tiny"},
        "batch": {"micro_batch_size": 4, "global_batch_size": 4, "seq_length": 32},
        "schedule": {"max_steps": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2},
        "launch": {"nproc_per_node": 1},
    }
    return params


def test_a_run_without_accepted_credentials_stops_as_it_starts_with_one_line(
        project: Path, mlflow_auth_server: MlflowAuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    alice = server.create_user("alice")

    _client_as(None, monkeypatch)
    assert _refusal(project) == f"MLflow tracking server {server.uri} refused no credentials (HTTP 401): " \
                                f"{HOW_TO_AUTHENTICATE}"
    _client_as(User("alice", "not-" + alice.password), monkeypatch)
    assert _refusal(project) == f"MLflow tracking server {server.uri} refused user 'alice' (HTTP 401): " \
                                f"{HOW_TO_AUTHENTICATE}"
    _client_as(server.admin, monkeypatch)
    admin = mlflow.MlflowClient(tracking_uri=server.uri)
    assert admin.get_experiment_by_name("train_deploy") is None  # the refused runs never reached the store
    assert _written(project / "data") == []

    # The experiment exists and its manager took alice's permission away: refused by experiment, run-less.
    experiment_id = admin.create_experiment("train_deploy")
    from mlflow.server.auth.client import AuthServiceClient

    AuthServiceClient(server.uri).grant_user_permission("alice", "experiment", experiment_id, "DENY")
    _client_as(alice, monkeypatch)
    assert _refusal(project).startswith(
        f"MLflow tracking server {server.uri} refused user 'alice' access to experiment 'train_deploy' "
        "(HTTP 403: Permission denied): ask its admin for EDIT permission on it, or set MLFLOW_TRACKING_USERNAME")
    _client_as(server.admin, monkeypatch)
    assert admin.search_runs([experiment_id]) == []


def test_a_member_runs_with_credentials_from_the_environment_or_conf_local_and_they_are_written_nowhere(
        project: Path, mlflow_auth_server: MlflowAuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server = mlflow_auth_server
    alice = server.create_user("alice")
    params = _tiny_corpus_and_training_params()

    # A scheduler's environment holds the credentials.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    _client_as(alice, monkeypatch)
    _run(project, ["corpus", "training"], params)

    # A member's machine: the server and the name of the credentials in conf/local/mlflow.yml (the whole server
    # block: a file of conf/local replaces conf/base's top-level keys), the credentials in conf/local/credentials.yml.
    _client_as(None, monkeypatch)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    local = project / "conf" / "local"
    (local / "mlflow.yml").write_text(yaml.safe_dump({"server": {
        "mlflow_tracking_uri": server.uri, "mlflow_registry_uri": None, "credentials": "mlflow_team"}}))
    credentials = local / "credentials.yml"
    credentials.write_text(yaml.safe_dump({"mlflow_team": {
        "MLFLOW_TRACKING_USERNAME": alice.username, "MLFLOW_TRACKING_PASSWORD": alice.password}}))
    _run(project, ["corpus", "training"], params)

    _client_as(alice, monkeypatch)
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    runs = client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id],
                              order_by=["attributes.start_time ASC"])
    assert [run.info.status for run in runs] == ["FINISHED", "FINISHED"]
    assert [run.data.metrics["corpus.reused"] for run in runs] == [0.0, 1.0]
    first = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(first, "train.loss")] == [1, 2]  # the node's forwarder too
    assert any(path.name == "token_manifest.json" and first in path.parts for path in _written(server.artifacts))

    written = [path for path in _written(project, server.root) if path != credentials]
    assert any(path.name.startswith("envlog.") for path in written)  # the launcher's dump of its environment
    assert [path for path in written if alice.password.encode() in path.read_bytes()] == []
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == alice.password  # exported into this process, and only there


def test_credentials_naming_no_entry_of_credentials_yml_stop_the_run_with_one_line(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    (project / "conf" / "local" / "mlflow.yml").write_text(
        "server:\n  mlflow_tracking_uri: ${oc.env:MLFLOW_TRACKING_URI}\n  credentials: mlflow_team\n")
    assert _refusal(project) == (
        "server.credentials: 'mlflow_team' is not an entry of conf/<env>/credentials.yml (a mapping of variables, "
        "e.g. MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD); add it to conf/local/credentials.yml")


def test_a_server_that_refuses_the_host_name_is_named_with_its_allowed_hosts_option(
        mlflow_server: MlflowServer) -> None:
    other_name = f"http://127.1:{mlflow_server.port}"  # 127.0.0.1 by another name, not in --allowed-hosts
    with pytest.raises(TrackingServerError) as refused:
        check_tracking_server(other_name, "train_deploy")
    assert str(refused.value) == (
        f"MLflow tracking server {other_name} refused the host name in the URI (HTTP 403: Invalid Host header - "
        f"possible DNS rebinding attack detected): start it with --allowed-hosts naming 127.1:{mlflow_server.port}, "
        "or use a name it allows")
    check_tracking_server(mlflow_server.uri, "train_deploy")  # its own name passes
