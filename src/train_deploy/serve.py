"""``train-deploy serve``: a registered model of the project's MLflow store over HTTP, from any folder.

``mlflow models serve -m models:/train_deploy_lm@champion --env-manager local`` typed as it stands fails two
ways: ``mlflow`` (and the ``uvicorn`` it starts by name) is not on ``PATH`` outside an activated venv; MLflow 3
then reads its own default store (a new ``mlflow.db`` in the current folder), not the project's (with
``MLFLOW_TRACKING_URI=sqlite:///<project>/mlruns.db`` it works from any folder: the store records absolute artifact
locations; after the project moved, :func:`serve` says in one line to run ``train-deploy relocate``).
And MLflow's scoring server cannot stream, speak OpenAI's API or bound its queues, and drops a misspelled
parameter before the model sees it.

:func:`serve` therefore downloads the model in the project folder, with the tracking and registry URIs of the
project's ``mlflow.yml`` (``MLFLOW_TRACKING_URI`` wins, as in a run; local paths made absolute), into one folder
per model version in this machine's cache (:func:`cached_model`: a restart under a supervisor reuses it once every
file still has the size and xxh3-128 hash recorded at its download, a damaged copy is downloaded again, and
nothing else is left behind), and becomes this environment's ``uvicorn`` running ``train_deploy.serving.app`` (the
project's own server, docs/serving.md) from the package logged with the model; a version logged before that module
existed is served by the server its package holds (:func:`server_command`).
It replaces the current process, so Ctrl-C and SIGTERM reach the server. :func:`serve_line` is the command the end
of a run prints.

    .venv/bin/train-deploy serve                           # registry.model_name@champion on 127.0.0.1:5001
    /path/to/project/.venv/bin/train-deploy serve --model my_lm --port 8080     # from any folder
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

from train_deploy.atomic import atomic_folder, atomic_path, remove_leftovers
from train_deploy.cache import cache_dir
from train_deploy.hashing import digest, file_record
from train_deploy.project import NoProject, find_project, project_config, store_uris
from train_deploy.registry.config import RegistryConfig

logger = logging.getLogger(__name__)

DOWNLOAD_RECORD = "download.json"
"""In a cached model's folder: where the model lies in it, and every file's size and xxh3-128 hash at download."""


class ServeError(RuntimeError):
    """The model cannot be served as asked; the message names the project, store, model or alias."""


def default_model_name(project: Path, env: str | None = None) -> str:
    """``registry.model_name`` as the project's runs read it (conf/base, then conf/<env>)."""
    return RegistryConfig.from_params(project_config(project, env)["parameters"].get("registry")).model_name


def check_servable(tracking: str, registry: str, model_name: str, alias: str) -> Any:
    """The model version (MLflow's ``ModelVersion``) ``models:/<model_name>@<alias>`` (or ``/<version>``) names;
    raises :class:`ServeError` in one line when the store, the model or the alias is missing."""
    if tracking.startswith("sqlite:///") and not Path(tracking.removeprefix("sqlite:///")).is_file():
        raise ServeError(f"no MLflow store at {tracking.removeprefix('sqlite:///')}: run the pipeline first "
                         "(make run), or set MLFLOW_TRACKING_URI to the store that holds the model")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking, registry_uri=registry)
    try:
        found = (client.get_model_version(model_name, alias) if alias.isdigit() else
                 client.get_model_version_by_alias(model_name, alias))
    except MlflowException as exc:
        raise ServeError(f"{_shown(registry)}: registered model {model_name} has no "
                         f"{'version' if alias.isdigit() else 'alias'} {alias} ({exc.message.splitlines()[0]})"
                         ) from None
    return found


def check_store(tracking: str, project: Path) -> None:
    """Raise :class:`ServeError` with the command to run when the local store names a moved project's old folder;
    log the one-line advice for a store still recording locations relative to the project."""
    from train_deploy.registry.relocate import StoreMoved, check_locations

    try:
        warning = check_locations(tracking, project)
    except StoreMoved as moved:
        raise ServeError(str(moved)) from None
    if warning is not None:
        logger.warning(warning)


def _shown(uri: str) -> str:
    from train_deploy.redaction import redact_uri

    return redact_uri(uri)


SERVER_MODULE = Path("train_deploy") / "serving" / "app.py"
"""The server's module, as the package logged with the model holds it (from issue 38 on)."""
GUARDED_MODULE = Path("train_deploy") / "registry" / "server.py"
"""The server before it: MLflow's scoring server behind a guard, in the package of versions logged before."""


def server_command(model: Path, host: str, port: int, workers: int) -> list[str]:
    """The server of the downloaded ``model`` in this Python environment: uvicorn running
    ``train_deploy.serving.app`` from the package logged with the model (its ``code`` folder first on
    ``sys.path``); for a version logged before that module, the server its own package holds (MLflow's scoring
    server behind a guard), or ``mlflow models serve`` for one older still."""
    bin_folder = Path(sys.executable).parent
    uvicorn = [str(bin_folder / "uvicorn"), "--factory", "--app-dir", str(model / "code"), "--host", host, "--port",
               str(port), "--workers", str(workers)]
    if (model / "code" / SERVER_MODULE).is_file():
        return [*uvicorn, "train_deploy.serving.app:create_app"]
    if (model / "code" / GUARDED_MODULE).is_file():
        return [*uvicorn, "train_deploy.registry.server:create_app"]
    return [str(bin_folder / "mlflow"), "models", "serve", "-m", str(model), "--env-manager", "local", "-h", host,
            "-p", str(port), "--workers", str(workers)]


def cached_model(version: Any, tracking: str, registry: str) -> Path:
    """The model version ``version`` (MLflow's ``ModelVersion``) downloaded into this machine's cache
    (``train_deploy.cache.cache_dir()/serve``), one folder per version of one store: reused while every file it
    recorded at download has its size and xxh3-128 hash, else downloaded again and swapped in whole (a copy damaged
    or cut short is replaced). Two starts at once download it once; what an interrupted download left is removed."""
    # Named by what names the version for good: a store made again at the same path numbers its versions afresh.
    key = digest([registry, version.name, str(version.version), version.creation_timestamp, version.source], 8)
    folder = cache_dir() / "serve" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', version.name)[:64]}-{version.version}-{key}"
    with _held(folder.parent / f".{folder.name}.lock"):
        if (model := _verified(folder)) is not None:
            logger.info("Reusing the copy of %s version %s in %s", version.name, version.version, folder)
            return model
        remove_leftovers(folder.parent, f".{folder.name}.")  # a download killed midway (this lock is held)
        with atomic_folder(folder, "the downloaded model") as staging:
            model = download_model(f"models:/{version.name}/{version.version}", tracking, registry, staging / "model")
            files = {path.relative_to(staging).as_posix(): file_record(path)
                     for path in sorted(staging.rglob("*")) if path.is_file()}
            record = {"model": model.relative_to(staging).as_posix(), "files": files}
            (staging / DOWNLOAD_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        logger.info("Downloaded %s version %s into %s", version.name, version.version, folder)
        return folder / record["model"]


def download_model(model_uri: str, tracking: str, registry: str, target: Path) -> Path:
    """``model_uri`` downloaded from the store into the folder ``target``; the model's folder in it."""
    import mlflow

    mlflow.set_tracking_uri(tracking)
    mlflow.set_registry_uri(registry)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(target)))


def _verified(folder: Path) -> Path | None:
    """The model in the cached ``folder`` when every file its download record names is as recorded; else None."""
    try:
        record = json.loads((folder / DOWNLOAD_RECORD).read_text(encoding="utf-8"))
        files, model = record["files"], folder / _inside(record["model"])
        if not files or not model.is_dir():
            return None
        for name, expected in files.items():
            path = folder / _inside(name)
            if path.stat().st_size != expected["bytes"] or file_record(path) != expected:
                logger.warning("The cached copy in %s is damaged (%s differs from its download); downloading it "
                               "again", folder, name)
                return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if (folder / DOWNLOAD_RECORD).exists() or folder.exists():
            logger.warning("The cached copy in %s is incomplete or unreadable (%s); downloading it again", folder,
                           type(exc).__name__)
        return None
    return model


def _inside(name: str) -> PurePosixPath:
    """A relative name inside the cached folder (a record naming anything else is a damaged one)."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{DOWNLOAD_RECORD}: {name[:200]!r} is not a name inside the folder")
    return relative


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """An OS lock on ``path`` for the block (released by the kernel if this process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def server_environment(tracking: str, registry: str) -> dict[str, str]:
    """The server's environment: the project's store as tracking and registry URI, this environment's ``bin``
    first on ``PATH`` (the CLI starts ``uvicorn`` by name)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "MLFLOW_TRACKING_URI": tracking, "MLFLOW_REGISTRY_URI": registry, "PATH": path}


FOLLOWING_APP = "train_deploy.serving.follow:create_app"
"""The server that follows its alias (``--follow``): this environment's package, whatever version it serves."""


def follow_command(host: str, port: int, workers: int) -> list[str]:
    """This environment's uvicorn running the following server (:data:`FOLLOWING_APP`): the versions it moves to
    are served by the installed package, not the one logged with the first."""
    return [str(Path(sys.executable).parent / "uvicorn"), "--factory", "--host", host, "--port", str(port),
            "--workers", str(workers), FOLLOWING_APP]


SCALE_SETTINGS = ("TRAIN_DEPLOY_SERVE_SCALE_UP_S", "TRAIN_DEPLOY_SERVE_SCALE_DOWN_S")
"""What ``serving/replicas.py`` reads as Ray Serve's upscale and downscale delays (named here: that module
imports this one's callers, not the other way)."""


def replicas_command(host: str, port: int, replicas: tuple[int, int], ray_address: str | None,
                     scale_after: tuple[float | None, float | None] = (None, None)) -> tuple[list[str],
                                                                                        dict[str, str]]:
    """This environment's Python running ``train_deploy.serving.replicas`` (Ray Serve), and what it reads;
    ``scale_after``: the seconds before Ray Serve adds and removes a replica (None: Ray Serve's default)."""
    settings = {"TRAIN_DEPLOY_SERVE_HOST": host, "TRAIN_DEPLOY_SERVE_PORT": str(port),
                "TRAIN_DEPLOY_SERVE_REPLICAS": str(replicas[0]), "TRAIN_DEPLOY_SERVE_MAX_REPLICAS": str(replicas[1])}
    if ray_address:
        settings["TRAIN_DEPLOY_RAY_ADDRESS"] = ray_address
    settings |= {name: str(seconds) for name, seconds in zip(SCALE_SETTINGS, scale_after, strict=True)
                 if seconds is not None}
    return [sys.executable, "-m", "train_deploy.serving.replicas"], settings


def served_copy(project: Path, tracking: str, registry: str, name: str, alias: str) -> tuple[str, Path]:
    """The version ``alias`` names and its downloaded copy (:func:`cached_model`), recorded as the alias's last
    served copy; when a tracking server does not answer at all, that last copy (verified by its hashes), with a
    warning, so a serving host restarted during an outage serves on (``--follow`` then polls until it answers)."""
    last = _last_served(registry, name, alias)
    if not alias.isdigit() and not _answers(tracking):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(last.read_text(encoding="utf-8"))
            if (model := _verified(Path(record["folder"]))) is not None:
                logger.warning("%s does not answer: serving the copy of %s version %s downloaded before (%s)",
                               _shown(tracking), name, record["version"], record["folder"])
                return str(record["version"]), model
    found = check_servable(tracking, registry, name, alias)
    check_store(tracking, project)
    os.chdir(project)  # a store written before locations were absolute resolves them from the project folder
    model = cached_model(found, tracking, registry)
    record_served(registry, name, alias, str(found.version), model)
    return str(found.version), model


def _last_served(registry: str, name: str, alias: str) -> Path:
    """The record of the copy last served for ``name@alias`` of ``registry``, beside the cached versions."""
    return cache_dir() / "serve" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', f'{name}@{alias}')[:80]}-" \
        f"{digest([registry, name, alias], 8)}.json"


def record_served(registry: str, name: str, alias: str, version: str, model: Path) -> None:
    """Record the cached ``model`` (version ``version``) as the copy served for ``name@alias``: what a start while
    the tracking server does not answer serves (:func:`served_copy`); ``--follow`` records each version it moves to."""
    with atomic_path(_last_served(registry, name, alias), "the last served copy's record") as staged:
        staged.write_text(json.dumps({"version": version, "folder": str(_version_folder(model))}) + "\n",
                          encoding="utf-8")


def _version_folder(model: Path) -> Path:
    """The cached version's folder (holding :data:`DOWNLOAD_RECORD`) of the model folder inside it."""
    return next(folder for folder in (model, *model.parents) if (folder / DOWNLOAD_RECORD).is_file())


def _answers(tracking: str) -> bool:
    """Whether a tracking server at ``tracking`` answers HTTP at all (any status); a local store always does."""
    if not tracking.startswith(("http://", "https://")):
        return True
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{tracking.rstrip('/')}/health", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def serve(*, project: Path | None = None, env: str | None = None, model_name: str | None = None,
          alias: str = "champion", host: str = "127.0.0.1", port: int = 5001, workers: int = 1,
          admission: dict[str, str] | None = None, poll_interval: float | None = None,
          replicas: tuple[int, int] | None = None, ray_address: str | None = None,
          scale_after: tuple[float | None, float | None] = (None, None)) -> NoReturn:
    """Check the model is there, download it, then become its server in the project folder (see the module);
    ``admission``: the server's ``TRAIN_DEPLOY_SERVE_*`` settings (``serving.app.ServerSettings``);
    ``poll_interval``: follow the alias, looking at the registry every so many seconds (``serving/follow.py``);
    ``replicas``: (least, most) Ray Serve replicas instead of uvicorn (``serving/replicas.py``), ``scale_after``
    the seconds before Ray Serve adds and removes one between the two."""
    if poll_interval is not None and alias.isdigit():
        raise ServeError(f"--follow: version {alias} never moves; follow an alias (--alias champion)")
    try:
        folder = find_project(project)
    except NoProject as missing:
        raise ServeError(str(missing)) from None
    tracking, registry = store_uris(folder, env)
    name = model_name or default_model_name(folder, env)
    version, model = served_copy(folder, tracking, registry, name, alias)
    model_uri = f"models:/{name}/{alias}" if alias.isdigit() else f"models:/{name}@{alias}"
    command = server_command(model, host, port, workers) if poll_interval is None else \
        follow_command(host, port, workers)
    ray_settings: dict[str, str] = {}
    if replicas is not None:
        command, ray_settings = replicas_command(host, port, replicas, ray_address, scale_after)
    sys.stderr.write(f"Serving {model_uri} (version {version}) of {_shown(tracking)} on http://{host}:{port} "
                     f"(POST /invocations, POST /v1/completions, the playground at /); Ctrl-C stops it\n")
    if not command[-1].startswith("train_deploy.serving"):
        sys.stderr.write(f"  version {version} was logged before train_deploy's server: the server its package "
                         "holds serves it, without OpenAI's API, the playground or admission control\n")
    served = {"TRAIN_DEPLOY_SERVED_MODEL": str(model), "TRAIN_DEPLOY_SERVED_NAME": name,
              "TRAIN_DEPLOY_SERVED_VERSION": version}
    if poll_interval is not None:
        sys.stderr.write(f"  following {name}@{alias}: the registry is asked every {poll_interval:g} s; a new version "
                         "is checked, then served without a failed request\n")
        served |= {"TRAIN_DEPLOY_FOLLOW_ALIAS": alias, "TRAIN_DEPLOY_FOLLOW_POLL_S": str(poll_interval),
                   # where the tracking server's webhook reaches this server (serving/webhook.py)
                   "TRAIN_DEPLOY_SERVE_HOST": host, "TRAIN_DEPLOY_SERVE_PORT": str(port),
                   "TRAIN_DEPLOY_SERVE_WORKERS": str(workers),
                   "TRAIN_DEPLOY_FOLLOW_NOTIFY": json.dumps(  # a refused version is alerted like a run's outcome
                       project_config(folder, env)["parameters"].get("notify") or {})}
    sys.stderr.flush()
    os.execve(command[0], command, {**server_environment(tracking, registry), **(admission or {}), **served,
                                    **ray_settings})


def serve_line(model_name: str, project: Path) -> str:
    """The command that serves ``model_name``'s champion from any folder: this environment's ``train-deploy
    serve``, naming the project when it is not the checkout the command finds by itself."""
    command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--model", model_name]
    if Path(project).resolve() != Path(__file__).resolve().parents[2]:
        command += ["--project", str(Path(project).resolve())]
    return shlex.join(command)
