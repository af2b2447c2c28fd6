"""A model of one's own corpus after the default run, as a user meets it through `kedro run`: the default model's
evaluation set is not used for another corpus, and the end of the run prints a serve command that works anywhere.
The runs that succeed run in this process, as KedroSession runs them (test_run.py); the refused one is the command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import cli_params, tiny_train_deploy_params
from tests.helpers.registry import ModelServer, ModelStore
from train_deploy.config import ConfigError
from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.lineage import check_same_corpus, suggested_name, warm_start_run_tags

DEMO = RegistryConfig().model_name
SERVE_PREFIX = "  serve the champion: "


@pytest.mark.parametrize(("paths", "name"), [
    (["/data/news/*.jsonl.zst"], "news_lm"), (["/srv/debian-reference/**/*.html"], "debian-reference_lm"),
    (["corpus.txt", "more.txt"], "corpus_lm"), ([], "people_daily_lm"), (["/*.txt"], "text_lm")])
def test_a_corpus_suggests_a_model_name_from_its_first_path(paths, name):
    source = "people_daily" if not paths else "text"
    assert suggested_name((source, paths)) == name


def test_the_registered_version_gets_the_runs_init_from_tags(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=mlflow.set_experiment("lineage").experiment_id):
        mlflow.set_tags({"init_from": "champion", "init_from.champion_version": "3", "init_from_x": "no",
                         "corpus.fingerprint": "abc"})
        assert warm_start_run_tags() == {"init_from": "champion", "init_from.champion_version": "3"}
    assert warm_start_run_tags() == {}  # outside a run


def _model_with_eval_set_from(client: MlflowClient, name: str, **params: str) -> None:
    """A registered model whose evaluation set a run with these parameters stored (as kedro-mlflow logs them)."""
    run = client.create_run(client.create_experiment(f"{name}-runs"))
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    client.create_registered_model(name, tags={"eval_set.uri": f"runs:/{run.info.run_id}/registry/eval_set.jsonl"})


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_the_corpus_of_the_evaluation_set_decides_refused_compared_or_free(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri, uri)
    _model_with_eval_set_from(client, "demo", **{"corpus.reader.source": "people_daily", "corpus.reader.paths": "[]",
                                                 "registry.eval_set.path": "None"})
    _model_with_eval_set_from(client, "bench", **{"corpus.reader.source": "people_daily", "corpus.reader.paths": "[]",
                                                  "registry.eval_set.path": "/data/bench.jsonl"})
    html = {"reader": {"source": "html", "paths": ["/data/site"]}}
    config = RegistryConfig.from_params({"model_name": "demo"})
    check_same_corpus(client, config, {"reader": {"source": "people_daily", "max_bytes": 1000}})  # the same corpus
    with pytest.raises(ConfigError, match=r"^registry\.model_name: registered model demo's evaluation set was made "
                       r"from corpus people_daily \(its built-in corpus\), this run reads html \['/data/site'\].*"
                       r"--params registry\.model_name=site_lm\), or set registry\.other_corpus: compare"):
        check_same_corpus(client, config, html)
    check_same_corpus(client, RegistryConfig.from_params({"model_name": "demo", "other_corpus": "compare"}), html)
    assert "the gate compares across corpora on that set because registry.other_corpus is compare" in caplog.text
    check_same_corpus(client, RegistryConfig.from_params({"model_name": "bench"}), html)  # a file: any corpus's
    check_same_corpus(client, RegistryConfig.from_params({"model_name": "new_lm"}), html)  # no model yet


def _shell() -> dict[str, str]:
    """A user's shell: no MLFLOW_* set (nor what this process's runs exported), so the project's own store."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}


def _run(project: Path, params: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "train_deploy", "--params",
                           ",".join(cli_params(params))], cwd=project, env=_shell(), capture_output=True, text=True,
                          timeout=1200)


def _run_here(project: Path, params: dict) -> None:
    """The same run in this process (no start-up, Paddle already imported), with the shell's MLFLOW_* (none)."""
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["train_deploy"])


def _state(client: MlflowClient, name: str) -> tuple[dict[str, str], list[str]]:
    """The aliases and versions of a registered model."""
    aliases = {alias: str(v) for alias, v in client.get_registered_model(name).aliases.items()}
    return aliases, sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'"))


@pytest.mark.slow
def test_own_corpus_after_the_default_run_gets_its_own_model_and_the_printed_serve_line_answers(project, tmp_path,
                                                                                             monkeypatch, capsys):
    # the project's own store (conf/base/mlflow.yml's sqlite:///mlruns.db), as a user's shell has no MLFLOW_* set
    for name in [name for name in os.environ if name.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    client = MlflowClient(f"sqlite:///{project / 'mlruns.db'}", f"sqlite:///{project / 'mlruns.db'}")
    _run_here(project, tiny_train_deploy_params(1))
    demo = _state(client, DEMO)
    assert demo == ({"champion": "1"}, ["1"])

    text = tmp_path / "my_news" / "news.txt"
    text.parent.mkdir()
    lines = strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[:3000])
    text.write_text("".join(f"{line}\n\n" for line in lines if line.strip()), encoding="utf-8")
    own = tiny_train_deploy_params(1)
    own["corpus"]["reader"] = {"source": "text", "paths": f"[{text}]", "chunk_bytes": 65536}

    runs = len(client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id]))
    refused = _run(project, own)
    assert refused.returncode == 1
    assert (f"\nConfigError: registry.model_name: registered model {DEMO}'s evaluation set was made from corpus "
            f"people_daily (its built-in corpus), this run reads text ['{text}'], and would be gated on the other "
            "corpus's texts; name a model of its own (--params registry.model_name=news_lm), or set "
            "registry.other_corpus: compare to gate on that set anyway\n") in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr + refused.stdout
    assert len(client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id])) == runs

    capsys.readouterr()
    own["corpus"]["reader"]["paths"] = [str(text)]  # the list that `--params …paths=[…]` becomes
    _run_here(project, {**own, "registry": {**own["registry"], "model_name": "news_lm"}})
    printed = capsys.readouterr().out
    assert "Registered news_lm version 1: became champion [first]\n" in printed
    assert _state(client, "news_lm") == ({"champion": "1"}, ["1"]) and _state(client, DEMO) == demo

    (line,) = [line.removeprefix(SERVE_PREFIX) for line in printed.splitlines() if line.startswith(SERVE_PREFIX)]
    assert line == shlex.join([str(Path(sys.executable).parent / "train-deploy"), "serve", "--model", "news_lm",
                               "--project", str(project)])
    elsewhere = tmp_path / "elsewhere"
    server = ModelServer("models:/news_lm@champion", ModelStore(tmp_path), elsewhere)
    server.command = shlex.split(line)  # exactly the printed line, on a free port (the option's variable)
    server._env = {**_shell(), "TRAIN_DEPLOY_SERVE_PORT": server.url.rsplit(":", 1)[1]}
    server.start()
    try:
        status, body = server.post({"inputs": ["今天天气很好。"]})
    finally:
        server.stop()
    assert status == 200 and body["predictions"][0]["tokens"] > 0, body
    assert not (elsewhere / "mlflow.db").exists() and not (project / "mlflow.db").exists()
    assert [p.name for p in elsewhere.iterdir()] == []
