"""Issue 40's replica benchmark, in one run: the single-process server (``train_deploy.serving.app`` under uvicorn,
what ``train-deploy serve`` runs) against the same app as 1 and 2 Ray Serve replicas behind Ray Serve's proxy
(``python -m train_deploy.serving.replicas``, what ``train-deploy serve --replicas N`` runs, on a private local
Ray instance), for scoring and for generation.

    .venv/bin/python benchmarks/bench_replicas.py --bundle PATH
    .venv/bin/python benchmarks/bench_replicas.py --bundle PATH --seconds 20 --clients 1 8 --new 32

Logs the bundle as version 1 of a model in a SQLite store under benchmarks/.work/llm_server (``bench_llm_server``'s
``log_model``), then starts each server alone (so each has the machine to itself; Ray's start-up is not measured)
and measures, for each ``--clients`` count, clients sending back to back on kept-alive connections for
``--seconds``: scoring (one text of 30 characters on ``/invocations``: requests/s, p50/p99) and greedy generation
(``--new`` tokens on ``/v1/completions``: tokens/s, p50/p99). Prints a markdown table with, for 1 replica, the
proxy's overhead against the single server (issue 40's goal: at most 15% fewer requests or tokens per second), and
for 2 replicas, the scaling against 1; ``--out`` keeps ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import bench_llm_server  # same folder
from bench_llm_server import HOST, MODEL, PROSE, WORK, generation, load, log_model, summary
from bench_serve import answering, free_port

SERVERS = {"single": 0, "1 replica": 1, "2 replicas": 2}
"""Each server measured, and its Ray Serve replicas (0: no Ray, uvicorn alone)."""


def start(name: str, replicas: int, tracking_uri: str, model: str) -> tuple[subprocess.Popen, int]:
    """The server ``name`` of the downloaded ``model`` from an empty folder, answering /ping, and its port."""
    port, folder, log = free_port(), WORK / name.replace(" ", "_"), WORK / f"{name.replace(' ', '_')}.log"
    folder.mkdir()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "TRAIN_DEPLOY_SERVED_MODEL": model, "TRAIN_DEPLOY_SERVED_NAME": MODEL, "TRAIN_DEPLOY_SERVED_VERSION": "1"}
    if replicas:
        command = [sys.executable, "-m", "train_deploy.serving.replicas"]
        env |= {"TRAIN_DEPLOY_SERVE_HOST": HOST, "TRAIN_DEPLOY_SERVE_PORT": str(port),
                "TRAIN_DEPLOY_SERVE_REPLICAS": str(replicas), "TRAIN_DEPLOY_SERVE_MAX_REPLICAS": str(replicas)}
    else:
        command = [str(bin_dir / "uvicorn"), "--factory", "--host", HOST, "--port", str(port), "--log-level",
                   "warning", "train_deploy.serving.app:create_app"]
    process = subprocess.Popen(command, cwd=folder, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, answering(process, port, log, 600)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (Ray's own processes too), SIGKILL after 60 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def measure(port: int, args) -> dict:
    """Scoring, then generation, at each ``--clients`` count, after a short warm-up."""
    score = {"inputs": [PROSE[:30]], "params": {"task": "score"}}
    path, body = generation("new", args.new)
    load(port, 2, 2, path, body, lambda _: 0)  # every replica's engines loaded and run once (two clients)
    results = {}
    for clients in args.clients:
        results[f"score, {clients} clients"] = summary(*load(port, clients, args.seconds, "/invocations", score,
                                                             lambda _: 0))
        results[f"generate, {clients} clients"] = summary(*load(port, clients, args.seconds, path, body,
                                                                lambda _: 0))
    return results


def report(results: dict[str, dict], args) -> str:
    """One row per measurement: each server's rate and latency, 1 replica's overhead, 2 replicas' scaling."""
    lines = [f"{args.seconds:.0f} s per measurement, {args.new} new tokens, load {os.getloadavg()[0]:.1f}", "",
             "| measurement | single | 1 replica | 2 replicas | proxy overhead at 1 | scaling at 2 "
             "| p50 ms single / 1 / 2 |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for key in results["single"]:
        rate = "tokens_per_s" if key.startswith("generate") else "requests_per_s"
        single, one, two = (results[name][key] for name in SERVERS)
        overhead = 1 - one[rate] / single[rate] if single[rate] else float("nan")
        scaling = two[rate] / one[rate] if one[rate] else float("nan")
        lines.append(f"| {key} ({rate.replace('_per_s', '/s')}) | {single[rate]:.1f} | {one[rate]:.1f} | "
                     f"{two[rate]:.1f} | {overhead:+.1%} | {scaling:.2f}x | {single['p50_ms']:.0f} / "
                     f"{one['p50_ms']:.0f} / {two['p50_ms']:.0f} |")
    statuses = {name: {key: row["statuses"] for key, row in rows.items()} for name, rows in results.items()}
    return "\n".join(lines) + f"\n\nstatuses: {json.dumps(statuses)}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the bundle folder (with bundle.json)")
    parser.add_argument("--seconds", type=float, default=20, help="length of each measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients")
    parser.add_argument("--new", type=int, default=32, help="new tokens per generation")
    parser.add_argument("--prompt", default=bench_llm_server.PROMPT,
                        help="the generations' prompt: one whose greedy continuation runs all --new tokens")
    parser.add_argument("--out", type=Path, default=None, help="keep results.json here (default: not kept)")
    args = parser.parse_args()
    bench_llm_server.PROMPT = args.prompt  # generation() reads it
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    results: dict[str, dict] = {}
    try:
        tracking_uri, model = log_model(args.bundle, WORK)
        for name, replicas in SERVERS.items():
            process, port = start(name, replicas, tracking_uri, model)
            try:
                results[name] = measure(port, args)
            finally:
                stop(process)
            sys.stdout.write(f"{name}: {json.dumps(results[name])}\n")
        table = report(results, args)
        sys.stdout.write("\n" + table)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps({"results": results, "table": table}, indent=2))
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
