"""``train-deploy gc``: decide, log, remove and record, under the project's run lock.

:func:`make_plan` decides (nothing is touched), :func:`apply` removes what a plan lists, logging each removal, and
appends one JSON line to ``retention.record`` (``data/08_reporting/retention.jsonl``): the time, each removal
with its reason and bytes, the versions kept for their aliases, the disk use after, and the last run's outputs'
size (what the disk budget's estimate reads). :func:`collect_project` does both for a project folder;
:func:`after_scheduled_run` runs it in a child process under the scheduler's lock.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train_deploy.retention.config import RetentionConfig
from train_deploy.retention.disk import human, usage
from train_deploy.retention.plan import Kept, Layout, Removal, last_run_bytes, plan_files

logger = logging.getLogger(__name__)

GC_TIMEOUT = 1800.0
"""Seconds the scheduler gives a collection after a run."""
_FILE_KINDS = ("checkpoints", "training_logs", "bundle", "token_files", "tokenizer", "init_cache")


@dataclass(kw_only=True, slots=True)
class Plan:
    """What a collection removes and what it keeps for the aliases."""

    kept: Kept
    removals: list[Removal] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(removal.bytes for removal in self.removals)

    def lines(self, project: Path) -> list[str]:
        """One line per removal, one per thing the counts or decisions would remove but an alias or a registered
        model needs (``kept``, with who needs it), then the total and the versions kept, per model: what
        ``--dry-run`` prints."""
        def name(target: str) -> str:
            path = Path(target)
            return str(path.relative_to(project)) if path.is_absolute() and path.is_relative_to(project) else target
        shown = [f"{r.kind:<13} {human(r.bytes):>10}  {name(r.target)}: {r.reason}" for r in self.removals]
        spared = [f"{kind:<13} {'kept':>10}  {name(target)}: {why}" for kind, target, why in self.kept.spared]
        return [*shown, *spared, f"{len(self.removals)} to remove, {human(self.bytes)} freed; kept for their aliases: "
                                 f"{self.kept.describe()}"]


def make_plan(layout: Layout, config: RetentionConfig, model_name: str, tracking_uri: str,
              experiment: str | None = None) -> Plan:
    """Decide what goes: the registry says what the aliases of every registered model of the project need
    (``model_name``, and every model with a version registered from a run of ``experiment``), then the folders and
    MLflow artifacts past the configured counts (``train_deploy.retention.plan``, ``.store``); in ``experiment``,
    what no version was registered from goes too (``retention.mlflow.unregistered``)."""
    from mlflow import MlflowClient

    from train_deploy.registry.config import RetryConfig
    from train_deploy.registry.retry import Retrying
    from train_deploy.retention.store import kept_by_aliases, plan_mlflow, project_models

    client, retry = MlflowClient(tracking_uri, tracking_uri), Retrying(RetryConfig(), tracking_uri)
    models = project_models(client, retry, model_name, experiment)
    kept = kept_by_aliases(client, retry, models)
    removals = plan_files(layout, config, models, kept) + plan_mlflow(client, retry, models, config.mlflow, kept,
                                                                      experiment)
    return Plan(kept=kept, removals=removals)


def apply(plan: Plan, layout: Layout, config: RetentionConfig, tracking_uri: str) -> dict:
    """Remove what ``plan`` lists (folders first, then MLflow's), log each removal, and append the record;
    return the record."""
    from mlflow import MlflowClient

    from train_deploy.datasets import _remove as remove_folder  # renamed first: no half folder under its name
    from train_deploy.retention.store import delete_and_collect

    removed: list[Removal] = []
    for removal in (r for r in plan.removals if r.kind in _FILE_KINDS):
        if Path(removal.target).exists():
            remove_folder(Path(removal.target))
            logger.info("Removed %s %s (%s): %s", removal.kind, removal.target, human(removal.bytes), removal.reason)
            removed.append(removal)
    collected = [r for r in plan.removals if r.kind not in _FILE_KINDS]
    delete_and_collect(MlflowClient(tracking_uri, tracking_uri), collected, config.mlflow, tracking_uri,
                       layout.project)
    for removal in collected:
        logger.info("Removed %s %s (%s): %s", removal.kind, removal.target, human(removal.bytes), removal.reason)
    record = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "removed": [asdict(r) for r in removed + collected], "bytes_freed": sum(r.bytes for r in removed +
                                                                                     collected),
              "kept": plan.kept.versions, "usage_bytes": usage(layout.roots).total,
              "last_run_bytes": last_run_bytes(layout)}
    append_record(layout.project / config.record, record)
    return record


def append_record(path: Path, record: dict) -> None:
    """One JSON line appended and flushed to disk (a collection's record is small; a torn last line is skipped
    by :func:`read_records`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())


def read_records(path: Path) -> list[dict]:
    """The records of ``path`` (none when it is missing), skipping a line that does not parse."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def after_scheduled_run(project: Path, command: list[str], lock) -> None:
    """``train-deploy gc`` for the project (and the ``--env`` of the run's ``command``) in a child process under
    the scheduler's run lock ``lock``, handed to it; never raises: a collection that fails is logged. A command
    that is not ``kedro run`` (the scheduler's tests run a script) collects nothing."""
    if command[1:4] != ["-m", "kedro", "run"]:
        return
    env = command[command.index("--env") + 1] if "--env" in command[:-1] else None
    gc = [sys.executable, "-c", "from train_deploy.commands import main; main()", "gc", "--project", str(project),
          "--after-run", *(["--env", env] if env else [])]
    try:
        fd, handed = lock.hand_over()
        done = subprocess.run(gc, cwd=project, pass_fds=(fd,), env={**os.environ, **handed}, capture_output=True,
                              text=True, timeout=GC_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("retention: the collection after the run did not run: %s", exc)
        return
    finally:
        lock.record()  # the child's release removed the holder's description; the scheduler still holds the lock
    last = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()[-1]
    if done.returncode != 0:
        logger.warning("retention: the collection after the run failed (rc %d): %s", done.returncode, last[:300])
    else:
        logger.info("retention: %s", last[:300])


class NothingToCollect(Exception):
    """``--after-run`` with ``retention.after_scheduled_run: false``: the scheduler's collection is off."""


def collect_project(project: Path, env: str | None = None, dry_run: bool = False, after_run: bool = False,
                    params: dict | None = None) -> tuple[Plan, dict | None]:
    """Plan the project's collection (its ``conf/<env>`` parameters, catalog and MLflow store) and, unless
    ``dry_run``, apply it under the run lock (a run in progress: :class:`~train_deploy.run_control.lock.RunLockHeld`
    names it). Return the plan and the record appended (None for a dry run)."""
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from train_deploy.registry.config import RegistryConfig
    from train_deploy.run_control.lock import RunConfig, RunLock

    project = project.resolve()
    os.chdir(project)  # as kedro run: the catalog's and the local store's relative paths resolve here
    bootstrap_project(project)
    with KedroSession.create(project_path=project, env=env, runtime_params=params) as session:
        context = session.load_context()  # kedro-mlflow's hook sets the tracking URI of conf/<env>/mlflow.yml
        catalog, parameters = context.catalog, context.params
        experiment = context.mlflow.tracking.experiment.name
    config = RetentionConfig.from_params(parameters.get("retention"))
    if after_run and not config.after_scheduled_run:
        raise NothingToCollect("retention.after_scheduled_run is false: nothing collected after the run")
    model_name = RegistryConfig.from_params(parameters.get("registry")).model_name
    tracking_uri = mlflow.get_tracking_uri()
    layout = Layout.from_catalog(catalog, project, tracking_uri)
    if dry_run:
        return make_plan(layout, config, model_name, tracking_uri, experiment), None
    lock = RunLock(project / "data")
    lock.acquire(RunConfig(lock="fail"), "gc (train-deploy gc)")
    try:
        plan = make_plan(layout, config, model_name, tracking_uri, experiment)
        return plan, apply(plan, layout, config, tracking_uri)
    finally:
        lock.release()
