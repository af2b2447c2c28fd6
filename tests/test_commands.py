"""`train-deploy` (train_deploy.commands) as a user types it, from any folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TRAIN_DEPLOY = os.path.join(os.path.dirname(sys.executable), "train-deploy")


@pytest.mark.parametrize("arguments", [[], ["--help"]])
def test_train_deploy_alone_or_with_help_lists_its_commands_from_any_folder(tmp_path, arguments):
    done = subprocess.run([TRAIN_DEPLOY, *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    commands = done.stdout.split("Commands:")[1].split()
    assert [word for word in commands if word in ("run", "schedule", "serve")] == ["run", "schedule", "serve"]
    assert "Traceback" not in done.stderr and "INFO" not in done.stdout + done.stderr  # no Kedro logging banner
