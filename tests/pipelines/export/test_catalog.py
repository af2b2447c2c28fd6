"""The export stage's catalog entries as conf/base declares them, against a real MLflow store."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from kedro.config import OmegaConfigLoader
from kedro.io import DataCatalog
from PIL import Image

from train_deploy.export.plots import TrainingCurves, training_figure


def test_training_curves_reach_the_top_of_the_mlflow_run_as_a_png(project, tmp_path):
    config = OmegaConfigLoader(str(project / "conf"), base_env="base", default_run_env="local")["catalog"]
    catalog = DataCatalog.from_config({"training_curves": config["training_curves"]})
    curves = TrainingCurves(rows=[{"step": 1, "loss": 8.0, "lr": 1e-3, "tokens_per_second": 900.0},
                                  {"step": 2, "loss": 7.0, "lr": 2e-3, "tokens_per_second": 950.0,
                                   "val_loss": 7.2}])
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])  # the project fixture's own SQLite store
    experiment = mlflow.create_experiment("export-catalog", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        catalog.save("training_curves", training_figure(curves))
    logged = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)]
    assert "training_curves.png" in logged
    local = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="training_curves.png",
                                                     dst_path=str(tmp_path / "download")))
    with Image.open(local) as image:
        image.load()
        assert image.size == (1000, 700)
    assert local.read_bytes() == (project / "data/08_reporting/training_curves.png").read_bytes()
