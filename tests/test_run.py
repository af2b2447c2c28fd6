"""The whole project with a real MLflow store: the corpus stage through a KedroSession, as `kedro run` runs it, and the
whole `train_deploy` from the packaged wheel in a fresh virtual environment, as Kedro documents deployment."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from kedro.framework.cli.project import package as kedro_package
from kedro.framework.session import KedroSession

from tests.helpers.export import fused_here
from tests.helpers.project import REPO, TINY_SLICE, cli_params, tiny_runtime_params, tiny_train_deploy_params
from train_deploy.baselines import Baselines
from train_deploy.export import LanguageModel
from train_deploy.hashing import file_record
from train_deploy.registry.evalstore import ASSETS_TAG

pytest_plugins = ["tests.mlflow_server"]

# What `kedro package` runs (kedro/framework/cli/project.py, Kedro 1.7), in the project's folder.
BUILD_WHEEL = [sys.executable, "-m", "build", "--wheel", "--outdir", "dist"]
PACK_CONF = ["tar", "--exclude=local/*.yml", "-czf", "dist/conf-train_deploy.tar.gz", "--directory=.", "conf"]
RUN_TIMEOUT_S = 540


@dataclass(frozen=True)
class Packaged:
    """The project as `kedro package` leaves it in dist/, installed into a fresh virtual environment."""

    python: Path  # the fresh venv's interpreter
    conf: Path  # dist/conf-train_deploy.tar.gz


def _package(source: Path) -> tuple[Path, Path]:
    """`kedro package` on a copy of the project in ``source``: its two commands, the build with ``--no-isolation``.

    Kedro builds in an isolated environment, which downloads the build backend (setuptools) at every build; without
    isolation `build` uses the venv's own setuptools and wheel (pinned in requirements.lock) and still checks them
    against pyproject.toml's build-system requirement, so this needs no network. Everything else is Kedro's.
    The copy keeps the build's build/ and egg-info out of the checkout, which other runs may be building too."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    shutil.copytree(REPO / "conf", source / "conf", ignore=shutil.ignore_patterns("local"))
    (source / "conf" / "local").mkdir()  # as a fresh checkout has it: its README only, which the tarball keeps
    shutil.copy(REPO / "conf" / "local" / "README.md", source / "conf" / "local")
    built = subprocess.run([*BUILD_WHEEL, "--no-isolation"], cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    subprocess.run(PACK_CONF, cwd=source, check=True, timeout=60)
    (wheel,) = (source / "dist").glob("train_deploy-*.whl")
    return wheel, source / "dist" / "conf-train_deploy.tar.gz"


def _fresh_venv(folder: Path, wheel: Path) -> Path:
    """A new venv holding the wheel, installed by pip without the network. Its dependencies (2 GB of pinned wheels,
    which cannot be downloaded here) come from this venv through a .pth line; this venv's editable install of the
    project is not among them (a .pth in a folder named by a .pth line is not read), as the test checks."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=60)
    python = folder / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--disable-pip-version-check", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    imported = subprocess.run([python, "-c", "import train_deploy; print(train_deploy.__file__)"], env=deployed_env(),
                              capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported).is_relative_to(site), imported
    return python


def deployed_env(**variables: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH (a checkout on it would shadow the installed wheel), plus
    ``variables``."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **variables}


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> Packaged:
    """The project packaged (:func:`_package`) and installed into a fresh venv (:func:`_fresh_venv`)."""
    wheel, conf = _package(tmp_path_factory.mktemp("source"))
    return Packaged(_fresh_venv(tmp_path_factory.mktemp("venv") / "fresh", wheel), conf)


def test_the_packaged_run_builds_as_kedro_package_does():
    """The two commands of :func:`_package` are still `kedro package`'s (a Kedro upgrade that changes them fails
    here first); the build's only difference is ``--no-isolation``."""
    source = " ".join(inspect.getsource(kedro_package.callback).split())
    assert '[ sys.executable, "-m", "build", "--wheel", "--outdir", destination_dir, ]' in source
    assert '"tar", "--exclude=local/*.yml", "-czf", f"dist/conf-{metadata.package_name}.tar.gz",' in source
    assert "isolation" not in source


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
    # absolute, as MLflow records it: MLflow's own tools load it from any folder (train-deploy relocate after a move)
    assert run.info.artifact_uri == (project / "mlartifacts" / run.info.run_id / "artifacts").as_uri()
    assert (project / "mlartifacts" / run.info.run_id / "artifacts" / "corpus" / "token_manifest.json").is_file()

    # A second run on the unchanged corpus reuses everything and says so.
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    runs = mlflow.search_runs(experiment_names=["train_deploy"], output_format="list", order_by=["start_time DESC"])
    assert len(runs) == 2 and runs[0].data.metrics["corpus.reused"] == 1.0


@pytest.mark.slow
def test_packaged_train_deploy_against_a_tracking_server_puts_the_bundle_in_the_run(packaged, tmp_path,
                                                                                     mlflow_server):
    """`python -m train_deploy --pipelines train_deploy --conf-source=dist/conf-train_deploy.tar.gz` from the wheel in
    a fresh venv, in an empty folder (its data/ and logs), as a deployed project runs: the tiny parameters by
    --params (the tarball has no conf/local), the tracking server by the environment."""
    project = tmp_path / "deployed"
    project.mkdir()
    env = deployed_env(MLFLOW_TRACKING_URI=mlflow_server.uri)
    for name in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY"):  # credentials a scheduler would hold
        env[name] = f"canary-{name.lower()}-4f1c"
    # system metrics every second: a 4-step run may end before the default interval's first sample
    params = ",".join(cli_params(tiny_train_deploy_params(2)) + ["training.monitoring.system_metrics_interval=1"])
    command = [packaged.python, "-m", "train_deploy", "--pipelines", "train_deploy", f"--conf-source={packaged.conf}",
               "--params", params]
    completed = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr[-4000:]
    out = completed.stdout
    assert f"serve the champion: {packaged.python.parent / 'train-deploy'} serve" in out  # the fresh venv's command
    written = [p for root in (project, mlflow_server.root) for p in root.rglob("*") if p.is_file()]
    assert any(p.name.startswith("envlog.") for p in written)  # the launcher's dump of its environment is read too
    assert [p for p in written if b"-4f1c" in p.read_bytes()] == []  # data/, the MLflow store, its artifacts

    result = json.loads((project / "data/08_reporting/training_result.json").read_text(encoding="utf-8"))
    assert result["finished"] and result["step"] == 4 and result["layout"]["dp"] == 2
    assert Path(result["checkpoint"]).parent.parent == project / "data/06_models/checkpoints"
    assert (Path(result["checkpoint"]) / "model.safetensors").is_file()
    assert (project / "data/08_reporting/training_logs" / result["run_name"] / "node0" / "workerlog.0").is_file()

    client = mlflow.MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name("train_deploy").experiment_id])
    (assets,) = [r for r in runs if r.data.tags.get(ASSETS_TAG) == "train_deploy_lm"]  # the model's evaluation set
    (run,) = [r for r in runs if r is not assets]
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # the server holds the artifacts
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train.loss")] == [1, 2, 3, 4]
    assert "train.val_loss" in run.data.metrics and "train.mfu" in run.data.metrics
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's system metrics, on by default
    assert [a.path for a in client.list_artifacts(run.info.run_id, "visualdl")][0].startswith("visualdl/vdlrecords.")
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
    assert (folder / "edge/model.int8.onnx").is_file() and (folder / "server_portable/model.pdiparams").is_file()
    assert meta["files"]["edge/model.int8.ort"] == file_record(folder / "edge/model.int8.ort")  # ORT Mobile, hashed
    assert (folder / "server/model.pdiparams").is_file() == fused_here()  # the fused graph where this CPU runs it
    paddle_form = "paddle_inference" if fused_here() else "paddle_portable"
    assert run.data.metrics[f"export.max_logit_diff_{paddle_form}"] <= 1e-4
    assert run.data.metrics["export.max_logit_diff_onnx_fp32"] <= 1e-4
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
