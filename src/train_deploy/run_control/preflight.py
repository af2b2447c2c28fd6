"""A run's configuration checked before any node runs: every stage's block, and what one stage needs of another.

The run's owner, :class:`train_deploy.hooks.RunLife`, calls :func:`check_run`, so that a bad value
stops ``kedro run`` at once with one line naming the key, not hours later inside a worker. The blocks built here are
the run's configuration: RunLife hands them to the nodes, whose ``from_params`` passes a built block on (a node
called alone, in a test, still parses its mapping).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from train_deploy.averaging.config import AveragingConfig
from train_deploy.config import check
from train_deploy.corpus.config import CorpusConfig
from train_deploy.environment import scoped_environment
from train_deploy.export.config import ExportConfig
from train_deploy.redaction import redact_uri
from train_deploy.registry.config import RegistryConfig
from train_deploy.retention import Layout, RetentionConfig, check_budget, last_run_bytes
from train_deploy.run_control.retrain import RetrainConfig
from train_deploy.training.config import TrainingConfig
from train_deploy.validation.config import ValidationConfig

# Parameter block → the class whose ``from_params`` validates it (``conf/base/parameters_<block>.yml``).
STAGE_CONFIGS: dict[str, type] = {
    "corpus": CorpusConfig,
    "validation": ValidationConfig,
    "training": TrainingConfig,
    "averaging": AveragingConfig,
    "export": ExportConfig,
    "registry": RegistryConfig,
    "retrain": RetrainConfig,  # not a stage: whether a run of the whole chain trains (train_deploy.run_control.retrain)
    "retention": RetentionConfig,  # not a stage: what train-deploy gc keeps, the disk budget (train_deploy.retention)
}


def check_run(params: Mapping[str, Any], stages: Collection[str]) -> dict[str, Any]:
    """Validate every stage block of ``params`` (a missing one has its defaults), then what the ``stages`` the
    run contains need of each other; return the typed configurations by block name."""
    configs = {name: cls.from_params(params.get(name)) for name, cls in STAGE_CONFIGS.items()}
    check_validation_split(configs["corpus"], configs["averaging"] if "averaging" in stages else None,
                           configs["export"] if "export" in stages else None)
    return configs


class UnwritableLocation(RuntimeError):
    """A catalog location the run will write cannot be written; the message names the entry and the folder."""


def check_writable(catalog, pipeline) -> None:
    """Every local catalog location the ``pipeline`` writes (its outputs, and the work folders its nodes write
    into) can be written, or :class:`UnwritableLocation` names the first that cannot: found before the first
    node, not after hours of training. A location that does not exist yet is checked at the folder it would be
    made in; each is checked by creating (and removing) a file there, which also catches a read-only mount.
    Then the room: :func:`check_disk_budget` (``retention.disk``) for the project in the current folder, where
    ``kedro run`` runs."""
    import mlflow

    from train_deploy.datasets import WorkFolderDataset

    for name in sorted(pipeline.datasets()):
        dataset = catalog.get(name) if name in catalog else None
        if dataset is None or not hasattr(dataset, "_filepath") or getattr(dataset, "_protocol", "file") != "file":
            continue  # in memory, parameters, or remote storage (its own client reports its errors)
        if name in pipeline.all_outputs() or isinstance(dataset, WorkFolderDataset):
            reason = _unwritable(Path(str(dataset._filepath)))
            if reason:
                raise UnwritableLocation(f"catalog entry {name!r}: {reason}; make it writable or move the entry "
                                         "in conf/local/catalog.yml")
    check_disk_budget(catalog, Path.cwd(), mlflow.get_tracking_uri())


def check_disk_budget(catalog, project: Path, tracking_uri: str) -> None:
    """The run fits: the project's folders (``data/``, a local MLflow store) plus what it will add stay within
    ``retention.disk.budget``, and the disk has that much free; else :class:`~train_deploy.retention.OverBudget`
    says in one line how much is used, by which folders. What the run adds is ``retention.disk.run_estimate``, or
    the last run's outputs as measured on disk (nothing before the first run)."""
    config = RetentionConfig.from_params(catalog.load("parameters").get("retention")).disk
    layout = Layout.from_catalog(catalog, project, tracking_uri)
    if config.estimate_bytes is not None:
        needed, how = config.estimate_bytes, "retention.disk.run_estimate"
    else:
        needed = last_run_bytes(layout)
        how = "the last run's outputs" if needed else "no run yet to measure"
    check_budget(layout.roots, config.budget_bytes, needed, how, project)


def _unwritable(location: Path) -> str | None:
    """Why nothing can be written at ``location`` or beside it (a folder dataset stages its new version beside
    the entry and renames it into place), or None."""
    places = [location, location.parent] if location.is_dir() else [location.parent]
    return next(filter(None, (_unwritable_folder(place, location) for place in places)), None)


def _unwritable_folder(folder: Path, location: Path) -> str | None:
    """Why no file can be made in ``folder`` (or the folder it would be made in), or None."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder, so {location} cannot be made"
    try:
        handle, probe = tempfile.mkstemp(prefix=".train_deploy-writable-", dir=folder)
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror or type(exc).__name__})"
    os.close(handle)
    os.unlink(probe)
    return None


def check_validation_split(corpus: CorpusConfig, averaging: AveragingConfig | None,
                           export: ExportConfig | None) -> None:
    """Averaging compares checkpoints on the validation split and export checks parity on it: with either in
    the run (not None), the corpus stage must write one."""
    needs = [why for config, why in ((averaging, "averaging compares checkpoints on it"),
                                     (export, "export checks parity on it")) if config is not None]
    check(not needs or corpus.encoding.validation_fraction > 0, "corpus.encoding.validation_fraction",
          f"0 writes no validation split, but {' and '.join(needs)}; set it above 0 (e.g. 0.01)")


# What the pipeline authenticates to a tracking server with: MLflow reads them from the environment, where
# kedro-mlflow also puts the entry of conf/<env>/credentials.yml that ``server.credentials`` names.
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_HOW_TO_AUTHENTICATE = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in "
                        "the environment, or server.credentials in conf/local/mlflow.yml naming an entry of "
                        "conf/local/credentials.yml that holds them")


class TrackingServerError(RuntimeError):
    """The tracking server does not answer or refuses this client; the message names its URI and what to set."""


def check_tracking(config: Mapping[str, Any]) -> None:
    """Check the tracking server of kedro-mlflow's configuration (``config["mlflow"]``, ``config`` being a Kedro
    config loader) with the credentials the run will use (:func:`check_tracking_server`); local stores pass."""
    from kedro_mlflow.config.kedro_mlflow_config import KedroMlflowConfig

    mlflow_config = KedroMlflowConfig.model_validate({**config["mlflow"]})
    uri = mlflow_config.server.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "mlruns")
    if not uri.startswith(("http://", "https://")):
        return
    key = mlflow_config.server.credentials
    check_tracking_server(uri, mlflow_config.tracking.experiment.name,
                          _credentials_entry(config, key) if key is not None else None)


def _credentials_entry(config: Mapping[str, Any], key: str) -> Mapping[str, str]:
    """The entry ``key`` of the credentials configuration, which kedro-mlflow exports to the environment."""
    from kedro.config import MissingConfigException

    try:
        entry = config["credentials"].get(key)
    except MissingConfigException:
        entry = None
    if not isinstance(entry, Mapping):
        raise TrackingServerError(
            f"server.credentials: {key!r} is not an entry of conf/<env>/credentials.yml (a mapping of variables, "
            "e.g. MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD); add it to conf/local/credentials.yml")
    return entry


def check_tracking_server(uri: str, experiment: str, credentials: Mapping[str, str] | None = None,
                          timeout: float = 10.0) -> None:
    """Ask an ``http(s)`` tracking server ``uri`` once, without MLflow's minutes of retries, for ``experiment``, as
    the run will: with the environment's credentials and ``credentials`` (the ``server.credentials`` entry) over
    them. Raise :class:`TrackingServerError` when it does not answer within ``timeout`` seconds, refuses the
    credentials (401) or the experiment (403), or answers anything but an MLflow answer. Other URIs pass."""
    if not uri.startswith(("http://", "https://")):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    shown = redact_uri(uri)
    with scoped_environment(credentials or {}):
        sent = _sent_credentials()
        try:
            response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/get-by-name", "GET",
                                    params={"experiment_name": experiment}, max_retries=0, timeout=timeout)
        except Exception as exc:  # requests' and urllib3's connection errors and timeouts, wrapped by MLflow
            raise TrackingServerError(
                f"MLflow tracking server {shown} is unreachable ({_cause(exc)}): start it, or set "
                "MLFLOW_TRACKING_URI (or server.mlflow_tracking_uri in conf/local/mlflow.yml) to one that runs") \
                from None
    answer = " ".join(response.text.split())[:160]
    if response.status_code == 401:
        raise TrackingServerError(f"MLflow tracking server {shown} refused {sent} (HTTP 401): {_HOW_TO_AUTHENTICATE}")
    if response.status_code == 403 and "Invalid Host header" in answer:
        raise TrackingServerError(
            f"MLflow tracking server {shown} refused the host name in the URI (HTTP 403: {answer}): start it with "
            f"--allowed-hosts naming {urlsplit(uri).netloc.rpartition('@')[2]}, or use a name it allows")
    if response.status_code == 403:
        raise TrackingServerError(
            f"MLflow tracking server {shown} refused {sent} access to experiment {experiment!r} (HTTP 403: "
            f"{answer}): ask its admin for EDIT permission on it, or {_HOW_TO_AUTHENTICATE} of a user who has it")
    if response.status_code != 200 and not (response.status_code == 404 and "RESOURCE_DOES_NOT_EXIST" in answer):
        raise TrackingServerError(f"MLflow tracking server {shown} answered HTTP {response.status_code} "
                                  f"({answer}); is MLFLOW_TRACKING_URI an MLflow server?")


def _sent_credentials() -> str:
    """What a request carries, without the secret: ``user 'name'``, ``a token`` or ``no credentials``."""
    from mlflow.utils.credentials import read_mlflow_creds

    username = read_mlflow_creds().username
    if username:
        return f"user {username!r}"
    return "a token" if os.environ.get("MLFLOW_TRACKING_TOKEN") else "no credentials"


def _cause(exc: BaseException) -> str:
    """The innermost cause's first line, without user information in URIs."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return redact_uri(f"{type(exc).__name__}: {text[0] if text else ''}")[:200]
