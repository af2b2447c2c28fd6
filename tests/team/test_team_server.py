"""docs/team-server.md, every command block run as written against a PostgreSQL cluster and mlflow server of the
module's own (tests/team/conftest.py). The tests share the module's registry and run in this order: the server's
refusals, a read of a model that does not exist yet, two machines scheduling two cycles each on the guide's model
while a serving host follows the champion (PostgreSQL stopped mid-training and restarted mid-gate in the last
cycle), the roles on what the cycles registered, a project run through conf/team, and a maintenance window
(the tracking server down: the serving host answers on and restarts from its copy; backup, schema upgrade and
restore; champion moved once the server is back, and the host follows)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tests.helpers.project import cli_params, copy_project, tiny_runtime_params
from tests.helpers.retrain import _params as _retrain_params
from tests.helpers.retrain import _write_corpus
from tests.helpers.team import GUIDE, guide_blocks
from tests.mlflow_server import MlflowServer, free_port
from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path

pytestmark = pytest.mark.team
MODEL = "train_deploy_lm"  # the guide's model: the machines' first run creates it
TEXTS = ["今天天气很好。", "我们一起去学校。"]
TRAIN_DEPLOY = Path(sys.executable).parent / "train-deploy"
A_LEARNING_RATE = 0.005  # machine A trains with another configuration than B's
# Each cycle as small as it honestly goes: 4 tiny steps (checkpoints at 2 and 4), the ONNX fp32 form without int8,
# one timed call per form, the team's 16-text evaluation set from a shared file (so two first registrations racing
# on a fresh server store the same set); every strict improvement promotes, so the champion must be the best
# candidate so far exactly. The per-candidate serving check is off: the serving host below serves each champion.
CYCLE_EXPORT = {"edge": {"int8": False}, "parity": {"samples": 2},
                "latency": {"batch_sizes": [1], "seq_length": 16, "warmup": 0, "repeats": 1, "rounds": 1,
                            "generate_tokens": 0}}
EVAL_TEXTS = 16
POLL_S = 1  # the serving host's SERVE_POLL_S: it follows champion within a second and the version's checks
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module", autouse=True)
def _credentials_restored() -> Iterator[None]:
    """The accounts' credentials that :func:`_client` puts into this process's environment, gone after the module."""
    saved = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    yield
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


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


def test_every_block_of_the_guide_is_run_by_this_module():
    source = Path(__file__).read_text(encoding="utf-8") + (Path(__file__).parent / "conftest.py").read_text()
    blocks = guide_blocks()
    assert {"databases", "auth-config", "server", "accounts", "project", "serve-follow", "backup", "upgrade",
            "restore", "restore-check"} <= set(blocks)
    assert not [name for name in blocks if f'"{name}"' not in source]
    assert GUIDE.read_text().count("```bash") == len(blocks) + 1  # the settings block: the test sets its own


def test_the_server_refuses_a_client_without_credentials(team):
    assert _status(f"{team.server.uri}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert _status(f"{team.server.uri}/health") == 200


def test_a_model_not_made_yet_is_no_champion_and_a_refused_read_is_one_line(team):
    """Basic-auth answers a read of an alias of a registered model that does not exist with 403 (and the model's
    own read with 404): the first run's change check finds no champion. A model the account may not read is a
    refusal, in one line naming the account and the permission."""
    from mlflow.server import get_app_client

    from train_deploy.registry.config import RetryConfig
    from train_deploy.registry.history import CHAMPION, alias_version
    from train_deploy.registry.lineage import eval_set_corpus
    from train_deploy.registry.retry import RegistryRefused, Retrying

    trainer = _client(team, "trainer")
    retry = Retrying(RetryConfig(attempts=1, wait_seconds=0), team.server.uri)
    with pytest.raises(MlflowException) as raw:
        trainer.get_model_version_by_alias(MODEL, CHAMPION)
    assert raw.value.get_http_status_code() == 403  # what the server answers for a model it does not have
    assert retry("find the champion", lambda: alias_version(trainer, MODEL, CHAMPION)) is None
    assert eval_set_corpus(trainer, MODEL) is None

    _client(team, "admin").create_registered_model("private_lm")
    get_app_client("basic-auth", tracking_uri=team.server.uri).grant_user_permission(
        "server", "registered_model", "private_lm", "DENY")
    try:
        server = _client(team, "server")
        with pytest.raises(RegistryRefused) as refused:
            retry("find the champion", lambda: alias_version(server, "private_lm", CHAMPION))
    finally:
        _client(team, "admin").delete_registered_model("private_lm")
    message = str(refused.value)
    assert message.startswith(f"MLflow tracking server {team.server.uri} refused find the champion for 'server' "
                              "(HTTP 403): the account needs READ on the registered model"), message
    assert "\n" not in message and team.guide.password("server") not in message


# -- two machines, one registry, a serving host ------------------------------------------------------------------

def _cycle_params(corpus: Path, **training) -> dict:
    """A cycle's parameters: the tiny whole pipeline on ``corpus`` (the evaluation set beside it)."""
    registry = {"model_name": MODEL, "min_improvement": 0.0, "serving_check": {"enabled": False},
                "require_beats": "none",  # a tiny model a few steps old predicts worse than counting
                "eval_set": {"path": str(corpus.parent / "eval_set.jsonl"), "documents": EVAL_TEXTS,
                             "min_texts": EVAL_TEXTS, "max_chars": 60}}
    return _retrain_params(corpus, training=training, export=CYCLE_EXPORT, registry=registry)


_DECIDED = re.compile(rf"{MODEL} version (\d+): (?:first|promoted|rejected|undecided|forced) \(")


def _version_of(output: str) -> str:
    """The version a cycle registered, from the gate's line (``train_deploy_lm version 3: promoted (…)``)."""
    found = _DECIDED.findall(output)
    assert len(found) == 1, output[-3000:]
    return found[0]


class _Schedule:
    """``train-deploy schedule --once --env team`` of the tiny whole pipeline on a machine, as the trainer; its
    output goes to ``<machine>/cycle<N>.log``."""

    def __init__(self, team, machine: Path, cycle: int, corpus: Path, **training) -> None:
        params = _cycle_params(corpus, **training)
        env = team.guide.environment(TRAIN_DEPLOY_TEAM_SERVER=team.server.uri, **team.guide.credentials("trainer"))
        self.machine, self.started = machine, time.time()
        self.log = machine / f"cycle{cycle}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(TRAIN_DEPLOY), "schedule", "--once", "--env", "team", "--params", ",".join(cli_params(params))],
                cwd=machine, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, found, what: str, timeout: float = 600):
        """``found()``'s first truthy value, polled while the cycle runs; fail if it ends first or is late."""
        deadline = time.monotonic() + timeout
        while not (value := found()):
            assert self.process.poll() is None, f"the cycle ended before {what}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{self.output()[-4000:]}"
            time.sleep(0.05)
        return value

    def training_folder(self) -> Path | None:
        """The folder of the training this cycle started (its ``run.json`` is written as the launcher starts)."""
        found = [p.parent for p in (self.machine / "data" / "08_reporting" / "training_logs").glob("*/run.json")
                 if p.stat().st_mtime >= self.started]
        return found[0] if found else None

    def finished(self, timeout: float = 900) -> str:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            raise
        assert self.process.returncode == 0, self.output()[-4000:]
        return self.output()


class _ServingHost(MlflowServer):
    """The guide's serving host (step 6, block ``serve-follow``): ``train-deploy serve --follow`` of champion as the
    server account, with a home and a serve cache of its own (no access to the machines' folders)."""

    def __init__(self, team, folder: Path) -> None:
        super().__init__(folder, free_port())
        self.team = team
        (folder / "home").mkdir(parents=True)

    def command(self) -> list[str]:
        return ["bash", "-euo", "pipefail", "-c", guide_blocks()["serve-follow"]]

    def environment(self) -> dict[str, str]:
        return self.team.guide.environment(SERVE_PORT=str(self.port), SERVE_POLL_S=str(POLL_S),
                                           HOME=str(self.root / "home"), COLUMNS="400",  # log lines whole
                                           TRAIN_DEPLOY_CACHE_DIR=str(self.root / "cache"))

    @property
    def pid(self) -> int | None:
        """The serving process's id while it runs (the same one between two checks: followed, not restarted)."""
        return None if self._process is None else self._process.pid

    def version(self) -> str:
        """The version ``/v1/models`` names, which the header of its answer names too."""
        with _OPENER.open(f"{self.uri}/v1/models", timeout=30) as response:
            named = json.loads(response.read())["data"][0]["version"]
            assert response.headers["x-model-version"] == named
            return named

    def wait_serving(self, version: str, timeout: float = 180) -> None:
        """Return once the host answers with ``version``; fail with its log's tail if it does not in time."""
        deadline = time.monotonic() + timeout
        while self.version() != version:
            assert time.monotonic() < deadline, f"the host does not serve version {version}:\n{self.output()[-4000:]}"
            time.sleep(0.2)

    def wait_for_line(self, text: str, seen: int = 0, timeout: float = 60) -> None:
        """Return once the host's log holds ``text`` more than ``seen`` times."""
        deadline = time.monotonic() + timeout
        while self.output().count(text) <= seen:
            assert time.monotonic() < deadline, f"no {text!r} in the host's log:\n{self.output()[-4000:]}"
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def score(self) -> list[float]:
        body = {"dataframe_split": {"columns": ["text"], "data": [[text] for text in TEXTS]},
                "params": {"task": "score"}}
        request = urllib.request.Request(f"{self.uri}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with _OPENER.open(request, timeout=120) as response:
            return [row["perplexity"] for row in json.loads(response.read())["predictions"]]


@dataclass
class Cycles:
    """What the two machines' cycles left and what was seen between them."""

    corpus: Path
    machines: dict[str, Path]
    outputs: dict[str, list[str]] = field(default_factory=lambda: {"A": [], "B": []})
    checks: list[dict] = field(default_factory=list)
    """After each round: the champion, the version the host serves, its scores, the serving process's id."""
    outage: dict = field(default_factory=dict)
    host: _ServingHost | None = None


def _check_host(team, cycles: Cycles) -> None:
    """The serving host after a round: started after the first (when there is a champion), then left running: it
    must serve the champion the round left, followed without a restart."""
    host, admin = cycles.host, _client(team, "admin")
    champion = str(admin.get_registered_model(MODEL).aliases["champion"])
    if host.pid is None:
        host.start(timeout=300)
    host.wait_serving(champion)
    cycles.checks.append({"champion": champion, "served": host.version(), "scores": host.score(), "pid": host.pid})


def _outages(team, cycle: _Schedule, outage: dict) -> None:
    """PostgreSQL stopped while ``cycle``'s training runs (from its launcher's start until a couple of seconds after
    its first metric line, so a send fails), then restarted once the gate has registered the version."""
    folder = cycle.wait_for(cycle.training_folder, "training start")
    team.cluster.stop()
    outage["metrics_when_stopped"] = (folder / "metrics.jsonl").exists()
    metrics = folder / "metrics.jsonl"
    cycle.wait_for(lambda: metrics.exists() and metrics.read_text().strip(), "a metric line", timeout=300)
    time.sleep(2.5)  # the forwarder tries every second
    outage["steps_when_started"] = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    team.cluster.start()
    outage["metrics"] = metrics
    cycle.wait_for(lambda: "Created version" in cycle.output(), "a registered version")
    team.cluster.restart()
    outage["restarted_mid_gate"] = not _DECIDED.search(cycle.output().split("Created version")[-1])


@pytest.fixture(scope="module")
def cycles(team, tmp_path_factory) -> Iterator[Cycles]:
    """Two machines (project copies: data/, run lock, logs of their own) reading one shared corpus and the team's
    evaluation set, and a serving host with no access to either; the rounds below run the cycles."""
    root = tmp_path_factory.mktemp("two_machines")
    corpus = root / "shared" / "corpus.txt"  # the corpus both machines read (a shared mount)
    corpus.parent.mkdir()
    texts = strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[10_000:10_100])
    (corpus.parent / "eval_set.jsonl").write_text("".join(
        json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts if text.strip()), encoding="utf-8")
    done = Cycles(corpus, {name: copy_project(root / f"machine_{name.lower()}") for name in "AB"})
    for machine in done.machines.values():  # no collection after each cycle: tests/retention and the soak test it
        (machine / "conf" / "team" / "parameters_retention.yml").write_text(
            yaml.safe_dump({"retention": {"after_scheduled_run": False}}))
    done.host = _ServingHost(team, root / "serving_host")
    try:
        yield done
    finally:
        done.host.stop()


def _round(team, cycles: Cycles, number: int) -> None:
    """Round ``number``: the shared corpus grows (700 paragraphs, then 100 more each round), then A and B run a
    cycle at once (A with its own learning rate; from scratch in round 1, from the champion after), and the serving
    host is checked. In round 2 PostgreSQL is stopped during B's training and restarted under its gate (two rounds
    prove what three did: a fresh server, then both machines from the champion through an outage)."""
    if len(cycles.checks) != number - 1:
        pytest.skip(f"round {number - 1} did not complete")
    lines = (0, 700) if number == 1 else (500 + 100 * number, 600 + 100 * number)
    _write_corpus(cycles.corpus, *lines, mode="a")
    init = "scratch" if number == 1 else "champion"
    runs = {"A": _Schedule(team, cycles.machines["A"], number, cycles.corpus, init_from=init,
                           optimizer={"learning_rate": A_LEARNING_RATE}),
            "B": _Schedule(team, cycles.machines["B"], number, cycles.corpus, init_from=init)}
    if number == 2:
        _outages(team, runs["B"], cycles.outage)
    for name, run in runs.items():
        cycles.outputs[name].append(run.finished())
    _check_host(team, cycles)


def _all_rounds(cycles: Cycles) -> Cycles:
    if len(cycles.checks) != 2:
        pytest.skip("the two rounds did not complete")
    return cycles


def test_round_1_two_first_runs_on_a_fresh_server(team, cycles):
    _round(team, cycles, 1)
    assert all("has no champion yet" in cycles.outputs[name][0] for name in "AB")  # neither stopped on the 403


def test_round_2_both_machines_from_the_champion_postgresql_stopped_mid_training_and_restarted_mid_gate(team, cycles):
    _round(team, cycles, 2)


def test_two_machines_two_cycles_each_and_a_serving_host(team, cycles):
    _all_rounds(cycles)
    admin = _client(team, "admin")
    versions = {v.version: v for v in admin.search_model_versions(f"name = '{MODEL}'")}
    assert len(versions) == 4, {n: (v.tags.get("gate.decision"), v.run_id) for n, v in versions.items()}
    runs = {number: admin.get_run(v.run_id) for number, v in versions.items()}
    later = [number for number, run in runs.items() if run.data.tags.get("init_from") == "champion"]
    assert len(later) == 2, {n: r.data.tags.get("init_from") for n, r in runs.items()}

    decisions = {number: v.tags.get("gate.decision") for number, v in versions.items()}
    assert sorted(decisions.values()).count("first") == 1 and set(decisions.values()) <= {
        "first", "promoted", "rejected", "undecided"}, decisions
    history = [event for event in _history(admin) if event["event"] != "rollback"]
    assert sorted(str(event["version"]) for event in history) == sorted(versions), history  # every decision

    # The champion after each round is the last version the gate made champion so far (in the history's order: the
    # two machines' gates of a round may finish in either order); a promoted candidate scored below the champion it
    # replaced on the same set (nats/char), a rejected one did not (undecided: within noise).
    by_round = sorted(versions, key=int)
    for number in by_round:
        if decisions[number] in ("promoted", "rejected"):
            tags = versions[number].tags
            better = float(tags["gate.candidate"]) < float(tags["gate.champion"])
            assert better == (decisions[number] == "promoted"), (number, tags)
    for check, upto in zip(cycles.checks, (2, 4), strict=True):
        made = [str(event["version"]) for event in history
                if event.get("decision") in ("first", "promoted") and int(event["version"]) <= upto]
        assert check["champion"] == made[-1], (check, decisions)
        assert check["served"] == check["champion"], check  # the host serves the champion
        assert len(check["scores"]) == len(TEXTS) and all(score > 0 for score in check["scores"]), check
    for before, after in pairwise(cycles.checks):
        assert after["pid"] == before["pid"], cycles.checks  # the same process, following
        if after["champion"] != before["champion"]:
            assert after["scores"] != before["scores"], cycles.checks  # new weights answer
            assert f"Serving version {after['champion']} of {MODEL} ({MODEL}@champion moved from " \
                   in cycles.host.output()
        else:
            assert after["scores"] == pytest.approx(before["scores"], rel=1e-6), cycles.checks

    statuses = {run.info.status for run in admin.search_runs(
        [admin.get_experiment_by_name("train_deploy").experiment_id])}
    assert statuses == {"FINISHED"}, statuses  # no RUNNING run
    assert not admin.search_registered_models(f"name = '{MODEL}.aliases-lock'")
    assert "aliases.move" not in admin.get_registered_model(MODEL).tags


def test_postgresql_stopped_mid_training_and_restarted_mid_gate_loses_nothing(team, cycles):
    outage, admin = _all_rounds(cycles).outage, _client(team, "admin")
    assert not outage["metrics_when_stopped"], outage  # stopped as the launcher started, before the first step
    assert outage["restarted_mid_gate"], outage
    version = admin.get_model_version(MODEL, _version_of(cycles.outputs["B"][-1]))
    run = admin.get_run(version.run_id)
    assert run.info.status == "FINISHED" and version.status == "READY"
    assert version.tags.get("gate.decision") in ("promoted", "rejected", "undecided"), version.tags
    logged: dict[str, set[int]] = {}
    for line in outage["metrics"].read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                logged.setdefault(key, set()).add(record["step"])
    assert logged and max(max(steps) for steps in logged.values()) == 4
    for key, steps in logged.items():
        sent = {metric.step for metric in admin.get_metric_history(run.info.run_id, f"train.{key}")}
        assert steps <= sent, (key, steps, sent)  # every logged step, once the database was back


def test_skip_unchanged_sees_the_other_machines_version(team, cycles, monkeypatch):
    """Machine A with B's configuration on the corpus B trained on last: nothing to retrain, naming B's version
    (the change check in process, as A's scheduler runs it before its first node)."""
    from train_deploy.run_control.retrain import check_for_changes

    _all_rounds(cycles)
    params = _cycle_params(cycles.corpus, init_from="champion")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", team.server.uri)
    # a URI an earlier test of this process set with mlflow.set_*_uri wins over the variable: the team's server here
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", team.server.uri)
    monkeypatch.setattr("mlflow.tracking._model_registry.utils._registry_uri", team.server.uri)
    monkeypatch.chdir(cycles.machines["A"])
    for key, value in team.guide.credentials("trainer").items():
        monkeypatch.setenv(key, value)
    check = check_for_changes(params)
    assert not check.retrain and "nothing to retrain" in check.reason, check.reason
    assert f"version {_version_of(cycles.outputs['B'][-1])}" in check.reason, check.reason


def _history(client: MlflowClient) -> list[dict]:
    from train_deploy.registry.history import read_history

    return read_history(client, MODEL)


# -- roles, the project, the maintenance window -------------------------------------------------------------------

def test_roles_trainer_registers_server_reads_admin_rolls_back(team, cycles):
    _all_rounds(cycles)
    before = _aliases(team)
    champion, previous = before["champion"], before["previous"]
    refused = _registry(team, "server", "rollback")
    assert refused.returncode == 1, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "403" in refused.stderr and "EDIT" in refused.stderr and MODEL in refused.stderr, refused.stderr
    assert team.guide.password("server") not in refused.stderr
    assert _aliases(team) == before
    assert _registry(team, "server", "history").returncode == 0
    with pytest.raises(MlflowException, match="Permission denied"):
        _client(team, "server").set_registered_model_alias(MODEL, "champion", previous)
    with pytest.raises(MlflowException, match="Permission denied"):
        _client(team, "server").create_model_version(MODEL, f"models:/{MODEL}/1")

    rolled = _registry(team, "admin", "rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert _aliases(team) == {"champion": previous, "previous": champion}
    assert "rolled back by MLflow account 'admin'" in _history(_client(team, "admin"))[-1]["reason"]
    assert _registry(team, "trainer", "rollback").returncode == 0  # the model's creator: the trainer can too
    assert _aliases(team) == before
    assert "rolled back by MLflow account 'trainer'" in _history(_client(team, "admin"))[-1]["reason"]


def test_a_project_runs_on_the_server_through_conf_team(team, cycles, project):
    # The guide's run is the corpus stage; this project copy's conf/team makes it a tiny one.
    (project / "conf" / "team" / "parameters_corpus.yml").write_text(yaml.safe_dump(tiny_runtime_params()))
    client = _client(team, "admin")
    experiment = client.get_experiment_by_name("train_deploy").experiment_id
    before = {run.info.run_id for run in client.search_runs([experiment])}
    done = team.guide.run("project", cwd=project)
    assert "time (UTC)" in done.stdout, done.stdout  # the history, read by the trainer
    runs = [run for run in client.search_runs([experiment]) if run.info.run_id not in before]
    assert [run.info.status for run in runs] == ["FINISHED"]
    assert runs[0].info.artifact_uri.startswith("mlflow-artifacts:/"), runs[0].info.artifact_uri
    assert client.list_artifacts(runs[0].info.run_id)
    assert not (project / "mlartifacts").exists() and not (project / "mlruns.db").exists()


def test_maintenance_window_the_host_serves_on_then_follows_and_backup_upgrade_restore(team, cycles, tmp_path):
    _all_rounds(cycles)
    admin = _client(team, "admin")
    versions = sorted(v.version for v in admin.search_model_versions(f"name = '{MODEL}'"))
    aliases, history = _aliases(team), _registry(team, "server", "history").stdout
    host = cycles.host
    host.wait_serving(aliases["champion"])  # the roles' rollbacks moved champion and back
    scores, failed_looks = host.score(), host.output().count("The registry did not answer")
    team.server.stop()
    try:
        assert _status_or_none(f"{team.server.uri}/health") is None
        host.wait_for_line("The registry did not answer", failed_looks)  # the watch failed a look, and polls on
        assert (host.version(), host.score()) == (aliases["champion"], pytest.approx(scores, rel=1e-6))
        host.stop()  # a host (re)started while the tracking server is down serves its last copy
        host.start(timeout=300)
        assert (host.version(), host.score()) == (aliases["champion"], pytest.approx(scores, rel=1e-6))
        team.guide.run("backup")
        team.guide.run("upgrade")
        artifacts = Path(team.guide.settings["MLFLOW_ARTIFACTS"])
        shutil.rmtree(artifacts)
        artifacts.mkdir()
        team.guide.run("restore")
    finally:
        team.server.start(timeout=120)
    admin = _client(team, "admin")
    assert sorted(v.version for v in admin.search_model_versions(f"name = '{MODEL}'")) == versions
    assert _aliases(team) == aliases
    assert _registry(team, "server", "history").stdout == history  # the accounts came back too
    team.guide.run("restore-check", cwd=tmp_path)  # the champion's artifacts came back
    assert (tmp_path / "restore-check" / "MLmodel").exists()

    assert _registry(team, "admin", "rollback").returncode == 0  # champion moves once the server is back
    assert _aliases(team)["champion"] == aliases["previous"]
    host.wait_serving(aliases["previous"])  # the restarted host followed, without another restart
    assert host.score() != pytest.approx(scores, rel=1e-6)
    restarted = host.output().rsplit("\n--- ", 1)[-1]
    assert f"does not answer: serving the copy of {MODEL} version {aliases['champion']} downloaded before" in restarted
    assert restarted.count("The registry did not answer") == 1 and "The registry answers again" in restarted


def _status_or_none(url: str) -> int | None:
    try:
        with _OPENER.open(url, timeout=2) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return None
