"""The project's commands: Kedro's project CLI module (``cli`` and ``run``) and the ``train-deploy`` command.

Kedro loads this module's ``cli`` group over its own commands and takes its ``run`` for ``python -m train_deploy``
(Kedro's way to run a packaged project). ``run`` is ``kedro run``, except that

- a run stopped because there is nothing to retrain (``train_deploy.retrain``) says so in one line and exits 0;
- a run failing with one of the project's own errors (configuration, corpus, checkpoint, bundle, training, …)
  prints its one-line message and where the traceback is (the project's log file, ``train_deploy.console``),
  and exits 1; any other error keeps its whole traceback on the console.

``train-deploy`` (:func:`main`) groups the project's commands: ``run``, ``schedule`` (``train_deploy.schedule``)
and ``serve`` (``train_deploy.serve``); without a command it lists them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

PACKAGE = "train_deploy"
_CHECKOUT_LOGGING = Path(__file__).resolve().parents[2] / "conf" / "logging.yml"
if "KEDRO_LOGGING_CONFIG" not in os.environ and not Path("conf/logging.yml").is_file() and _CHECKOUT_LOGGING.is_file():
    # started outside the project folder (train-deploy serve from anywhere): the project's logging, not Kedro's
    # fallback, which says at INFO which file it uses as it is imported
    os.environ["KEDRO_LOGGING_CONFIG"] = str(_CHECKOUT_LOGGING)

from kedro.framework.cli.project import run as kedro_run  # noqa: E402

from train_deploy.console import quiet_third_party, record_in_log_file  # noqa: E402

quiet_third_party()  # Kedro's CLI imports this module before the project's settings

from train_deploy.params import with_project_params  # noqa: E402
from train_deploy.retrain import NothingToRetrain  # noqa: E402

_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.group(name=PACKAGE)
def cli() -> None:
    """Commands of the train_deploy project."""


def _run(**options: Any) -> Any:
    try:
        return kedro_run.callback(**options)
    except NothingToRetrain as skipped:
        sys.stdout.write(f"\nSkipped: {skipped}\n")
        return None
    except Exception as error:
        own = project_error(error)
        if own is None:  # not one of the project's errors (a bug, or a library's): the whole traceback
            raise
        log = record_in_log_file(error, "The run failed")
        where = f"\n  traceback: {log}" if log else ""
        sys.stderr.write(f"{type(own).__name__}: {str(own).strip().splitlines()[0] if str(own).strip() else ''}"
                         f"{where}\n")
        raise SystemExit(1) from None


def project_error(error: BaseException) -> BaseException | None:
    """The project's own error (a class of a ``train_deploy`` module, whose message is one line naming the file,
    key or value) that ``error`` is or wraps (Kedro wraps what a dataset raises), or None."""
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__module__.split(".")[0] == PACKAGE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


run = click.Command("run", params=with_project_params(kedro_run.params), callback=_run, help=kedro_run.help,
                    short_help=kedro_run.short_help)
"""``kedro run`` with the project's one-line errors; Kedro's ``find_run_command`` looks for it here."""
cli.add_command(run)


@click.group(name="train-deploy", context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.pass_context
def main(context: click.Context) -> None:
    """train_deploy: train, export, register and serve Chinese language models.

    \b
      train-deploy run --pipelines train_deploy      the whole chain (kedro run; also python -m train_deploy)
      train-deploy schedule --cron "0 3 * * *"       retrain on a schedule (or --once)
      train-deploy serve                             serve the registered champion over HTTP

    `train-deploy COMMAND --help` says more.
    """
    if context.invoked_subcommand is None:  # no command: the list of them, as a success
        click.echo(context.get_help())


@main.command("run", context_settings=_PASS_THROUGH, add_help_option=False,
              short_help="Run a pipeline of the project (kedro run, with its options).")
@click.pass_context
def _run_command(context: click.Context) -> None:
    from kedro.framework.project import configure_project

    configure_project(PACKAGE)
    run.main(args=context.args, prog_name="train-deploy run")


@main.command("schedule", context_settings=_PASS_THROUGH, add_help_option=False,
              short_help="Run a pipeline on a cron schedule, or once (--once).")
@click.pass_context
def _schedule_command(context: click.Context) -> None:
    from train_deploy.schedule import main as schedule

    sys.exit(schedule(["schedule", *context.args]))


@main.command("serve", short_help="Serve the registered champion with mlflow models serve.")
@click.option("--model", "-m", "model_name", help="registered model (default: registry.model_name of the project)")
@click.option("--alias", default="champion", show_default=True, help="the alias (or version number) to serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", "-p", default=5001, show_default=True, type=int, envvar="TRAIN_DEPLOY_SERVE_PORT",
              show_envvar=True)
@click.option("--workers", "-w", default=1, show_default=True, type=int)
@click.option("--project", type=click.Path(file_okay=False, path_type=Path),
              help="the project folder (default: the checkout this command is installed from, else here)")
@click.option("--env", "-e", help="Kedro environment whose mlflow.yml and parameters to read (default: local)")
def _serve_command(model_name: str | None, alias: str, host: str, port: int, workers: int, project: Path | None,
                   env: str | None) -> None:
    """Serve a registered model of the project's MLflow store with `mlflow models serve --env-manager local`.

    Works from any folder: the store and its artifacts are the project's (conf/<env>/mlflow.yml, or
    MLFLOW_TRACKING_URI), the server runs in the project folder with this environment's mlflow and uvicorn.
    """
    from train_deploy.serve import ServeError, serve

    try:
        serve(project=project, env=env, model_name=model_name, alias=alias, host=host, port=port, workers=workers)
    except ServeError as error:
        raise click.ClickException(str(error)) from None
