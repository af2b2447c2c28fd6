"""``train-deploy``: the project's commands, listed when it is called alone or with ``--help``.

- ``train-deploy run …``: ``kedro run`` with the project's one-line errors (``train_deploy.cli.run``, which
  ``python -m train_deploy`` runs too);
- ``train-deploy schedule …``: retrain on a cron schedule, or once (``train_deploy.run_control.schedule``);
- ``train-deploy serve``: the registered champion over HTTP, from any folder (``train_deploy.serve``);
- ``train-deploy gc [--dry-run]``: remove what retention no longer keeps (``train_deploy.retention``);
- ``train-deploy relocate [--dry-run]``: the store's artifact locations rewritten after the project moved
  (``train_deploy.registry.relocate``).

Each command imports what it needs when it runs: ``train-deploy schedule`` starts in a fraction of a second, so
a SIGTERM right after its start (systemd, a test) meets its handler, not Kedro's and MLflow's imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

_CHECKOUT_LOGGING = Path(__file__).resolve().parents[2] / "conf" / "logging.yml"
if "KEDRO_LOGGING_CONFIG" not in os.environ and not Path("conf/logging.yml").is_file() and _CHECKOUT_LOGGING.is_file():
    # started outside the project folder (train-deploy serve from anywhere): the project's logging, not Kedro's
    # fallback, which says at INFO which file it uses when a command imports Kedro
    os.environ["KEDRO_LOGGING_CONFIG"] = str(_CHECKOUT_LOGGING)

_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.group(name="train-deploy", context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.pass_context
def main(context: click.Context) -> None:
    """train_deploy: train, export, register and serve Chinese language models.

    \b
      train-deploy run --pipelines train_deploy      the whole chain (kedro run; also python -m train_deploy)
      train-deploy schedule --cron "0 3 * * *"       retrain on a schedule (or --once)
      train-deploy serve                             serve the registered champion over HTTP
      train-deploy gc --dry-run                      what retention would remove, and the bytes freed
      train-deploy relocate --dry-run                the store's locations after the project folder moved

    `train-deploy COMMAND --help` says more.
    """
    if context.invoked_subcommand is None:  # no command: the list of them, as a success
        click.echo(context.get_help())


@main.command("run", context_settings=_PASS_THROUGH, add_help_option=False,
              short_help="Run a pipeline of the project (kedro run, with its options).")
@click.pass_context
def _run_command(context: click.Context) -> None:
    from kedro.framework.project import configure_project

    from train_deploy.cli import PACKAGE, run

    configure_project(PACKAGE)
    run.main(args=context.args, prog_name="train-deploy run")


@main.command("schedule", context_settings=_PASS_THROUGH, add_help_option=False,
              short_help="Run a pipeline on a cron schedule, or once (--once).")
@click.pass_context
def _schedule_command(context: click.Context) -> None:
    from train_deploy.run_control.schedule import main as schedule

    sys.exit(schedule(["schedule", *context.args]))


@main.command("serve", short_help="Serve the registered champion: MLflow's /invocations, OpenAI's API, metrics.")
@click.option("--model", "-m", "model_name", help="registered model (default: registry.model_name of the project)")
@click.option("--alias", default="champion", show_default=True, help="the alias (or version number) to serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", "-p", default=5001, show_default=True, type=int, envvar="TRAIN_DEPLOY_SERVE_PORT",
              show_envvar=True)
@click.option("--workers", "-w", default=1, show_default=True, type=int)
@click.option("--queue", type=click.IntRange(0, 10_000), envvar="TRAIN_DEPLOY_SERVE_QUEUE", show_envvar=True,
              help="requests that may wait in each lane beyond those running; one more is a 429 [default: 16]")
@click.option("--batch", type=click.IntRange(1, 256), envvar="TRAIN_DEPLOY_SERVE_BATCH", show_envvar=True,
              help="generations decoded together in the running batch [default: 16]")
@click.option("--body-timeout", type=click.FloatRange(0.001, 600), envvar="TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S",
              show_envvar=True, help="seconds a request's body may take to arrive; then 408 [default: 10]")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path),
              help="the project folder (default: the checkout this command is installed from, else here)")
@click.option("--env", "-e", help="Kedro environment whose mlflow.yml and parameters to read (default: local)")
@click.option("--follow", is_flag=True, help="keep serving while watching the alias: a version it moves to is "
              "downloaded, checked, then served without a failed request; one that fails is refused and alerted")
@click.option("--poll-interval", type=click.FloatRange(0.1, 86_400), default=30.0, show_default=True,
              envvar="TRAIN_DEPLOY_FOLLOW_POLL_S", show_envvar=True,
              help="with --follow: seconds between two looks at the registry")
@click.option("--replicas", type=click.IntRange(1, 256), help="serve through Ray Serve's proxy with this many "
              "replicas of the same server (each loads the model and enforces the same limits)")
@click.option("--max-replicas", type=click.IntRange(1, 256), help="with --replicas: let Ray Serve scale up to this "
              "many by the requests waiting")
@click.option("--ray-address", envvar="TRAIN_DEPLOY_RAY_ADDRESS", show_envvar=True,
              help="with --replicas: the Ray cluster to deploy on (default: a private local instance)")
@click.option("--scale-up-after", type=click.FloatRange(0, 86_400), envvar="TRAIN_DEPLOY_SERVE_SCALE_UP_S",
              show_envvar=True, help="with --max-replicas: seconds the requests at each replica must stay above "
              "half --batch before a replica is added [default: Ray Serve's upscale_delay_s, 30]")
@click.option("--scale-down-after", type=click.FloatRange(0, 86_400), envvar="TRAIN_DEPLOY_SERVE_SCALE_DOWN_S",
              show_envvar=True, help="with --max-replicas: seconds they must stay below it before one is removed "
              "[default: Ray Serve's downscale_delay_s, 600]")
@click.pass_context
def _serve_command(context: click.Context, model_name: str | None, alias: str, host: str, port: int, workers: int,
                   queue: int | None, batch: int | None, body_timeout: float | None, project: Path | None,
                   env: str | None, follow: bool, poll_interval: float, replicas: int | None,
                   max_replicas: int | None, ray_address: str | None, scale_up_after: float | None,
                   scale_down_after: float | None) -> None:
    """Serve a registered model of the project's MLflow store with train_deploy's server (docs/serving.md):
    MLflow's POST /invocations, OpenAI's POST /v1/completions and GET /v1/models, GET /metrics, a playground at /.

    Works from any folder: the store and its artifacts are the project's (conf/<env>/mlflow.yml, or
    MLFLOW_TRACKING_URI), the server runs in the project folder with this environment's uvicorn.
    """
    from train_deploy.serve import ServeError, serve

    admission = {name: str(value) for name, value in (("TRAIN_DEPLOY_SERVE_QUEUE", queue),
                 ("TRAIN_DEPLOY_SERVE_BATCH", batch), ("TRAIN_DEPLOY_SERVE_BODY_TIMEOUT_S", body_timeout))
                 if value is not None}
    scaling = bool(replicas and max_replicas and max_replicas > replicas)
    for name in ("scale_up_after", "scale_down_after"):  # from the environment they apply when scaling only
        if not scaling and context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name.replace('_', '-')}: Ray Serve scales only between --replicas and a "
                                   "larger --max-replicas")
    try:
        serve(project=project, env=env, model_name=model_name, alias=alias, host=host, port=port, workers=workers,
              admission=admission, poll_interval=poll_interval if follow else None,
              replicas=(replicas, max(replicas, max_replicas or replicas)) if replicas else None,
              ray_address=ray_address, scale_after=(scale_up_after, scale_down_after))
    except ServeError as error:
        raise click.ClickException(str(error)) from None


@main.command("gc", short_help="Remove what retention no longer keeps (--dry-run: list it and the bytes freed).")
@click.option("--dry-run", is_flag=True, help="list what would be removed and the bytes freed; remove nothing")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              help="the project folder (default: here)")
@click.option("--env", "-e", help="Kedro environment whose parameters, catalog and mlflow.yml to read (default: local)")
@click.option("--after-run", is_flag=True, hidden=True, help="the scheduler's call: honours after_scheduled_run")
def _gc_command(dry_run: bool, project: Path, env: str | None, after_run: bool) -> None:
    """Remove old checkpoints, log folders, bundle versions, token and tokenizer folders, and rejected versions'
    MLflow artifacts, as `retention` in conf/base/parameters_retention.yml says; never what the versions holding
    an alias (champion, previous) need. Each removal is logged and recorded (retention.record)."""
    from train_deploy.cli import project_error
    from train_deploy.retention import NothingToCollect, collect_project, human

    try:
        plan, record = collect_project(project, env, dry_run=dry_run, after_run=after_run)
    except NothingToCollect as off:
        click.echo(str(off))
        return
    except Exception as error:
        own = project_error(error)
        if own is None:
            raise
        raise click.ClickException(f"{type(own).__name__}: {str(own).strip().splitlines()[0]}") from None
    lines = plan.lines(project.resolve())
    if dry_run:
        click.echo("\n".join(["Dry run: nothing removed.", *lines]))
    else:
        click.echo(f"Removed {len(record['removed'])}, freed {human(record['bytes_freed'])}; now "
                   f"{human(record['usage_bytes'])} in use; kept for their aliases: {plan.kept.describe()}")


@main.command("relocate", short_help="Rewrite the MLflow store's artifact locations after the project moved.")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              help="the project folder, where it is now (default: here)")
@click.option("--from", "old", type=click.Path(file_okay=False, path_type=Path),
              help="the folder the project was moved from (default: found from the store's missing locations)")
@click.option("--dry-run", is_flag=True, help="say what would change; change nothing")
@click.option("--env", "-e", help="Kedro environment whose mlflow.yml to read (default: local)")
def _relocate_command(project: Path, old: Path | None, dry_run: bool, env: str | None) -> None:
    """Rewrite the local SQLite store's artifact locations (experiments, runs, logged models, model versions)
    under the folder the project was moved from to the same places under the project folder, and locations
    recorded relative to the project absolute, in one transaction: MLflow's own tools then load the registered
    models from any folder again. Stores on a tracking server are left alone."""
    from train_deploy.project import NoProject, find_project, store_uris
    from train_deploy.registry.relocate import RelocateError, relocate, sqlite_file

    try:
        folder = find_project(project)
    except NoProject as missing:
        raise click.ClickException(str(missing)) from None
    database = sqlite_file(store_uris(folder, env)[0])
    if database is None:
        raise click.ClickException("the project's MLflow store is no local SQLite store: nothing to relocate")
    try:
        changes = relocate(database, folder, old, dry_run=dry_run)
    except RelocateError as error:
        raise click.ClickException(str(error)) from None
    for change in changes:
        click.echo(f"{change.table}.{change.column}: {change.before} -> {change.after}")
    click.echo(f"{'Dry run: would change' if dry_run else 'Changed'} {len(changes)} location(s) in {database}")
