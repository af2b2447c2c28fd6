"""docs/team-server.md, every command block run as written against a PostgreSQL cluster and mlflow server of the
module's own (tests/team/conftest.py): the accounts and their refusals, a project on the server, serving with the
tracking server down, PostgreSQL restarted under the gate, and backup, schema upgrade and restore (last: it stops
the server). The tests share the module's registry and run in this order."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.helpers.project import cli_params, copy_project, tiny_runtime_params
from tests.helpers.registry import GateProcess
from tests.helpers.retrain import _params as _retrain_params
from tests.helpers.retrain import _write_corpus
from tests.mlflow_server import MlflowServer, free_port
from tests.team.conftest import GUIDE, guide_blocks

pytestmark = pytest.mark.team
MODEL = "train_deploy_lm"
EVAL_SET = {"documents": 12, "max_chars": 60}
TEXTS = ["今天天气很好。", "我们一起去学校。"]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _status(url: str) -> int:
    try:
        with _OPENER.open(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _client(team, account: str) -> MlflowClient:
    """A client of the team server as ``account`` (MLflow reads the credentials from the environment)."""
    os.environ.update(team.guide.credentials(account))
    return MlflowClient(team.server.uri, team.server.uri)


def _aliases(team) -> dict[str, str]:
    model = _client(team, "admin").get_registered_model(MODEL)
    return {alias: str(version) for alias, version in model.aliases.items()}


def _registry(team, account: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``train-deploy-registry *args`` as ``account``, in its own process."""
    env = team.guide.environment(MLFLOW_TRACKING_URI=team.server.uri, **team.guide.credentials(account))
    return subprocess.run([str(Path(sys.executable).parent / "train-deploy-registry"), *args], env=env,
                          capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture(scope="module")
def gate(team, tmp_path_factory, tiny_bundle, tiny_run, tiny_token_files, tiny_tokenizer):
    """``gate(name, **registry)``: ``register_and_gate`` of the tiny bundle as the trainer, in a process of its
    own (GateProcess) against the team server; its decision."""
    from train_deploy.handoffs import Bundle
    from train_deploy.registry.evalset import validation_texts
    from train_deploy.registry.gate import version_tags

    texts = validation_texts(tiny_token_files, tiny_tokenizer, EVAL_SET["documents"], EVAL_SET["max_chars"])
    bundle = Bundle.read_folder(tiny_bundle)
    tags = version_tags(bundle, tiny_token_files, tiny_run, "0123abc")

    def run(name: str, during=None, **registry) -> dict[str, str]:
        saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        os.environ.update(team.guide.credentials("trainer"))  # GateProcess passes this process's environment on
        try:
            process = GateProcess(tmp_path_factory.mktemp(name) / "gate", team.server.uri, bundle,
                                  {"model_name": MODEL, "eval_set": EVAL_SET, **registry}, tags, texts)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        if during:
            during(process)
        return process.result()

    return run


@pytest.fixture(scope="module")
def two_versions(gate) -> tuple[str, str]:
    """Versions 1 and 2 of the tiny bundle, registered by the trainer: champion 2, previous 1."""
    first = gate("first")
    assert first["decision"] == "first", first
    second = gate("forced", force=True)
    assert second["decision"] == "forced", second
    return first["version"], second["version"]


def test_every_block_of_the_guide_is_run_by_this_module():
    source = Path(__file__).read_text(encoding="utf-8") + (Path(__file__).parent / "conftest.py").read_text()
    blocks = guide_blocks()
    assert {"databases", "auth-config", "server", "accounts", "project", "serving", "serve-local", "backup",
            "upgrade", "restore"} <= set(blocks)
    assert not [name for name in blocks if f'"{name}"' not in source]
    assert GUIDE.read_text().count("```bash") == len(blocks) + 1  # the settings block: the test sets its own


def test_the_server_refuses_a_client_without_credentials(team):
    assert _status(f"{team.server.uri}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert _status(f"{team.server.uri}/health") == 200


def test_roles_trainer_registers_server_reads_admin_rolls_back(team, two_versions):
    first, second = two_versions
    assert _aliases(team) == {"champion": second, "previous": first}

    refused = _registry(team, "server", "rollback")
    assert refused.returncode == 1, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "403" in refused.stderr and "EDIT" in refused.stderr and MODEL in refused.stderr, refused.stderr
    assert team.guide.password("server") not in refused.stderr
    assert _aliases(team) == {"champion": second, "previous": first}
    assert _registry(team, "server", "history").returncode == 0
    with pytest.raises(MlflowException, match="Permission denied"):
        _client(team, "server").set_registered_model_alias(MODEL, "champion", first)
    with pytest.raises(MlflowException, match="Permission denied"):
        _client(team, "server").create_model_version(MODEL, "models:/train_deploy_lm/1")

    rolled = _registry(team, "admin", "rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert _aliases(team) == {"champion": first, "previous": second}
    assert _registry(team, "trainer", "rollback").returncode == 0  # EDIT on the model: the trainer can too
    assert _aliases(team) == {"champion": second, "previous": first}


def test_a_project_runs_on_the_server_through_conf_team(team, project):
    # The guide's run is the corpus stage; this project copy's conf/team makes it a tiny one.
    (project / "conf" / "team" / "parameters_corpus.yml").write_text(yaml.safe_dump(tiny_runtime_params()))
    done = team.guide.run("project", cwd=project)
    assert "time (UTC)" in done.stdout, done.stdout  # the history, read by the trainer
    client = _client(team, "admin")
    runs = client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id])
    assert [run.info.status for run in runs] == ["FINISHED"]
    assert runs[0].info.artifact_uri.startswith("mlflow-artifacts:/"), runs[0].info.artifact_uri
    assert client.list_artifacts(runs[0].info.run_id)
    assert not (project / "mlartifacts").exists() and not (project / "mlruns.db").exists()


class _LocalServing(MlflowServer):
    """The guide's ``serve-local`` block, as a process group answering /health."""

    def __init__(self, team, folder: Path) -> None:
        super().__init__(folder, free_port())
        self.team = team

    def command(self) -> list[str]:
        return ["bash", "-euo", "pipefail", "-c", guide_blocks()["serve-local"]]

    def environment(self) -> dict[str, str]:
        return self.team.guide.environment(SERVE_PORT=str(self.port))


@pytest.fixture
def tracking_server_down(team) -> Iterator[None]:
    team.server.stop()
    try:
        yield
    finally:
        team.server.start(timeout=120)


def test_a_downloaded_champion_is_served_while_the_tracking_server_is_down(team, two_versions, tmp_path,
                                                                             tiny_bundle, request):
    from train_deploy.export.runtime import LanguageModel

    host = tmp_path / "serving_host"
    host.mkdir()
    team.guide.run("serving", cwd=host)
    request.getfixturevalue("tracking_server_down")
    assert not _answers(f"{team.server.uri}/health")
    serving = _LocalServing(team, host)
    serving.start(timeout=240)
    try:
        body = {"dataframe_split": {"columns": ["text"], "data": [[text] for text in TEXTS]},
                "params": {"task": "score"}}
        scoring = urllib.request.Request(f"{serving.uri}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with _OPENER.open(scoring, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        serving.stop()
    expected = LanguageModel.load(tiny_bundle).score(TEXTS)
    assert [row["perplexity"] for row in answer["predictions"]] == pytest.approx(
        [score.perplexity for score in expected], rel=1e-4)


def _answers(url: str) -> bool:
    try:
        with _OPENER.open(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_postgresql_restarted_mid_gate_leaves_no_version_half_registered(team, gate, two_versions):
    before = {v.version for v in _client(team, "admin").search_model_versions(f"name = '{MODEL}'")}

    def restart_postgres(process: GateProcess) -> None:
        process.wait_for("Created version")
        team.cluster.restart()

    result = gate("restarted", during=restart_postgres, force=True)
    client = _client(team, "admin")
    versions = {v.version: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert set(versions) == before | {result["version"]}, (before, result)
    assert versions[result["version"]].status == "READY"
    assert all(any(key.startswith("gate.") for key in v.tags) for v in versions.values()), \
        {v.version: sorted(v.tags) for v in versions.values()}
    assert _aliases(team)["champion"] == result["version"]
    assert not client.search_registered_models(f"name = '{MODEL}.aliases-lock'")
    assert "aliases.move" not in client.get_registered_model(MODEL).tags


TWO_MACHINES_MODEL = "two_machines_lm"
A_LEARNING_RATE = 0.005  # machine A's second cycle trains with another configuration than B's
TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"


def _machine(root: Path) -> Path:
    """A project copy as the ``project`` fixture makes one: a "machine" of its own (data/, run lock, logs)."""
    return copy_project(root)


def _schedule(team, machine: Path, corpus: Path, **training) -> subprocess.Popen[str]:
    """``train-deploy schedule --once --env team`` of the tiny whole pipeline on ``machine``, as the trainer."""
    params = _retrain_params(corpus, training=training, registry={"model_name": TWO_MACHINES_MODEL})
    env = team.guide.environment(TRAIN_DEPLOY_TEAM_SERVER=team.server.uri, **team.guide.credentials("trainer"))
    return subprocess.Popen([str(TRAIN_DEPLOY), "schedule", "--once", "--env", "team", "--params",
                             ",".join(cli_params(params))], cwd=machine, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finished(process: subprocess.Popen[str], timeout: float = 900) -> str:
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        raise
    assert process.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_two_machines_one_registry_and_a_serving_host(team, tmp_path):
    corpus = tmp_path / "shared" / "corpus.txt"  # the corpus both machines read (a shared mount)
    corpus.parent.mkdir()
    _write_corpus(corpus, 0, 700)
    first, second = _machine(tmp_path / "machine_a"), _machine(tmp_path / "machine_b")
    _client(team, "admin").create_registered_model(TWO_MACHINES_MODEL)  # as the guide's accounts step does
    from mlflow.server import get_app_client

    get_app_client("basic-auth", tracking_uri=team.server.uri).grant_user_permission(
        "trainer", "registered_model", TWO_MACHINES_MODEL, "EDIT")
    _finished(_schedule(team, first, corpus, init_from="scratch"))  # cycle 1: version 1, champion

    host = tmp_path / "serving_host"  # no access to either project's disk: the model comes through the server
    serving = _ChampionServing(team, host)
    serving.start(timeout=300)
    try:
        _write_corpus(corpus, 700, 800, mode="a")  # cycle 2: new text; both machines at once
        runs = [_schedule(team, first, corpus, init_from="champion", optimizer={"learning_rate": A_LEARNING_RATE}),
                _schedule(team, second, corpus, init_from="champion")]
        _finished(runs[0]), _finished(runs[1])
        third = _finished(_schedule(team, first, corpus, init_from="champion"))  # cycle 3: B's configuration
        assert _score(serving)  # the host served the champion it started with throughout
    finally:
        serving.stop()

    admin = _client(team, "admin")
    versions = {v.version: v for v in admin.search_model_versions(f"name = '{TWO_MACHINES_MODEL}'")}
    assert len(versions) == 3, sorted(versions)
    runs_of = {v.version: admin.get_run(v.run_id) for v in versions.values()}
    (from_b,) = [number for number, run in runs_of.items() if number != "1"
                 and run.data.params.get("training.optimizer.learning_rate") != str(A_LEARNING_RATE)]
    assert all(runs_of[number].data.tags.get("init_from.champion_version") == "1" for number in versions
               if number != "1"), {n: r.data.tags for n, r in runs_of.items()}  # each picked up the champion
    assert f"version {from_b}" in third and "nothing to retrain" in third, third[-3000:]
    decisions = [v.tags["gate.decision"] for v in versions.values()]
    assert decisions.count("first") == 1 and "failed" not in decisions, decisions
    champion = admin.get_registered_model(TWO_MACHINES_MODEL).aliases["champion"]
    best = min(float(v.tags["gate.candidate"]) for v in versions.values())
    assert float(versions[str(champion)].tags["gate.candidate"]) <= best * 1.01  # within min_improvement
    statuses = {run.info.status for run in admin.search_runs(
        [admin.get_experiment_by_name("train_deploy").experiment_id])}
    assert statuses == {"FINISHED"}, statuses  # no RUNNING run


class _ChampionServing(MlflowServer):
    """``mlflow models serve -m models:/two_machines_lm@champion`` as the server account, from an empty folder."""

    def __init__(self, team, folder: Path) -> None:
        super().__init__(folder, free_port())
        self.team = team

    def command(self) -> list[str]:
        # MlflowServer.start drops MLFLOW_TRACKING_URI from the environment (a server must not inherit one)
        return ["env", f"MLFLOW_TRACKING_URI={self.team.server.uri}", str(Path(sys.executable).parent / "mlflow"),
                "models", "serve", "-m",
                f"models:/{TWO_MACHINES_MODEL}@champion", "--env-manager", "local", "--host", "127.0.0.1",
                "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        return self.team.guide.environment(MLFLOW_REGISTRY_URI=self.team.server.uri,
                                           **self.team.guide.credentials("server"))


def _score(serving: MlflowServer) -> list[dict]:
    body = {"dataframe_split": {"columns": ["text"], "data": [[text] for text in TEXTS]}, "params": {"task": "score"}}
    scoring = urllib.request.Request(f"{serving.uri}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with _OPENER.open(scoring, timeout=120) as response:
        return json.loads(response.read())["predictions"]


def test_backup_upgrade_and_restore(team, two_versions, tmp_path):
    admin = _client(team, "admin")
    versions = sorted(v.version for v in admin.search_model_versions(f"name = '{MODEL}'"))
    aliases, history = _aliases(team), _registry(team, "server", "history").stdout
    team.server.stop()
    team.guide.run("backup")
    team.guide.run("upgrade")
    artifacts = Path(team.guide.settings["MLFLOW_ARTIFACTS"])
    shutil.rmtree(artifacts)
    artifacts.mkdir()
    team.guide.run("restore")
    team.server.start(timeout=120)
    admin = _client(team, "admin")
    assert sorted(v.version for v in admin.search_model_versions(f"name = '{MODEL}'")) == versions
    assert _aliases(team) == aliases
    assert _registry(team, "server", "history").stdout == history  # the accounts came back too
    host = tmp_path / "after_restore"
    host.mkdir()
    team.guide.run("serving", cwd=host)  # the champion's artifacts came back
    assert (host / "serving" / "champion" / "MLmodel").exists()


def test_a_registry_read_the_server_refuses_is_one_line_naming_the_account(team):
    """A basic-auth server answers a read of an alias of a registered model that does not exist yet with 403, as it
    answers an account without READ: the change check before a run stops in one line, not a traceback."""
    from train_deploy.registry.config import RetryConfig
    from train_deploy.registry.history import alias_version
    from train_deploy.registry.lineage import eval_set_corpus
    from train_deploy.registry.retry import RegistryRefused, Retrying

    client = _client(team, "trainer")
    retry = Retrying(RetryConfig(attempts=1, wait_seconds=0), client.tracking_uri)
    with pytest.raises(RegistryRefused) as refused:
        retry("find the champion", lambda: alias_version(client, "never_made_lm", "champion"))
    message = str(refused.value)
    assert message.startswith(f"MLflow tracking server {team.server.uri} refused find the champion for 'trainer' "
                              "(HTTP 403): the account needs READ on the registered model"), message
    assert "have an admin create it first" in message and "\n" not in message
    assert team.guide.password("trainer") not in message
    assert eval_set_corpus(client, "never_made_lm") is None  # the model itself answers 404: no set yet
