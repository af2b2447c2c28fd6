"""Scoring latency under load through ``train-deploy serve``, with and without a concurrent maximum generation.

    .venv/bin/python benchmarks/bench_serving_load.py                  # the newest bundle of `make run`
    .venv/bin/python benchmarks/bench_serving_load.py --bundle PATH --seconds 20 --clients 8

Logs the bundle as an MLflow model (``log_bundle_model``, the ``registry.serving`` defaults unless ``--limit
KEY=VALUE``) into a SQLite store under benchmarks/.work/serving_load, serves it with ``train-deploy serve`` from
a copy of the project's configuration, and runs two phases of ``--seconds`` each: (a) ``--clients`` threads each
sending ``score`` requests of one ~30-character text back to back on a kept-alive connection; (b) the same while
one more client asks for the maximum generation (``max_new_tokens`` at the model's limit, temperature 1) back to
back, and another sends a request over that limit every 0.5 s. Prints each phase's scoring p50/p99/max, the
generations' durations and statuses, and the over-limit answers' latency (issue 28's acceptance: scoring p99
under 2 s with the generation running, the over-limit 400 under 100 ms). The work folder is removed afterwards.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from bench_serve import answering, free_port  # the same folder: benchmarks run as scripts

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "serving_load"
HOST, MODEL = "127.0.0.1", "bench_serving_lm"
PROSE = "新华社北京一月一日电国家主席江泽民发表一九九八年新年讲话。今天天气很好，首都群众在天安门广场欢度元旦。"


def newest_bundle() -> Path:
    found = sorted((REPO / "data" / "07_model_output" / "bundle").glob("*/bundle/bundle.json"))
    if not found:
        raise SystemExit("no bundle under data/07_model_output/bundle: run `make run` or pass --bundle")
    return found[-1].parent


def log_model(bundle: Path, limits: dict[str, int]) -> str:
    """Register ``bundle`` as ``MODEL`` (alias champion) in a store under WORK; return the tracking URI."""
    import mlflow

    from train_deploy.registry.config import ServingConfig
    from train_deploy.registry.model import log_bundle_model

    uri = f"sqlite:///{WORK / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    experiment = mlflow.create_experiment("bench_serving_load", artifact_location=str(WORK / "artifacts"))
    with mlflow.start_run(experiment_id=experiment):
        info = log_bundle_model(bundle, serving=ServingConfig(**limits), registered_model_name=MODEL)
    mlflow.MlflowClient().set_registered_model_alias(MODEL, "champion", info.registered_model_version)
    return uri


def serve(tracking_uri: str, workers: int) -> tuple[subprocess.Popen, int]:
    """``train-deploy serve`` of MODEL from a copy of the project's configuration; returns once /ping answers."""
    project = WORK / "project"
    shutil.copytree(REPO / "conf", project / "conf", ignore=shutil.ignore_patterns("local"))
    (project / "conf" / "local").mkdir()
    (project / "src").mkdir()
    shutil.copy(REPO / "pyproject.toml", project / "pyproject.toml")
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    command = [str(Path(sys.executable).parent / "train-deploy"), "serve", "--project", str(project), "--model",
               MODEL, "--port", str(port), "--workers", str(workers)]
    process = subprocess.Popen(command, cwd=WORK, env=env, stdout=(WORK / "serve.log").open("wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return process, answering(process, port, WORK / "serve.log", 300)


def client(port: int, body: dict, until: float, found: list[tuple[int, float]], pause: float = 0.0) -> None:
    """POST ``body`` back to back (``pause`` seconds apart) until ``until``; append (status, seconds) each."""
    data = json.dumps(body).encode()
    connection = http.client.HTTPConnection(HOST, port, timeout=120)
    while time.monotonic() < until:
        start = time.perf_counter()
        connection.request("POST", "/invocations", data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        found.append((response.status, time.perf_counter() - start))
        time.sleep(pause)


def phase(port: int, clients: int, seconds: float, max_new_tokens: int | None) -> dict[str, list]:
    """One phase: the scoring clients, and with ``max_new_tokens`` the generation and over-limit clients."""
    until = time.monotonic() + seconds
    found: dict[str, list] = {"score": [], "generate": [], "over limit": []}
    work = [({"inputs": [PROSE[i % 10 : i % 10 + 30]]}, "score", 0.0) for i in range(clients)]
    if max_new_tokens is not None:
        work += [({"inputs": ["今天"], "params": {"task": "generate", "max_new_tokens": max_new_tokens}}, "generate",
                  0.0),
                 ({"inputs": ["今天"], "params": {"task": "generate", "max_new_tokens": max_new_tokens + 1}},
                  "over limit", 0.5)]
    threads = [threading.Thread(target=client, args=(port, body, until, found[kind], pause))
               for body, kind, pause in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None, help="default: the newest bundle of `make run`")
    parser.add_argument("--seconds", type=float, default=20, help="length of each phase")
    parser.add_argument("--clients", type=int, default=8, help="concurrent scoring clients")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers of the model server")
    parser.add_argument("--limit", action="append", default=[], help="KEY=VALUE of registry.serving to log with")
    args = parser.parse_args()
    bundle = args.bundle or newest_bundle()
    limits = {key: int(value) for key, value in (item.split("=", 1) for item in args.limit)}

    from train_deploy.registry.config import ServingConfig

    max_new_tokens = ServingConfig(**limits).max_new_tokens
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    process = None
    try:
        process, port = serve(log_model(bundle, limits), args.workers)
        phase(port, args.clients, 3, None)  # warm-up
        results = {"scoring alone": phase(port, args.clients, args.seconds, None),
                   "with a max generation": phase(port, args.clients, args.seconds, max_new_tokens)}
        report(bundle, args, max_new_tokens, results)
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        shutil.rmtree(WORK, ignore_errors=True)


def report(bundle: Path, args, max_new_tokens: int, results: dict[str, dict[str, list]]) -> None:
    model = json.loads((bundle / "bundle.json").read_text())["model"]
    out = sys.stdout.write
    out(f"\n{model['parameters'] / 1e6:.1f}M parameters, {args.workers} server worker(s), {args.clients} scoring "
        f"clients (1 text of 30 characters each), {args.seconds:.0f} s per phase, load {os.getloadavg()[0]:.1f}\n\n")
    out("| phase | scoring requests | not 200 | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|---:|\n")
    for name, found in results.items():
        seconds = [s * 1000 for _, s in found["score"]]
        p50, p99 = np.percentile(seconds, [50, 99])
        out(f"| {name} | {len(seconds)} | {sum(status != 200 for status, _ in found['score'])} | {p50:.0f} | "
            f"{p99:.0f} | {max(seconds):.0f} |\n")
    loaded = results["with a max generation"]
    statuses = sorted({status for status, _ in loaded["generate"]})
    durations = [s for _, s in loaded["generate"]]
    out(f"\nmax generation (max_new_tokens {max_new_tokens}): {len(durations)} requests, statuses {statuses}, "
        f"{min(durations):.2f}-{max(durations):.2f} s each\n")
    over = [s * 1000 for _, s in loaded["over limit"]]
    out(f"over the limit (max_new_tokens {max_new_tokens + 1}): {len(over)} requests, statuses "
        f"{sorted({status for status, _ in loaded['over limit']})}, p50 {np.percentile(over, 50):.1f} ms, "
        f"max {max(over):.1f} ms\n")


if __name__ == "__main__":
    main()
