"""`kedro run` through the project's command (train_deploy.cli), as a user types it."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from kedro.io import DataCatalog
from kedro.pipeline import node, pipeline
from kedro.runner import SequentialRunner
from mlflow import MlflowClient

from tests.helpers.manuals import write_manuals
from tests.helpers.project import (
    cli_params,
    copy_project,
    tiny_runtime_params,
    tiny_train_deploy_params,
)
from train_deploy.cli import NoResumeHint
from train_deploy.config import ConfigError
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.errors import CorpusError
from train_deploy.project import project_config
from train_deploy.registry.config import RegistryConfig
from train_deploy.run_control.retrain import CORPUS_TAG, TRAINING_TAG, compare

pytest_plugins = ["tests.mlflow_server"]


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_project_error_is_one_line_and_its_traceback_is_in_the_log_file(project, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "train_deploy", "--params",
                           "export.parity.samples=-3"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)
    log = project / "logs" / "train_deploy.log"
    assert done.returncode == 1
    assert done.stderr.endswith(f"ConfigError: export.parity.samples: must be at least 1 (got -3)\n"
                                f"  traceback: {log}\n"), done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "Traceback" not in console and "│" not in console and console.count("ConfigError") == 1
    assert "Traceback (most recent call last)" in log.read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_failed_node_is_one_line_and_its_mlflow_run_is_said_closed_once(project, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("一篇文章。\n\n".encode() + b"\xff not UTF-8\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "corpus", "--params",
                           f"corpus.reader.source=text,corpus.reader.paths=[{bad}]"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.endswith(f"CorpusError: {bad} line 3: not valid UTF-8 (byte 0xff at column 1)\n"
                                f"  traceback: {project / 'logs' / 'train_deploy.log'}\n"), done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "Traceback" not in console and console.count("CorpusError") == 1
    assert "--from-nodes" not in console and "Repeat the previous command" not in console  # rerunning cannot help
    # kedro-mlflow says it once per node that ran (its run is re-opened before each), unless RunClosedOnce
    assert console.count("was closed because of an error in the pipeline") == 1, console[-3000:]


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_python_m_train_deploy_is_the_projects_kedro_run(project, tmp_path):
    """Kedro's way to run a packaged project finds the project's ``run`` (its one-line errors included)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    done = subprocess.run([sys.executable, "-m", "train_deploy", "--pipelines", "train_deploy", "--params",
                           "export.parity.samples=-3"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert "\nConfigError: export.parity.samples: must be at least 1 (got -3)\n" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr


def _resume_hints(error: Exception, caplog) -> list[str]:
    """What Kedro's runner says about resuming when the second of two nodes raises ``error``."""
    def fail(_: int) -> int:
        raise error

    nodes = pipeline([node(lambda: 1, None, "made", name="make"), node(fail, "made", "used", name="use")])
    NoResumeHint.install()  # as importing train_deploy.cli did; once however often it is called
    assert sum(isinstance(f, NoResumeHint) for f in logging.getLogger(NoResumeHint.RUNNER_LOGGERS[0]).filters) == 1
    with caplog.at_level(logging.WARNING), pytest.raises(type(error)):
        SequentialRunner().run(nodes, DataCatalog())
    return [r.getMessage() for r in caplog.records if any(hint in r.getMessage() for hint in NoResumeHint.HINTS)]


@pytest.mark.parametrize("error", [ConfigError("training.batch.seq_length: must be at least 8 (got 2)"),
                                   CorpusError("corpus.encoding.validation_fraction: 0.2 of the 2 documents …")])
def test_no_resume_hint_after_a_configuration_or_corpus_error(error, caplog):
    assert _resume_hints(error, caplog) == []


def test_the_resume_hint_stays_for_other_failures(caplog):
    (hint,) = _resume_hints(RuntimeError("the disk is full"), caplog)
    assert hint.endswith('--from-nodes "make"')  # the memory dataset between them is gone


@pytest.mark.slow
def test_a_new_user_with_two_single_page_manuals_trains_and_registers_as_the_readme_says(tmp_path):
    """README, "Your own corpus": a folder of web pages with the validation share it gives (0.2) under a model name
    of its own, in a fresh project with its own store (no MLFLOW_TRACKING_URI); only the training and export's
    checks are made tiny.
    The commands the end of the run prints then work as printed, from another folder."""
    project = copy_project(tmp_path / "project")
    write_manuals(tmp_path / "manuals")
    params = tiny_train_deploy_params()
    params["corpus"] = {"reader": {"source": "html", "paths": f"[{tmp_path / 'manuals'}]"},
                        "encoding": {"validation_fraction": 0.2, "progress": False}}  # the default tokenizer
    params["registry"]["model_name"] = "site_lm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "PYTHONPATH"}
    done = subprocess.run([str(Path(sys.executable).parent / "kedro"), "run", "--pipelines", "train_deploy",
                           "--params", ",".join(cli_params(params))], cwd=project, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "is relative" not in done.stdout + done.stderr  # kedro-mlflow's line about mlflow.yml's artifact location
    manifest = json.loads((project / "data/04_feature/tokens/manifest.json").read_text(encoding="utf-8"))
    assert manifest["documents"]["read"] == 162 and manifest["splits"]["valid"]["documents"] == 36  # the sections
    assert "\nRegistered site_lm version 1: " in done.stdout, done.stdout[-3000:]

    printed = dict(line.strip().split(": ", 1) for line in done.stdout.splitlines()
                   if line.startswith(("  history: ", "  roll back: ")))
    assert printed["history"] == f"{Path(sys.executable).parent / 'train-deploy-registry'} history --model site_lm " \
                                 f"--project {project}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    history = subprocess.run(shlex.split(printed["history"]), cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=180)
    assert history.returncode == 0, history.stderr
    decision = json.loads((project / "data/08_reporting/registry_decision.json").read_text(encoding="utf-8"))
    assert history.stdout.splitlines()[1].split()[2:5] == ["gate", decision["decision"], "1"]


def test_the_skip_line_names_the_model_whose_champion_is_unchanged():
    """What ``Skipped: …`` prints for a run with nothing to retrain (``retrain.check_for_changes``)."""
    same = {CORPUS_TAG: "c1", TRAINING_TAG: "t1"}
    assert compare(same, dict(same), "champion version 1", "train_deploy_lm") == (
        False, "nothing to retrain: the corpus and the training configuration are those of champion version 1 of "
               "train_deploy_lm (retrain.force: true trains anyway)")


@pytest.mark.slow
def test_a_team_run_prints_its_mlflow_links_once_and_leaves_the_artifacts_to_the_server(tmp_path, mlflow_server):
    """`kedro run --env team` against a server whose experiment does not exist yet: MLflow prints its run's links
    when the run leaves its stack of active runs, where kedro-mlflow put it once per node; conf/base's local
    artifact location is not the server's."""
    project = copy_project(tmp_path / "project")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
           "TRAIN_DEPLOY_TEAM_SERVER": mlflow_server.uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "corpus", "--env", "team", "--params",
                           ",".join(cli_params(tiny_runtime_params()))], cwd=project, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    console = done.stdout + done.stderr
    assert console.count("🏃 View run ") == 1 and console.count("🧪 View experiment at: ") == 1, console[-4000:]
    assert "is relative" not in console and "mlartifacts" not in console
    client = MlflowClient(mlflow_server.uri, mlflow_server.uri)
    experiment = client.get_experiment_by_name("train_deploy")
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert not (project / "mlartifacts").exists() and not (project / "mlruns.db").exists()


def test_env_base_runs_the_demo_whatever_conf_local_holds(tmp_path):
    """README, "Your own corpus": with a user's corpus and model name in conf/local, `kedro run --env base` reads
    conf/base alone."""
    project = copy_project(tmp_path / "project")
    (project / "conf" / "local" / "parameters_registry.yml").write_text("registry:\n  model_name: news_lm\n")
    (project / "conf" / "local" / "parameters_corpus.yml").write_text("corpus:\n  reader:\n    source: jsonl\n")
    names = {env: project_config(project, env)["parameters"] for env in (None, "base")}
    assert [names[None]["registry"]["model_name"], names[None]["corpus"]["reader"]["source"]] == ["news_lm", "jsonl"]
    registry, corpus = RegistryConfig.from_params(names["base"]["registry"]), CorpusConfig.from_params(
        names["base"]["corpus"])
    assert [registry.model_name, corpus.reader.source] == ["train_deploy_lm", "people_daily"]  # the types' defaults


def _help(*argv: str) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / argv[0]), *argv[1:], "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return done.stdout


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_every_console_script_and_each_of_its_commands_answers_help_in_click_s_words():
    """One CLI framework for every console script (issue 37): each command, and each sub-command its help lists,
    answers ``--help`` with click's ``Usage: <the command as typed>`` (argparse wrote ``usage:``)."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == ["train-deploy", "train-deploy-join", "train-deploy-registry"]
    asked = []
    for script in sorted(scripts):
        text = _help(script)
        assert text.startswith(f"Usage: {script} "), text
        listed = text.partition("\nCommands:\n")[2]
        for command in re.findall(r"^  (\S+)", listed, re.M):  # wrapped descriptions are indented further
            assert _help(script, command).startswith(f"Usage: {script} {command} "), (script, command)
            asked.append(f"{script} {command}")
    assert asked == ["train-deploy gc", "train-deploy relocate", "train-deploy run", "train-deploy schedule",
                     "train-deploy serve",
                     "train-deploy-registry history", "train-deploy-registry rollback"]
