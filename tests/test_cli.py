"""`kedro run` through the project's command (train_deploy.cli), as a user types it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from kedro.io import DataCatalog
from kedro.pipeline import node, pipeline
from kedro.runner import SequentialRunner

from train_deploy.cli import NoResumeHint
from train_deploy.config import ConfigError
from train_deploy.corpus.errors import CorpusError


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
