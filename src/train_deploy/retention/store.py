"""The MLflow side of retention: what the versions holding an alias need, for every registered model of the project
(:func:`project_models`), the runs the models' tags name (the evaluation set's), and the artifacts of rejected
versions, removed through MLflow's own APIs (runs and logged models marked deleted, then ``mlflow gc``).

A rejected version stays registered with its tags (the history, and what scheduled retraining compares against:
the same corpus is not retrained every night); only its run (metrics, artifacts such as ``export/bundle``) and its
logged model (the bundle's second copy) go.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from mlflow import MlflowClient
from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException
from mlflow.store.entities.paged_list import PagedList

from train_deploy.registry.gate import DECISION_TAG
from train_deploy.registry.retry import Retrying
from train_deploy.retention.config import MlflowRetention
from train_deploy.retention.disk import tree_bytes
from train_deploy.retention.plan import Kept, Removal

logger = logging.getLogger(__name__)

GC_TIMEOUT = 600.0
_RUNS_URI = re.compile(r"^runs:/([0-9a-f]+)/")


class RetentionRefused(RuntimeError):
    """The tracking server refused this account a deletion; the message names the permission it needs."""


LOCK_MARK = ".aliases-lock"
"""In the name of the registered models ``train_deploy.registry.aliases`` uses as locks: never a project's model."""


def project_models(client: MlflowClient, retry: Retrying, model_name: str, experiment: str | None) -> dict[str, list]:
    """Each registered model of the project with its versions: ``model_name``, and every model (not a lock) with a
    version registered from a run of ``experiment``, whatever ``registry.model_name`` the current run uses."""
    names, found = [model_name], None
    if experiment:
        found = retry("find the experiment", lambda: client.get_experiment_by_name(experiment))
    if found is not None:
        every = retry("list the registered models", lambda: _all_pages(
            lambda token: client.search_registered_models(max_results=1000, page_token=token)))
        names += sorted(m.name for m in every if LOCK_MARK not in m.name and m.name != model_name)
    models = {}
    for name in names:
        versions = retry(f"list the versions of {name}", lambda n=name: client.search_model_versions(f"name = '{n}'"))
        if name == model_name or _from_experiment(client, retry, found.experiment_id, versions):
            models[name] = versions
    return models


def _from_experiment(client: MlflowClient, retry: Retrying, experiment_id: str, versions: list) -> bool:
    """Whether any of ``versions`` was registered from a run of ``experiment_id`` (one search per 100 versions)."""
    run_ids = sorted({v.run_id for v in versions if v.run_id})
    for first in range(0, len(run_ids), 100):
        listed = ", ".join(f"'{run_id}'" for run_id in run_ids[first:first + 100])
        if retry("find the versions' runs", lambda listed=listed: client.search_runs(
                [experiment_id], f"attributes.run_id IN ({listed})", ViewType.ALL, max_results=1)):
            return True
    return False


def kept_by_aliases(client: MlflowClient, retry: Retrying, models: dict[str, list]) -> Kept:
    """What every version holding an alias of each of ``models`` (name → versions) needs, each with who needs it;
    the runs the models' own tags name (their evaluation set's, ``eval_set.uri``); and what any version of them
    came from (:class:`Registered`: such folders take the ``keep_runs``/``keep_last`` places first)."""
    kept = Kept()
    for name, versions in models.items():
        try:
            model = retry(f"read registered model {name}", lambda n=name: client.get_registered_model(n))
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                continue
            raise
        for key, value in sorted(model.tags.items()):
            if (run_id := _RUNS_URI.match(value or "")) is not None:
                kept.need("run_ids", run_id.group(1), f"registered model {name}'s {key}")
        holders: dict[str, list[str]] = {}
        for alias, version in sorted(model.aliases.items()):
            holders.setdefault(str(version), []).append(alias)
        if holders:
            kept.versions[name] = holders
        by_number = {str(v.version): v for v in versions}
        for number, aliases in holders.items():
            found = by_number.get(number) or retry(f"read version {number} of {name}",
                                                   lambda n=name, v=number: client.get_model_version(n, v))
            _need_version(kept, name, found, f"{name} version {number} ({'/'.join(aliases)})")
        for version in versions:
            kept.registered.add(version.tags)
    return kept


def _need_version(kept: Kept, name: str, version, who: str) -> None:
    tags = version.tags
    for field_name, tag in (("run_names", "training.run_name"), ("bundle_fingerprints", "bundle.fingerprint"),
                            ("corpus_fingerprints", "corpus.fingerprint"), ("tokenizer_hashes", "tokenizer.hash")):
        if tags.get(tag):
            kept.need(field_name, tags[tag], who)
    if version.run_id:
        kept.need("run_ids", version.run_id, who)
    if model_id(version):
        kept.need("model_ids", model_id(version), who)
    kept.need("init_folders", f"{name}-v{version.version}", who)


def plan_mlflow(client: MlflowClient, retry: Retrying, models: dict[str, list], config: MlflowRetention, kept: Kept,
                experiment: str | None = None) -> list[Removal]:
    """The runs and logged models of the ``models``' versions whose gate decision is one of ``config.decisions``
    (rejected or failed), registered more than ``grace_days`` ago, that hold no alias and that nothing kept names;
    ones already marked deleted are listed again (``mlflow gc`` finishes them). Then what in ``experiment`` no
    version of any of them was registered from (:func:`plan_unregistered`)."""
    removals: list[Removal] = []
    for name, found in models.items():
        removals += _plan_versions(client, name, found, config, kept) if config.delete_rejected else []
    if config.unregistered and experiment:
        every = [v for found in models.values() for v in found]
        registered = {v.run_id for v in every} | {model_id(v) for v in every} | kept.run_ids | kept.model_ids
        removals += plan_unregistered(client, retry, experiment, config.grace_days, registered - {None}, kept)
    return removals


def _plan_versions(client: MlflowClient, name: str, found: list, config: MlflowRetention,
                   kept: Kept) -> list[Removal]:
    cutoff_ms = (time.time() - config.grace_days * 86400) * 1000
    removals: list[Removal] = []
    for version in sorted(found, key=lambda v: int(v.version)):
        decision = version.tags.get(DECISION_TAG)
        if decision not in config.decisions or str(version.version) in kept.versions.get(name, {}) or \
                version.creation_timestamp > cutoff_ms:
            continue
        why = (f"{name} version {version.version} was {decision} more than {config.grace_days:g} days ago and holds "
               "no alias")
        if version.run_id and not kept.spares("mlflow_run", version.run_id, "run_ids", version.run_id):
            removals += _run_removal(client, version.run_id, why)
        logged = model_id(version)
        if logged and not kept.spares("mlflow_model", logged, "model_ids", logged):
            removals += _model_removal(client, logged, why)
    return removals


def plan_unregistered(client: MlflowClient, retry: Retrying, experiment: str, grace_days: float,
                      registered: set[str], kept: Kept | None = None) -> list[Removal]:
    """What no version was registered from (``registered``: the versions' run and model ids) in ``experiment``, older
    than ``grace_days``: runs that ended ``FAILED`` or ``KILLED`` with their logged models (a night killed between
    logging the model and registering it leaves both copies of its bundle, named by nothing), and the extra logged
    models of a run that did register a version (a ``log the model`` try whose answer was lost, then retried)."""
    found = retry("find the experiment", lambda: client.get_experiment_by_name(experiment))
    if found is None:
        return []
    cutoff_ms = (time.time() - grace_days * 86400) * 1000
    runs = [run for status in ("FAILED", "KILLED") for run in retry(f"list the {status} runs", lambda s=status: (
        _all_pages(lambda token: client.search_runs([found.experiment_id], f"attributes.status = '{s}'", ViewType.ALL,
                                                    1000, page_token=token))))]
    models = retry("list the logged models", lambda: _all_pages(lambda token: client.search_logged_models(
        [found.experiment_id], max_results=1000, page_token=token)))
    removals: list[Removal] = []
    for run in sorted(runs, key=lambda r: r.info.start_time or 0):
        ended = run.info.end_time or run.info.start_time or 0
        if ended > cutoff_ms or kept is not None and kept.spares("mlflow_run", run.info.run_id, "run_ids",
                                                                   run.info.run_id) or run.info.run_id in registered:
            continue
        why = (f"run {run.info.run_name or run.info.run_id} ended {run.info.status} more than {grace_days:g} days "
               "ago and registered no version")
        removals += _run_removal(client, run.info.run_id, why)
        removals += [_logged_removal(m, why) for m in models
                     if m.source_run_id == run.info.run_id and m.model_id not in registered]
    twins = [m for m in models if m.source_run_id in registered and m.model_id not in registered
             and (m.creation_timestamp or 0) <= cutoff_ms]
    return removals + [_logged_removal(m, f"logged by run {m.source_run_id} beside the model it registered (a "
                                          f"retried log), more than {grace_days:g} days ago") for m in twins]


def _logged_removal(model, why: str) -> Removal:
    return Removal(kind="mlflow_model", target=model.model_id, bytes=_local_bytes(model.artifact_location),
                   reason=why)


def _all_pages(search: Callable[[str | None], PagedList]) -> list:
    """Every item of a paged MLflow search."""
    items, token = [], None
    while True:
        page = search(token)
        items += list(page)
        token = page.token
        if not token:
            return items


def model_id(version) -> str | None:
    """The logged model a version was registered from (MLflow 3: ``models:/m-<id>`` as its source, where the store
    does not fill ``model_id``), or None."""
    if getattr(version, "model_id", None):
        return version.model_id
    source = version.source or ""
    return source.removeprefix("models:/") if source.startswith("models:/m-") and "/" not in source[9:] else None


def _run_removal(client: MlflowClient, run_id: str, why: str) -> list[Removal]:
    try:
        run = client.get_run(run_id)
    except MlflowException:  # removed for good already
        return []
    return [Removal(kind="mlflow_run", target=run_id, bytes=_local_bytes(run.info.artifact_uri), reason=why)]


def _model_removal(client: MlflowClient, model_id: str, why: str) -> list[Removal]:
    try:
        model = client.get_logged_model(model_id)
    except MlflowException:
        return []
    return [Removal(kind="mlflow_model", target=model_id, bytes=_local_bytes(model.artifact_location), reason=why)]


def _local_bytes(uri: str | None) -> int:
    """Bytes under a local artifact location (relative: the project's ``mlartifacts/``); 0 on a server."""
    if not uri or "://" in uri and not uri.startswith("file://"):
        return 0
    return tree_bytes(Path(urlsplit(uri).path if uri.startswith("file://") else uri))


def delete_and_collect(client: MlflowClient, removals: list[Removal], config: MlflowRetention, tracking_uri: str,
                       project: Path) -> None:
    """Mark the runs and logged models of ``removals`` deleted, then remove them for good with ``mlflow gc`` (in
    the project folder, where a local store's relative artifact locations resolve); with a tracking server and no
    ``gc_backend_store_uri``, log the command its admin runs instead."""
    runs = [r.target for r in removals if r.kind == "mlflow_run"]
    models = [r.target for r in removals if r.kind == "mlflow_model"]
    if not runs and not models:
        return
    try:
        for run_id in runs:
            if client.get_run(run_id).info.lifecycle_stage != "deleted":
                client.delete_run(run_id)
        for model_id in models:
            client.delete_logged_model(model_id)
    except MlflowException as exc:
        if exc.get_http_status_code() != 403:
            raise
        account = os.environ.get("MLFLOW_TRACKING_USERNAME") or "this account"
        raise RetentionRefused(
            f"permission denied (HTTP 403) for {account!r} on {urlsplit(tracking_uri).hostname}: deleting runs and "
            "logged models needs MANAGE on the project's experiment (MLflow's EDIT cannot delete); the admin grants "
            "it as docs/team-server.md's accounts step does") from None
    command = gc_command(tracking_uri, config, runs, models)
    if command is None:
        logger.warning("Marked %d run(s) and %d logged model(s) deleted on %s; their artifacts go when its admin "
                       "runs: mlflow gc --backend-store-uri <its database> --artifacts-destination <its artifact "
                       "root> --run-ids %s --logged-model-ids %s (or set retention.mlflow.gc_backend_store_uri)",
                       len(runs), len(models), urlsplit(tracking_uri).hostname, ",".join(runs) or "''",
                       ",".join(models) or "''")
        return
    done = subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=GC_TIMEOUT, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"mlflow gc failed (rc {done.returncode}): {tail[:300]}")
    logger.info("mlflow gc removed %d run(s) and %d logged model(s) for good", len(runs), len(models))


def gc_command(tracking_uri: str, config: MlflowRetention, runs: list[str], models: list[str]) -> list[str] | None:
    """``mlflow gc`` for these ids against the store (a local one: its own URI; a server: the configured
    database, with ``--tracking-uri`` and ``--artifacts-destination``), or None when a server's database is not
    configured."""
    mlflow_cli = [sys.executable, "-m", "mlflow", "gc"]
    ids = [*(["--run-ids", ",".join(runs)] if runs else []),
           *(["--logged-model-ids", ",".join(models)] if models else [])]
    if not tracking_uri.startswith(("http://", "https://")):
        return [*mlflow_cli, "--backend-store-uri", tracking_uri, "--tracking-uri", tracking_uri, *ids]  # needs both
    if not config.gc_backend_store_uri:
        return None
    destination = (["--artifacts-destination", config.gc_artifacts_destination]
                   if config.gc_artifacts_destination else [])
    return [*mlflow_cli, "--backend-store-uri", config.gc_backend_store_uri, *destination, "--tracking-uri",
            tracking_uri, *ids]
