"""Project hooks."""

from __future__ import annotations

import sys

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


class ShowBundle:
    """After a run that exported a bundle, print where it is and how to load it (plain text, unwrapped)."""

    @hook_impl
    def after_pipeline_run(self, pipeline, catalog) -> None:
        if "export_bundle" not in pipeline.all_outputs():
            return
        folder = catalog.load("export_bundle").path
        sys.stdout.write(
            f"\nExported bundle: {folder}\n"
            f"  model card: {folder}/MODEL_CARD.md\n"
            "  load it (Paddle Inference; backend='onnx', int8=True for the edge model):\n"
            "    from train_deploy.export import LanguageModel\n"
            f"    model = LanguageModel.load({folder!r})\n"
            "    print(model.generate('中国', max_new_tokens=20, temperature=0))\n")
