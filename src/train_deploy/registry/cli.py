"""``train-deploy-registry``: the promotion history of a registered model, and rolling ``champion`` back.

    train-deploy-registry history  [--model M] [--project DIR] [--env ENV] [--tracking-uri URI]
    train-deploy-registry rollback [--model M] [--project DIR] [--env ENV] [--tracking-uri URI]

The store is the project's, found as ``train-deploy serve`` finds it (:mod:`train_deploy.project`): the project is
``--project``, else the current folder, else the checkout this command is installed from; its store is the one its
runs use (``conf/<env>/mlflow.yml``, where ``MLFLOW_TRACKING_URI`` wins as in a run). ``--tracking-uri`` names
another; outside any project ``MLFLOW_TRACKING_URI`` does. ``--model`` defaults to the project's
``registry.model_name`` (outside any project, ``train_deploy_lm``). Credentials, as for MLflow, come only from
``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN``. Output goes to stdout; an error is one line on stderr and exit
status 1. ``rollback`` takes the model's registry lock (``train_deploy.registry.aliases``): it waits for a gate that
is moving the aliases, and completes a move an interrupted run recorded before it rolls back.
:func:`registry_command` is the command the end of a run prints.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.project import CHECKOUT, NoProject, find_project, project_config, store_uris
from train_deploy.redaction import redact_uri
from train_deploy.registry.aliases import AliasMoveError, RollbackError, rollback
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.history import format_table, read_history
from train_deploy.registry.retry import RegistryRefused, RegistryUnreachable, Retrying


class NoStore(RuntimeError):
    """No store to read: no project and no URI, or the project's local store does not exist yet."""


_OPTIONS = (
    click.option("--model", help="registered model name (default: the project's registry.model_name)"),
    click.option("--project", type=click.Path(file_okay=False, path_type=Path),
                 help="the project folder (default: here, else the checkout this is installed from)"),
    click.option("--env", "-e", help="Kedro environment whose mlflow.yml and parameters to read (default: local)"),
    click.option("--tracking-uri", help="MLflow tracking URI (default: the project's store)"),
)


def _store_options(command: Callable[..., None]) -> Callable[..., None]:
    """The options every command takes: which model, in which project's store."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


@click.group(name="train-deploy-registry", context_settings={"help_option_names": ["-h", "--help"]})
def registry() -> None:
    """The promotion history of a registered model, and rolling `champion` back.

    Output goes to stdout; an error is one line on stderr and exit status 1.
    """


@registry.command("history", short_help="Print the promotion history, oldest first.")
@_store_options
def _history(**where: Any) -> None:
    """Print every promotion decision and rollback of the model, oldest first."""
    store = _store("history", **where)
    _or_one_line("history", store, lambda: _print_history(store.client, store.model))


@registry.command("rollback", short_help="Put the previous champion back.")
@_store_options
def _rollback(**where: Any) -> None:
    """champion <- previous, previous <- the old champion; recorded in the history."""
    store = _store("rollback", **where)
    retry = Retrying(RegistryConfig().retries, store.registry_uri)
    _or_one_line("rollback", store, lambda: click.echo(
        f"{store.model}: {rollback(store.client, store.model, retry)['reason']}"))


def main(argv: list[str] | None = None) -> None:
    """Run one command (``argv``, else the command line) and exit with its status: 0, 1 (an error, in one line)
    or 2 (a usage error)."""
    registry.main(args=argv, prog_name="train-deploy-registry")


@dataclass(frozen=True, slots=True)
class _Store:
    """The registry a command reads or changes, and the model it is about."""

    client: MlflowClient
    registry_uri: str
    model: str


def _store(command: str, *, model: str | None, project: Path | None, env: str | None,
           tracking_uri: str | None) -> _Store:
    """The store to use and the model name; exits 1 in one line when there is no store."""
    try:
        (tracking, registry_uri), model = _store_and_model(model, project, env, tracking_uri)
    except (NoStore, NoProject) as missing:
        _fail(f"train-deploy-registry {command}: {missing}")
    return _Store(MlflowClient(tracking_uri=tracking, registry_uri=registry_uri), registry_uri, model)


def _or_one_line(command: str, store: _Store, action: Callable[[], None]) -> None:
    """Run ``action``; a registry error ends the command with one line naming the store (its URI redacted)."""
    try:
        action()
    except (MlflowException, RollbackError, AliasMoveError, RegistryUnreachable, RegistryRefused) as exc:
        _fail(f"train-deploy-registry {command}: {redact_uri(store.registry_uri)}: "
              f"{redact_uri(_one_line(exc, command, store.model))}")


def _print_history(client: MlflowClient, model: str) -> None:
    events = read_history(client, model)
    click.echo(format_table(events) if events else f"{model}: no history yet\n", nl=False)


def _fail(line: str) -> NoReturn:
    click.echo(line, err=True)
    sys.exit(1)


def _store_and_model(model: str | None, project: Path | None, env: str | None,
                     tracking_uri: str | None) -> tuple[tuple[str, str], str]:
    """The (tracking, registry) URIs and the model name to use; raises :class:`NoStore` or ``NoProject``."""
    try:
        found = find_project(project)
    except NoProject as missing:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if project is not None:
            raise
        if not uri:
            raise NoStore(f"{missing}, or name the store with --tracking-uri or MLFLOW_TRACKING_URI") from None
        return (uri, uri), model or RegistryConfig().model_name
    model = model or RegistryConfig.from_params(project_config(found, env)["parameters"].get("registry")).model_name
    if tracking_uri:
        return (tracking_uri, tracking_uri), model
    tracking, registry_uri = store_uris(found, env)
    if tracking.startswith("sqlite:///") and not Path(tracking.removeprefix("sqlite:///")).is_file():
        raise NoStore(f"no versions of {model} yet: the project's MLflow store "
                      f"{Path(tracking.removeprefix('sqlite:///')).name} does not exist until a run registers one")
    return (tracking, registry_uri), model


def _one_line(exc: Exception, command: str, model: str) -> str:
    """The error as one line: the model's absence, a refused account, or the first line of the message."""
    if isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST":
        return f"no versions of {model} yet"
    status = exc.get_http_status_code() if isinstance(exc, MlflowException) else getattr(exc, "status", None)
    if status == 403:  # a team server's account
        needs, account = "READ" if command == "history" else "EDIT", os.environ.get("MLFLOW_TRACKING_USERNAME")
        return f"permission denied (HTTP 403) for {account!r}: needs {needs} on registered model {model}"
    message = exc.message if isinstance(exc, MlflowException) else str(exc)
    return message.strip().splitlines()[0] if message.strip() else repr(exc)


def registry_command(command: str, model_name: str, project: Path, env: str | None = None) -> str:
    """``train-deploy-registry <command>`` for ``model_name`` as it works when typed from any folder: this
    environment's executable, the project when it is not the checkout the command finds by itself, and the Kedro
    environment when it is not the default one."""
    line = [str(Path(sys.executable).parent / "train-deploy-registry"), command, "--model", model_name]
    if Path(project).resolve() != CHECKOUT:
        line += ["--project", str(Path(project).resolve())]
    if env and env != "local":
        line += ["--env", env]
    return shlex.join(line)


if __name__ == "__main__":
    main()
