"""Latency of ``score`` through ``mlflow models serve`` (HTTP, Paddle Inference) against the same call in process.

    .venv/bin/python benchmarks/bench_serve.py                      # the newest bundle of `make run` (small preset)
    .venv/bin/python benchmarks/bench_serve.py --bundle PATH --repeats 50 --workers 1

Logs the bundle as an MLflow model (``train_deploy.registry.model.log_bundle_model``) into a SQLite store under
benchmarks/.work/serve, starts ``mlflow models serve -m <model> --env-manager local`` from an empty folder, and
times the same ``score`` request for 1 and 8 texts of ~100 characters: (a) ``predict`` on the model loaded with
``mlflow.pyfunc.load_model`` in this process, (b) ``POST /invocations`` (``dataframe_split``, a kept-alive
connection) to the server; the two alternate call by call, so both see the same machine. Prints p50/p95 and the
served/in-process ratio (target: ≤ 1.3× at p50 for 8 texts). The work folder is removed afterwards.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "serve"
HOST = "127.0.0.1"
# People's Daily style prose; each text is a different ~100-character window of it.
PROSE = ("新华社北京一月一日电国家主席江泽民发表一九九八年新年讲话。他说，在新的一年里，我"
         "们要继续坚持以经济建设为中心，深化改革，扩大开放，促进经济发展和社会全面进步。全"
         "国各族人民要紧密团结起来，同心同德，艰苦奋斗，为把建设有中国特色社会主义事业全面"
         "推向二十一世纪而努力奋斗。今天天气很好，首都群众在天安门广场欢度元旦，各地也纷纷"
         "举行丰富多彩的庆祝活动，人们互致问候，祝愿祖国繁荣昌盛，人民生活幸福安康。")


def texts(count: int, chars: int = 100) -> list[str]:
    step = (len(PROSE) - chars) // 8
    return [PROSE[i * step : i * step + chars] for i in range(count)]


def newest_bundle() -> Path:
    found = sorted((REPO / "data" / "07_model_output" / "bundle").glob("*/bundle/bundle.json"))
    if not found:
        raise SystemExit("no bundle under data/07_model_output/bundle: run `make run` or pass --bundle")
    return found[-1].parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def log_model(bundle: Path) -> tuple[str, str]:
    """Log ``bundle`` into a store under WORK; return the tracking URI and the model URI."""
    import mlflow

    from train_deploy.registry.model import log_bundle_model

    uri = f"sqlite:///{WORK / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("bench_serve", artifact_location=str(WORK / "artifacts"))
    with mlflow.start_run(experiment_id=experiment):
        return uri, log_bundle_model(bundle).model_uri


def serve(model_uri: str, tracking_uri: str, workers: int, extra_env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Start ``mlflow models serve`` from an empty folder; return the process and its port once /ping answers."""
    port, empty = free_port(), WORK / "empty"
    empty.mkdir()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, **extra_env, "MLFLOW_TRACKING_URI": tracking_uri, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    command = [str(bin_dir / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local", "-h", HOST,
               "-p", str(port), "--workers", str(workers)]
    process = subprocess.Popen(command, cwd=empty, env=env, stdout=(WORK / "serve.log").open("wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return process, answering(process, port, WORK / "serve.log", 180)


def answering(process: subprocess.Popen, port: int, log: Path, timeout: float) -> int:
    """``port`` once the server ``process`` answers /ping; kill it and exit with its log's tail if it does not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            connection = http.client.HTTPConnection(HOST, port, timeout=2)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return port
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit(f"the model server did not start:\n{log.read_text()[-3000:]}")


def timed_pairs(calls: dict[str, object], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Milliseconds of each call, alternating call by call, so both see the same machine (on a small machine
    an idle Paddle process still spins its threads for a while after a call, slowing whatever runs next)."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=None, help="default: the newest bundle of `make run`")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per round and batch")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the batch sizes")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers of the model server")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server's environment")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bundle = args.bundle or newest_bundle()

    import mlflow
    import pandas as pd

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    process = None
    try:
        tracking_uri, model_uri = log_model(bundle)
        process, port = serve(model_uri, tracking_uri, args.workers, dict(kv.split("=", 1) for kv in args.env))
        model = mlflow.pyfunc.load_model(model_uri)
        connections: list[http.client.HTTPConnection] = []

        def post(body: bytes) -> None:
            connection = connections[-1]
            connection.request("POST", "/invocations", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            if response.status != 200:
                raise SystemExit(f"HTTP {response.status}: {answer[:500]!r}")

        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for batch in (1, 8):
                frame = pd.DataFrame({"text": texts(batch)})
                body = json.dumps({"dataframe_split": frame.to_dict(orient="split", index=False)}).encode()
                connections.append(http.client.HTTPConnection(HOST, port, timeout=60))
                pairs = timed_pairs({"in process": lambda f=frame: model.predict(f), "served": lambda b=body: post(b)},
                                    args.repeats)
                for kind, times in pairs.items():
                    results.setdefault((kind, batch), []).extend(times)
        report(bundle, args, results)
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        shutil.rmtree(WORK, ignore_errors=True)


def report(bundle: Path, args, results: dict[tuple[str, int], list[float]]) -> None:
    meta = json.loads((bundle / "bundle.json").read_text())
    model, threads = meta["model"], meta["server"]["cpu_threads"]
    out = sys.stdout.write
    out(f"\n{model['parameters'] / 1e6:.1f}M parameters ({model['layers']} layers, hidden {model['hidden_size']}), "
        f"Paddle Inference with {threads} threads, {args.workers} server worker(s), texts of 100 characters, "
        f"{args.rounds}×{args.repeats} timed calls each (ms)\n\n")
    out("| texts | in process p50 | in process p95 | served p50 | served p95 | served / in process (p50) |\n")
    out("|---:|---:|---:|---:|---:|---:|\n")
    for batch in (1, 8):
        local, served = (np.percentile(results[(kind, batch)], [50, 95]) for kind in ("in process", "served"))
        out(f"| {batch} | {local[0]:.1f} | {local[1]:.1f} | {served[0]:.1f} | {served[1]:.1f} | "
            f"{served[0] / local[0]:.2f}× |\n")
    ratio = np.percentile(results[("served", 8)], 50) / np.percentile(results[("in process", 8)], 50)
    out(f"\nserved / in process at 8 texts: {ratio:.2f}× (target ≤ 1.3×)\n")


if __name__ == "__main__":
    main()
