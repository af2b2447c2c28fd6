"""The whole project through a KedroSession, as `kedro run` runs it, with a real MLflow store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tests.conftest import REPO, TINY_SLICE, TINY_TOKENIZER


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A copy of the project's configuration in an empty folder, with its own SQLite MLflow store."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    for name in ("pyproject.toml", ".telemetry"):
        shutil.copy(REPO / name, root / name)
    (root / "src").mkdir()  # kedro checks that a source folder exists; the package itself is installed
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    bootstrap_project(root)
    return root


def tiny_runtime_params() -> dict:
    """What `kedro run --params` would override for a quick run (nested, as the CLI builds it)."""
    return {"corpus": {
        "reader": {"max_bytes": TINY_SLICE, "chunk_bytes": 65536},
        "tokenizer": TINY_TOKENIZER,
        "encoding": {"workers": 2, "progress": False},
    }}


@pytest.mark.slow
def test_kedro_run_corpus_pipeline_records_params_manifest_and_metrics_in_mlflow(project, tmp_path):
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])

    manifest = json.loads((project / "data/04_feature/tokens/manifest.json").read_text(encoding="utf-8"))
    assert manifest["workers"] == 2 and not manifest["reused"]
    assert manifest["config"]["reader"]["max_bytes"] == TINY_SLICE
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (project / "data/04_feature/tokens" / name).is_file()
    assert (project / "data/06_models/tokenizer/tokenizer_config.json").is_file()

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and mlflow.active_run() is None
    assert run.data.params["corpus.reader.source"] == "people_daily"
    assert run.data.params["corpus.reader.max_bytes"] == str(TINY_SLICE)
    assert run.data.metrics["corpus.train_tokens"] == manifest["splits"]["train"]["tokens"]
    artifact_dir = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="corpus",
                                                            dst_path=str(tmp_path / "artifacts")))
    logged = json.loads((artifact_dir / "token_manifest.json").read_text(encoding="utf-8"))
    assert logged["fingerprint"] == manifest["fingerprint"]
    assert str(project / "mlartifacts") in run.info.artifact_uri

    # A second run on the unchanged corpus reuses everything and says so.
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list", order_by=["start_time DESC"])
    assert len(runs) == 2 and runs[0].data.metrics["corpus.reused"] == 1.0


@pytest.mark.slow
def test_kedro_run_train_deploy_trains_averages_and_exports_in_one_mlflow_run(project, tmp_path, capsys):
    params = tiny_runtime_params()
    params["corpus"]["encoding"]["validation_fraction"] = 0.05
    params["training"] = {
        "model": {"preset": "tiny"},
        "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
        "schedule": {"max_steps": 4, "log_every": 1, "eval_every": 2, "checkpoint_every": 2},
        "launch": {"nproc_per_node": 2},
    }
    params["export"] = {"parity": {"samples": 4}, "latency": {"batch_sizes": [1], "repeats": 2}}
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["train_deploy"])

    result = json.loads((project / "data/08_reporting/training_result.json").read_text(encoding="utf-8"))
    assert result["finished"] and result["step"] == 4 and result["layout"]["dp"] == 2
    assert (project / result["checkpoint"] / "model.safetensors").is_file()

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    (run,) = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "train.loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert "train.val_loss" in run.data.metrics and "train.mfu" in run.data.metrics
    assert run.data.params["training.resolved.dp"] == "2"
    assert run.data.params["training.resolved.accumulation_steps"] == "1"
    assert run.data.params["training.model.preset"] == "tiny"

    # Averaging ran after training: both perplexities in the same run, and a choice with its reason.
    assert {"averaging.last_perplexity", "averaging.averaged_perplexity"} <= set(run.data.metrics)
    selected = json.loads((project / "data/06_models/selected_checkpoint.json").read_text(encoding="utf-8"))
    assert selected["which"] in ("averaged", "last") and "validation loss" in selected["reason"]
    averaged = json.loads((project / "data/06_models/averaged_checkpoint.json").read_text(encoding="utf-8"))
    assert len(averaged["sources"]) == 2  # checkpoints at steps 2 and 4; k=3 with too_few: warn

    # Export ran last: a bundle that passed parity, its numbers and model card in the same run.
    bundle = json.loads((project / "data/07_model_output/export_bundle.json").read_text(encoding="utf-8"))
    folder = project / bundle["path"]
    assert folder.parent.parent == project / "data/07_model_output/bundles" and bundle["parity"]["passed"]
    assert (folder / "edge/model.int8.onnx").is_file() and (folder / "server/model.pdiparams").is_file()
    assert json.loads((folder / "bundle.json").read_text(encoding="utf-8"))["source"]["checkpoint"] == selected["path"]
    assert run.data.metrics["export.max_logit_diff_paddle_inference"] <= 1e-4
    assert run.data.metrics["export.max_logit_diff_onnx_fp32"] <= 1e-4
    artifacts = {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(run.info.run_id, "export")}
    assert {"export/MODEL_CARD.md", "export/export_bundle.json"} <= artifacts
    assert f"Exported bundle: {bundle['path']}" in capsys.readouterr().out
