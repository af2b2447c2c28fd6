"""Project hooks."""

from __future__ import annotations

import mlflow
from kedro.framework.hooks import hook_impl


class CloseMlflowRun:
    """End the MLflow run of a Kedro run completely when the pipeline finishes or fails.

    kedro-mlflow re-opens its run before every node; with MLflow 3 that leaves the run on the
    active-run stack after kedro-mlflow ends it, so a second KedroSession in the same process (a
    scheduler, a notebook, the tests) would log into the first run. A run that was already active
    before the session started is left open, as kedro-mlflow documents.
    """

    def __init__(self) -> None:
        self._outer_run_id: str | None = None

    @hook_impl
    def after_context_created(self, context) -> None:
        run = mlflow.active_run()
        self._outer_run_id = run.info.run_id if run else None

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._close()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._close()

    def _close(self) -> None:
        while (run := mlflow.active_run()) is not None and run.info.run_id != self._outer_run_id:
            mlflow.end_run()
