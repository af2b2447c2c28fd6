"""The project's configuration as ``kedro run`` loads it (``conf/base`` under ``conf/<env>``), for the commands that
work beside a run without starting one: ``train-deploy serve`` and ``train-deploy-registry`` find the project and
read its MLflow store's URIs, the scheduler reads ``notify`` to report a slot it skipped."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

CONF_MARKER = Path("conf") / "base" / "mlflow.yml"
"""What makes a folder this project's: the configuration its runs read."""
LOGGING = Path("conf") / "logging.yml"
CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout this package is installed from, when it is an editable install (else a folder that is no project)."""


class NoProject(RuntimeError):
    """No project folder where a command looked; the message names the folder and what to pass instead."""


def project_config(project: Path, env: str | None):
    """The project's configuration loader, built from the project's Kedro settings as a run builds it."""
    if "kedro.framework.project" not in sys.modules and "KEDRO_LOGGING_CONFIG" not in os.environ \
            and (project / LOGGING).is_file():
        # a command's first import of Kedro: the project's logging, not Kedro's fallback, which says at INFO which
        # file it uses (on stdout, before the command's own output)
        os.environ["KEDRO_LOGGING_CONFIG"] = str(project / LOGGING)
    from kedro.framework.project import configure_project, settings

    configure_project(__package__)
    return settings.CONFIG_LOADER_CLASS(conf_source=str(project / "conf"), env=env, **settings.CONFIG_LOADER_ARGS)


def is_project(folder: Path) -> bool:
    """Whether ``folder`` holds the project's configuration and ``pyproject.toml``."""
    return (folder / CONF_MARKER).is_file() and (folder / "pyproject.toml").is_file()


def find_project(project: Path | None = None) -> Path:
    """The project folder: ``project`` when given, else the current folder when it is one, else the checkout this
    package is installed from (an editable install); raises :class:`NoProject`."""
    if project is not None:
        if not is_project(project.resolve()):
            raise NoProject(f"--project {project}: no {CONF_MARKER} and pyproject.toml there")
        return project.resolve()
    for candidate in (Path.cwd(), CHECKOUT):
        if is_project(candidate):
            return candidate
    raise NoProject(f"{Path.cwd()} is not the project folder and this installation is not a checkout: pass "
                    "--project with the folder holding conf/base/mlflow.yml")


def absolute_uri(uri: str, project: Path) -> str:
    """``uri`` with a relative local path (``sqlite:///mlruns.db``, ``file:mlruns``, ``mlruns``) made absolute
    against ``project``, where the runs resolve it; other URIs as they are."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        return uri if path.is_absolute() else f"sqlite:///{(project / path).as_posix()}"
    scheme = urlsplit(uri).scheme
    if scheme in ("", "file") and not Path(uri.removeprefix("file:")).is_absolute():
        return (project / uri.removeprefix("file:")).as_uri()
    return uri


def store_uris(project: Path, env: str | None = None) -> tuple[str, str]:
    """The tracking and registry URIs the project's runs use (``conf/<env>/mlflow.yml``; ``MLFLOW_TRACKING_URI``
    wins through its ``oc.env`` resolver), local paths absolute."""
    server = project_config(project, env)["mlflow"]["server"]
    tracking = absolute_uri(str(server["mlflow_tracking_uri"]), project)
    registry = server.get("mlflow_registry_uri")
    return tracking, absolute_uri(str(registry), project) if registry else tracking


def is_local_store(tracking_uri: str) -> bool:
    """Whether ``tracking_uri`` is a store on this machine's disk (SQLite, a folder), not a tracking server."""
    return tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri
