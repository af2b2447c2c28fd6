"""What issue 38's server benchmarks (``bench_llm_server.py``, ``bench_attack_rss.py``) share: the bundle logged
as an MLflow model, the new server started as ``train-deploy serve`` starts it, their common arguments and the
results file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_serve import answering, free_port  # the same folder: benchmarks run as scripts

HOST, MODEL = "127.0.0.1", "bench_llm_server"
PROMPT = "新华社北京一月一日电"
PROSE = "新华社北京一月一日电国家主席江泽民发表一九九八年新年讲话。今天天气很好，首都群众在天安门广场欢度元旦。"


def arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with the arguments every server benchmark takes: ``--bundle`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the bundle folder (with bundle.json)")
    parser.add_argument("--out", type=Path, default=None, help="keep results.json here (default: not kept)")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return parser


def log_model(bundle: Path, work: Path) -> tuple[str, str]:
    """Log ``bundle`` as version 1 of MODEL in a store under ``work``; return the tracking URI and the model's
    folder downloaded for the new server."""
    import mlflow

    from train_deploy.registry.model import log_bundle_model

    uri = f"sqlite:///{work / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    experiment = mlflow.create_experiment("bench_llm_server", artifact_location=str(work / "artifacts"))
    with mlflow.start_run(experiment_id=experiment):
        info = log_bundle_model(bundle, registered_model_name=MODEL)
    folder = mlflow.artifacts.download_artifacts(artifact_uri=info.model_uri, dst_path=str(work / "model"))
    return uri, folder


def server_env(tracking_uri: str, model: str | None = None) -> dict[str, str]:
    """The environment of a server over the store at ``tracking_uri``; with ``model`` (its downloaded folder), the
    variables ``train-deploy serve`` sets for the new server."""
    bin_dir = Path(sys.executable).parent
    env = {"MLFLOW_TRACKING_URI": tracking_uri, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    if model is not None:
        env |= {"TRAIN_DEPLOY_SERVED_MODEL": model, "TRAIN_DEPLOY_SERVED_NAME": MODEL,
                "TRAIN_DEPLOY_SERVED_VERSION": "1"}
    return env


def new_server_command(model: str) -> list[str]:
    """The new server as ``train-deploy serve`` runs it: uvicorn over the app logged with ``model``."""
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / "uvicorn"), "--factory", "--app-dir", str(Path(model) / "code"), "--host", HOST, "--port",
            "{port}", "--log-level", "warning", "train_deploy.serving.app:create_app"]


def start(name: str, command: list[str], env: dict[str, str], work: Path) -> tuple[subprocess.Popen, int]:
    """Start a server (``{port}`` in ``command`` filled in) from an empty folder under ``work``; return it once /ping
    answers."""
    port, folder, log = free_port(), work / name, work / f"{name}.log"
    folder.mkdir()
    process = subprocess.Popen([part.format(port=port) for part in command], cwd=folder,
                               env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, answering(process, port, log, 300)


def save_results(out: Path | None, results: dict, table: str) -> None:
    """Print ``table``; with ``out``, write it with every figure to ``out/results.json``."""
    sys.stdout.write("\n" + table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"results": results, "table": table}, indent=2))
