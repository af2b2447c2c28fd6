"""`kedro run` through the project's command (train_deploy.cli), as a user types it."""

from __future__ import annotations

import os
import subprocess
import sys


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
