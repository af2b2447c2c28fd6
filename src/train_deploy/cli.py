"""Project commands (Kedro loads this module's ``cli`` group over its own): ``kedro run`` is Kedro's, except that
a run stopped because there is nothing to retrain (``train_deploy.retrain``) says so in one line and exits 0."""

from __future__ import annotations

import sys
from typing import Any

import click
from kedro.framework.cli.project import run as kedro_run

from train_deploy.retrain import NothingToRetrain


@click.group(name="train_deploy")
def cli() -> None:
    """Commands of the train_deploy project."""


def _run(**options: Any) -> Any:
    try:
        return kedro_run.callback(**options)
    except NothingToRetrain as skipped:
        sys.stdout.write(f"\nSkipped: {skipped}\n")
        return None


cli.add_command(click.Command("run", params=kedro_run.params, callback=_run, help=kedro_run.help,
                              short_help=kedro_run.short_help))
