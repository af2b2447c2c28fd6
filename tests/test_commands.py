"""`train-deploy` (train_deploy.commands) as a user types it, from any folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRAIN_DEPLOY = os.path.join(os.path.dirname(sys.executable), "train-deploy")


@pytest.mark.parametrize("arguments", [[], ["--help"]])
def test_train_deploy_alone_or_with_help_lists_its_commands_from_any_folder(tmp_path, arguments):
    done = subprocess.run([TRAIN_DEPLOY, *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    commands = done.stdout.split("Commands:")[1].split()
    assert [word for word in commands if word in ("gc", "run", "schedule", "serve")] == ["gc", "run", "schedule",
                                                                                         "serve"]
    assert "Traceback" not in done.stderr and "INFO" not in done.stdout + done.stderr  # no Kedro logging banner


def _runs(folder, names: list[str]) -> None:
    """Run folders of 64 KiB each, the first oldest."""
    for age, name in enumerate(reversed(names)):
        (folder / name).mkdir(parents=True)
        (folder / name / "payload").write_bytes(os.urandom(64 * 1024))
        os.utime(folder / name, (time.time() - 60 * age, time.time() - 60 * age))


def test_gc_dry_run_lists_what_would_go_then_gc_removes_logs_and_records_it(project):
    from click.testing import CliRunner

    from train_deploy.commands import main
    from train_deploy.retention import read_records

    checkpoints = project / "data" / "06_models" / "checkpoints"
    _runs(checkpoints, ["run-a", "run-b", "run-c", "run-d"])  # keep_runs 2: a and b go
    dry = CliRunner().invoke(main, ["gc", "--dry-run", "--project", str(project)])
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.startswith("Dry run: nothing removed.")  # the logging goes to standard error
    listed = [line.split() for line in dry.stdout.splitlines()[1:-1]]
    assert sorted((words[0], words[3]) for words in listed) == [("checkpoints", "data/06_models/checkpoints/run-a:"),
                                                          ("checkpoints", "data/06_models/checkpoints/run-b:")]
    assert "2 to remove, " in dry.stdout and "kept for their aliases: no version" in dry.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["run-a", "run-b", "run-c", "run-d"]

    real = CliRunner().invoke(main, ["gc", "--project", str(project)])
    assert real.exit_code == 0, real.output
    assert real.stdout.startswith("Removed 2, freed "), real.output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["run-c", "run-d"]
    (record,) = read_records(project / "data" / "08_reporting" / "retention.jsonl")
    assert sorted(Path(r["target"]).name for r in record["removed"]) == ["run-a", "run-b"]
    assert record["bytes_freed"] >= 128 * 1024 and record["last_run_bytes"] >= 64 * 1024
