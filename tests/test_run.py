"""The whole project through a KedroSession, as `kedro run` runs it, with a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.project import TINY_SLICE, tiny_runtime_params, tiny_train_deploy_params
from train_deploy.baselines import Baselines
from train_deploy.export import LanguageModel

pytest_plugins = ["tests.mlflow_server"]


@pytest.mark.slow
def test_kedro_run_corpus_pipeline_records_params_manifest_and_metrics_in_mlflow(project, tmp_path):
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])

    manifest = json.loads((project / "data/04_feature/tokens/manifest.json").read_text(encoding="utf-8"))
    assert manifest["workers"] == 2
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
    assert run.data.metrics["corpus.reused"] == 0.0
    artifact_dir = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="corpus",
                                                            dst_path=str(tmp_path / "artifacts")))
    logged = json.loads((artifact_dir / "token_manifest.json").read_text(encoding="utf-8"))
    assert logged["fingerprint"] == manifest["fingerprint"]
    assert (artifact_dir / "tokenizer" / "sentencepiece.bpe.model").is_file()  # the tokenizer folder itself
    assert run.info.artifact_uri == f"mlartifacts/{run.info.run_id}/artifacts"  # relative: a moved project keeps it
    assert (project / run.info.artifact_uri / "corpus" / "token_manifest.json").is_file()

    # A second run on the unchanged corpus reuses everything and says so.
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list", order_by=["start_time DESC"])
    assert len(runs) == 2 and runs[0].data.metrics["corpus.reused"] == 1.0


@pytest.mark.slow
def test_train_deploy_against_a_tracking_server_puts_the_bundle_in_the_run(project, tmp_path, capsys, mlflow_server,
                                                                            monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for name in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"):  # credentials a scheduler would hold
        monkeypatch.setenv(name, f"canary-{name.lower()}-4f1c")
    with KedroSession.create(project_path=project, runtime_params=tiny_train_deploy_params(2)) as session:
        session.run(pipeline_names=["train_deploy"])
    written = [p for root in (project, mlflow_server.root) for p in root.rglob("*") if p.is_file()]
    assert any(p.name.startswith("envlog.") for p in written)  # the launcher's dump of its environment is read too
    assert [p for p in written if b"-4f1c" in p.read_bytes()] == []  # data/, the MLflow store, its artifacts

    result = json.loads((project / "data/08_reporting/training_result.json").read_text(encoding="utf-8"))
    assert result["finished"] and result["step"] == 4 and result["layout"]["dp"] == 2
    assert Path(result["checkpoint"]).parent.parent == project / "data/06_models/checkpoints"
    assert (Path(result["checkpoint"]) / "model.safetensors").is_file()
    assert (project / "data/08_reporting/training_logs" / result["run_name"] / "node0" / "workerlog.0").is_file()

    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id])
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # the server holds the artifacts
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train.loss")] == [1, 2, 3, 4]
    assert "train.val_loss" in run.data.metrics and "train.mfu" in run.data.metrics
    assert run.data.params["training.resolved.dp"] == "2"
    assert run.data.params["training.resolved.accumulation_steps"] == "1"
    assert run.data.params["training.model.preset"] == "tiny"

    # Averaging ran after training: both perplexities in the same run, and a choice with its reason.
    assert {"averaging.last_perplexity", "averaging.averaged_perplexity"} <= set(run.data.metrics)
    selected = json.loads((project / "data/06_models/selected_checkpoint.json").read_text(encoding="utf-8"))
    assert selected["which"] in ("averaged", "last") and "validation loss" in selected["reason"]
    averaged = json.loads((project / "data/06_models/averaged_checkpoint/state.json").read_text(encoding="utf-8"))
    assert len(averaged["averaged"]["sources"]) == 2  # checkpoints at steps 2 and 4; k=3 with too_few: warn

    # Export ran last: one bundle version that passed parity, its numbers in the same run.
    (version,) = (project / "data/07_model_output/bundle").iterdir()
    folder = version / "bundle"
    meta = json.loads((folder / "bundle.json").read_text(encoding="utf-8"))
    assert meta["source"]["checkpoint"] == selected["checkpoint"]["path"]
    assert (folder / "edge/model.int8.onnx").is_file() and (folder / "server/model.pdiparams").is_file()
    assert run.data.metrics["export.max_logit_diff_paddle_inference"] <= 1e-4
    assert run.data.metrics["export.max_logit_diff_onnx_fp32"] <= 1e-4
    out = capsys.readouterr().out
    assert f"Exported bundle: {folder}" in out

    # The n-gram baselines beside the model's loss, in every stage's metrics, parity.json, the card and the hint.
    parity = json.loads((folder / "parity.json").read_text(encoding="utf-8"))
    assert parity["baselines"]["bigram_loss"] < parity["baselines"]["unigram_loss"]
    for stage in ("train", "averaging", "export"):
        assert {f"{stage}.baseline_unigram_loss", f"{stage}.baseline_bigram_loss"} <= set(run.data.metrics)
    assert run.data.metrics["export.baseline_bigram_loss"] == parity["baselines"]["bigram_loss"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train.baseline_bigram_loss")] == [4]  # once
    assert {f"{stage}.baseline_kn_trigram_loss" for stage in ("train", "averaging", "export")} <= set(run.data.metrics)
    strongest = Baselines.from_report(meta["source"]["val_baselines"]).strongest()[0]  # what the verdicts are against
    assert f"NOT below the {strongest} baseline" in out  # 4 tiny steps lose to counting, and the run says so
    assert f"Warning: this model does not yet beat the {strongest} baseline" in (folder / "MODEL_CARD.md").read_text(
        encoding="utf-8")
    assert "temperature=0.8, top_k=20, seed=0)" in out and "  which printed: " in out

    # The run holds the model itself: downloaded into an empty folder, it loads and scores.
    downloaded = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="export/bundle",
                                                          dst_path=str(tmp_path / "empty"),
                                                          tracking_uri=mlflow_server.uri))
    assert (downloaded / "MODEL_CARD.md").read_text(encoding="utf-8") == (folder / "MODEL_CARD.md").read_text(
        encoding="utf-8")
    (score,) = LanguageModel.load(downloaded, backend="onnx").score(["今天天气很好。"])
    assert 1.0 < score.perplexity < 10 * meta["model"]["vocab_size"]
    card = (downloaded / "MODEL_CARD.md").read_text(encoding="utf-8")
    for picture in ("plots/training.png", "plots/latency.png"):  # in the run, and shown by the card
        assert (downloaded / picture).read_bytes().startswith(b"\x89PNG") and f"]({picture})" in card
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"training_curves.png", "export", "registry"} <= top
    assert not (project / "mlartifacts").exists()  # nothing went to the client's disk instead

    # The registry ran last: version 1 of the registered model, from this run, champion as the first one.
    version = client.get_model_version("train_deploy_lm", "1")
    assert version.run_id == run.info.run_id and version.tags["gate.decision"] == "first"
    assert version.tags["corpus.fingerprint"] == meta["source"]["corpus"]["fingerprint"]
    assert version.tags["tokenizer.hash"] == meta["tokenizer"]["hash"]
    assert json.loads(version.tags["training.layout"])["dp"] == 2
    assert {k: str(v) for k, v in client.get_registered_model("train_deploy_lm").aliases.items()} == {"champion": "1"}
    assert f"MLflow run: {run.info.run_id}\nRegistered train_deploy_lm version 1: became champion [first]\n" in out
