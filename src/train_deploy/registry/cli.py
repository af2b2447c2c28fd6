"""``train-deploy-registry``: the promotion history of a registered model, and rolling ``champion`` back.

    train-deploy-registry history  [--model M] [--project DIR] [--env ENV] [--tracking-uri URI]
    train-deploy-registry rollback [--model M] [--project DIR] [--env ENV] [--tracking-uri URI]

The store is the project's, found as ``train-deploy serve`` finds it (:mod:`train_deploy.conf`): the project is
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

import argparse
import os
import shlex
import sys
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.conf import CHECKOUT, NoProject, find_project, project_config, store_uris
from train_deploy.redaction import redact_uri
from train_deploy.registry.aliases import AliasMoveError, RollbackError, rollback
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.history import format_table, read_history
from train_deploy.registry.retry import RegistryRefused, RegistryUnreachable, Retrying


class NoStore(RuntimeError):
    """No store to read: no project and no URI, or the project's local store does not exist yet."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        (tracking, registry), model = _store_and_model(args)
    except (NoStore, NoProject) as missing:
        sys.stderr.write(f"train-deploy-registry {args.command}: {missing}\n")
        return 1
    client = MlflowClient(tracking_uri=tracking, registry_uri=registry)
    try:
        if args.command == "history":
            events = read_history(client, model)
            sys.stdout.write(format_table(events) if events else f"{model}: no history yet\n")
        else:
            event = rollback(client, model, Retrying(RegistryConfig().retries, registry))
            sys.stdout.write(f"{model}: {event['reason']}\n")
    except (MlflowException, RollbackError, AliasMoveError, RegistryUnreachable, RegistryRefused) as exc:
        sys.stderr.write(f"train-deploy-registry {args.command}: {redact_uri(registry)}: "
                         f"{redact_uri(_one_line(exc, args.command, model))}\n")
        return 1
    return 0


def _store_and_model(args: argparse.Namespace) -> tuple[tuple[str, str], str]:
    """The (tracking, registry) URIs and the model name to use; raises :class:`NoStore` or ``NoProject``."""
    try:
        project = find_project(args.project)
    except NoProject as missing:
        uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if args.project is not None:
            raise
        if not uri:
            raise NoStore(f"{missing}, or name the store with --tracking-uri or MLFLOW_TRACKING_URI") from None
        return (uri, uri), args.model or RegistryConfig().model_name
    model = args.model or RegistryConfig.from_params(
        project_config(project, args.env)["parameters"].get("registry")).model_name
    if args.tracking_uri:
        return (args.tracking_uri, args.tracking_uri), model
    tracking, registry = store_uris(project, args.env)
    if tracking.startswith("sqlite:///") and not Path(tracking.removeprefix("sqlite:///")).is_file():
        raise NoStore(f"no versions of {model} yet: the project's MLflow store "
                      f"{Path(tracking.removeprefix('sqlite:///')).name} does not exist until a run registers one")
    return (tracking, registry), model


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-deploy-registry", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("history", "print every promotion decision and rollback of the model, oldest first"),
                       ("rollback", "champion <- previous, previous <- the old champion; recorded in the history")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("--model", help="registered model name (default: the project's registry.model_name)")
        command.add_argument("--project", type=Path,
                             help="the project folder (default: here, else the checkout this is installed from)")
        command.add_argument("--env", "-e", help="Kedro environment whose mlflow.yml and parameters to read "
                                                 "(default: local)")
        command.add_argument("--tracking-uri", help="MLflow tracking URI (default: the project's store)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
