"""The Airflow DAG of train_deploy: `kedro airflow create` (the real plugin CLI) renders the project's template
into a DAG that parses, runs one DAG run at a time without catch-up, retries with back-off, keeps the training
node a task of its own and hands only persisted datasets between tasks; the committed DAG is that output.

Where Airflow is installed in its own venv (`make airflow-check` builds .venv-airflow), Airflow imports it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.project import REPO, copy_project
from train_deploy.pipeline_registry import register_pipelines
from train_deploy.run_control.schedule import TRIGGER_VARIABLE

DAG_NAME = "train_deploy_train_deploy_dag.py"
COMMITTED_DAG = REPO / "deploy" / "airflow" / DAG_NAME
KEDRO = Path(sys.executable).with_name("kedro")
AIRFLOW_PYTHON = REPO / os.environ.get("AIRFLOW_VENV", ".venv-airflow") / "bin" / "python"


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory) -> Path:
    """The project's configuration without conf/local (what a fresh checkout generates from)."""
    return copy_project(tmp_path_factory.mktemp("airflow") / "project")


@pytest.fixture(scope="module")
def generated_dag(project_copy) -> Path:
    """The DAG as `make airflow-dag` generates it, written to a temporary folder."""
    target = project_copy.parent / "dags"
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{project_copy.parent / 'mlruns.db'}"}
    result = subprocess.run(
        [str(KEDRO), "airflow", "create", "--pipelines", "train_deploy", "--group-by", "memory",
         "--jinja-file", str(REPO / "deploy" / "airflow" / "dag_template.j2"), "--target-dir", str(target)],
        cwd=project_copy, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return target / DAG_NAME


def _call_keywords(call: ast.Call) -> dict[str, ast.expr]:
    return {keyword.arg: keyword.value for keyword in call.keywords}


def _dag_call(tree: ast.Module) -> ast.Call:
    return next(decorator for node in tree.body if isinstance(node, ast.FunctionDef)
                for decorator in node.decorator_list
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "dag")


def _tasks(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Task id → the function of that task."""
    tasks = {}
    for function in ast.walk(tree):
        for decorator in getattr(function, "decorator_list", []):
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) == "external_python":
                tasks[ast.literal_eval(_call_keywords(decorator)["task_id"])] = function
    return tasks


def _task_nodes(tree: ast.Module) -> dict[str, list[str]]:
    """Task id → the Kedro node names it runs (``node_names`` of its ``session.run``), for the tasks running nodes."""
    tasks = {}
    for task_id, function in _tasks(tree).items():
        for call in ast.walk(function):
            if isinstance(call, ast.Call) and "node_names" in _call_keywords(call):
                tasks[task_id] = ast.literal_eval(_call_keywords(call)["node_names"])
    return tasks


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_kedro_airflow_create_writes_a_dag_of_one_run_at_a_time_with_retries(generated_dag):
    tree = ast.parse(generated_dag.read_text(), filename=str(generated_dag))
    dag = _call_keywords(_dag_call(tree))
    assert ast.literal_eval(dag["dag_id"]) == "train-deploy"
    assert ast.literal_eval(dag["max_active_runs"]) == 1
    assert ast.literal_eval(dag["catchup"]) is False
    default_args = _call_keywords(dag["default_args"])
    assert ast.literal_eval(default_args["retries"]) == 2
    assert ast.literal_eval(default_args["retry_exponential_backoff"]) is True
    assert f'os.environ["{TRIGGER_VARIABLE}"]' in generated_dag.read_text()  # what hooks.tracking.tag_trigger reads
    # Change detection first: its task exits with NOTHING_TO_RETRAIN when nothing changed, which Airflow skips.
    check = _tasks(tree)["check-for-changes"]
    assert "retrain.check_for_changes" in ast.unparse(check)
    assert ast.unparse(_call_keywords(check.decorator_list[0])["skip_on_exit_code"]) == "NOTHING_TO_RETRAIN"


def test_dag_runs_every_node_once_with_training_a_task_of_its_own(generated_dag):
    tasks = _task_nodes(ast.parse(generated_dag.read_text()))
    # the data gate is a task of its own: what it passed (validated_token_files) is a catalog entry, read by
    # training, averaging and export
    assert tasks["validate-corpus"] == ["validate_corpus"]
    assert tasks["train-model"] == ["configure_training", "train_model"]
    pipeline = register_pipelines()["train_deploy"]
    assert sorted(sum(tasks.values(), [])) == sorted(node.name for node in pipeline.nodes)
    # Each task is its own KedroSession: what one task hands another must be written somewhere.
    task_of = {node: task for task, nodes in tasks.items() for node in nodes}
    handed_on = {dataset for node in pipeline.nodes for dataset in node.inputs
                 for producer in pipeline.nodes if dataset in producer.outputs
                 if task_of[producer.name] != task_of[node.name]}
    assert handed_on >= {"token_files", "validated_token_files", "training_result", "export_bundle", "export_metrics"}
    catalog = yaml.safe_load((REPO / "conf" / "base" / "catalog.yml").read_text())
    assert sorted(handed_on - catalog.keys()) == []  # no entry: a MemoryDataset, gone when its task ends
    assert not any("MemoryDataset" in catalog[name]["type"] for name in handed_on)


def test_committed_dag_is_what_make_airflow_dag_generates(generated_dag):
    assert COMMITTED_DAG.read_text() == generated_dag.read_text(), \
        "deploy/airflow/ is out of date with its template or the pipeline: run `make airflow-dag`"


@pytest.mark.skipif(not AIRFLOW_PYTHON.exists(), reason="no Airflow venv: `make airflow-check` builds .venv-airflow")
def test_airflow_imports_the_dag_with_its_tasks_and_order(generated_dag, tmp_path):
    script = """
import json, sys
try:
    from airflow.dag_processing.dagbag import DagBag
except ImportError:
    from airflow.models.dagbag import DagBag
from types import SimpleNamespace
import jinja2
from airflow.utils.types import DagRunType
bag = DagBag(dag_folder=sys.argv[1], include_examples=False)
dag = bag.dags.get("train-deploy")
trigger = dag and {dag.tasks[0].op_args[1]}  # the trigger argument, rendered by Airflow for each DAG run
json.dump({"errors": {k: str(v)[-2000:] for k, v in bag.import_errors.items()},
           "max_active_runs": dag and dag.max_active_runs, "catchup": dag and dag.catchup,
           "upstream": dag and {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks},
           "retries": dag and sorted({t.retries for t in dag.tasks}),
           "skip_on_exit_code": dag and list(dag.get_task("check-for-changes").skip_on_exit_code),
           "runs_in": dag and sorted({f"{type(t).__name__} {t.python}" for t in dag.tasks}),
           "trigger": dag and {kind.value: jinja2.Template(template).render(dag_run=SimpleNamespace(run_type=kind))
                               for kind in DagRunType for template in trigger}}, sys.stdout)
"""
    env = {"PATH": os.environ["PATH"], "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "TRAIN_DEPLOY_PROJECT": "/srv/projects/train_deploy"}
    result = subprocess.run([str(AIRFLOW_PYTHON), "-c", script, str(generated_dag)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["errors"] == {}
    assert (found["max_active_runs"], found["catchup"]) == (1, False)
    assert found["retries"] == [2]
    # Airflow's pins conflict with the project's: every task runs in the project's own venv
    assert found["runs_in"] == ["_PythonExternalDecoratedOperator /srv/projects/train_deploy/.venv/bin/python"]
    assert found["trigger"].pop("scheduled") == "schedule"  # what hooks.tracking.tag_trigger tags the MLflow run with
    assert set(found["trigger"].values()) == {"manual"}  # airflow dags trigger, backfills, …
    corpus = next(task for task, nodes in _task_nodes(ast.parse(generated_dag.read_text())).items()
                  if "encode_corpus" in nodes)
    assert found["upstream"]["check-for-changes"] == []
    assert found["skip_on_exit_code"] == [99]  # nothing to retrain: the DAG run's tasks are skipped
    assert found["upstream"]["train-model"] == sorted(["check-for-changes", corpus])
    assert {corpus, "train-model", "export-bundle", "report-export"} <= set(found["upstream"]["register-bundle"])


def _airflow(*args: str, env: dict[str, str]) -> str:
    """`airflow …` of the Airflow venv; its output (stdout and stderr)."""
    result = subprocess.run([str(AIRFLOW_PYTHON.with_name("airflow")), *args], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not AIRFLOW_PYTHON.exists() or not os.environ.get("TRAIN_DEPLOY_AIRFLOW_RUN"),
                    reason="a whole DAG run twice (minutes): `make airflow-check` runs it")
def test_airflow_dag_run_trains_and_registers_then_skips_an_unchanged_corpus(generated_dag, project_copy,
                                                                              tmp_path):
    from mlflow import MlflowClient

    from tests.helpers.project import tiny_train_deploy_params

    project = tmp_path / "project"
    shutil.copytree(project_copy, project)
    (project / "conf" / "local" / "parameters_tiny.yml").write_text(json.dumps(tiny_train_deploy_params()))
    (tmp_path / "dags").mkdir()
    shutil.copy(generated_dag, tmp_path / "dags")
    tracking = f"sqlite:///{tmp_path / 'mlruns.db'}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AIRFLOW"))},
           "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "TRAIN_DEPLOY_PROJECT": str(project),
           "TRAIN_DEPLOY_PYTHON": sys.executable, "MLFLOW_TRACKING_URI": tracking,
           "KEDRO_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
    _airflow("db", "migrate", env=env)
    _airflow("dags", "reserialize", env=env)
    runs = [_airflow("dags", "test", "train-deploy", env=env) for _ in range(2)]

    assert all("DagRun Finished" in run and "state=success" in run.split("DagRun Finished")[1] for run in runs)
    client = MlflowClient(tracking)
    trained, skipped = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                          order_by=["attributes.start_time ASC"])
    # One MLflow run per DAG run: every task of the first logged into the run check-for-changes opened.
    assert {"corpus", "train", "averaging", "export"} <= {key.split(".")[0] for key in trained.data.metrics}
    assert (trained.data.tags["trigger"], trained.data.tags.get("outcome")) == ("manual", None)
    champion = client.get_model_version_by_alias("train_deploy_lm", "champion")
    assert (str(champion.version), champion.run_id) == ("1", trained.info.run_id)
    # The second found nothing new: recorded as skipped, nothing trained or registered.
    assert skipped.data.tags["outcome"] == "skipped"
    assert skipped.data.tags["retrain.reason"].startswith("nothing to retrain")
    assert skipped.data.metrics == {}
    assert len(client.search_model_versions("name='train_deploy_lm'")) == 1
