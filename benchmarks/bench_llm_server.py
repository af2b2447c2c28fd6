"""Issue 38's server benchmarks, side by side in one run: MLflow's scoring server (``mlflow models serve``, what
``train-deploy serve`` ran before issue 38) and the new server (``train_deploy.serving.app`` under uvicorn, as
``train-deploy serve`` runs it now), both up at once over the same logged model, measured configuration by
configuration, one server after the other, so both see the same machine.

    .venv/bin/python benchmarks/bench_llm_server.py --bundle PATH
    .venv/bin/python benchmarks/bench_llm_server.py --bundle PATH --seconds 10 --clients 1 4 16 --new 32 256

Logs the bundle as an MLflow model (``log_bundle_model``, the ``registry.serving`` defaults) into a SQLite store
under benchmarks/.work/llm_server and measures, on each server:

1. generation: ``--clients`` (1, 4, 16) threads each sending one greedy request (one prompt, ``--new`` 32 or 256
   new tokens) back to back on a kept-alive connection for ``--seconds``: aggregate generated tokens per second,
   requests per second, p50/p99 latency and the statuses. MLflow's server is asked on ``/invocations``
   (``task: generate``; its tokens counted by encoding the answer with the bundle's tokenizer), the new one on
   ``/v1/completions`` (``usage.completion_tokens``).
2. time to first token, streaming (``stream: true``), at 1 and 16 clients: the new server only (MLflow's
   scoring server cannot stream).
3. scoring (one text of 30 characters on ``/invocations``) p50/p99 alone, and while 16 clients generate 256
   tokens each back to back.

Prints markdown tables (issue 38's goals: at least 3x today's aggregate tokens/s at 16 clients with p99 no
worse; scoring p99 under load within 2x of alone) and writes them with every figure to ``results.json`` in
``--out`` (default: the work folder, which is otherwise removed afterwards).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from serving_harness import (  # the same folder: benchmarks run as scripts
    HOST,
    MODEL,
    PROMPT,
    PROSE,
    arguments,
    log_model,
    new_server_command,
    save_results,
    server_env,
    start,
)

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "llm_server"
Outcome = tuple[int, float, int, float | None]
"""One request's status, seconds, generated tokens and seconds to its first streamed token (None: not streamed)."""


def servers(tracking_uri: str, model: str, running: dict[str, tuple[subprocess.Popen, int]]) -> None:
    """Start MLflow's scoring server (``today``) and the new server (``new``) of the same model into ``running``
    (so that the caller stops the first should the second fail), both answering."""
    today = [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", f"models:/{MODEL}/1",
             "--env-manager", "local", "-h", HOST, "-p", "{port}"]
    running["today"] = start("today", today, server_env(tracking_uri), WORK)
    running["new"] = start("new", new_server_command(model), server_env(tracking_uri, model), WORK)


def generation(server: str, new_tokens: int, stream: bool = False) -> tuple[str, dict]:
    """The route and body of one greedy generation on ``server``."""
    if server == "today":
        return "/invocations", {"inputs": [PROMPT], "params": {"task": "generate", "max_new_tokens": new_tokens,
                                                               "temperature": 0.0}}
    return "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": new_tokens, "temperature": 0,
                               "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def request(connection: http.client.HTTPConnection, path: str, body: dict, count: Callable[[str], int]) -> Outcome:
    """POST ``body`` and read the whole answer (a stream event by event); its outcome."""
    start = time.perf_counter()
    connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if not body.get("stream") or response.status != 200:
        answer = response.read()
        tokens = _tokens(json.loads(answer), count) if response.status == 200 else 0
        return response.status, time.perf_counter() - start, tokens, None
    first, tokens = None, 0
    for line in response:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if first is None and any(choice.get("text") for choice in event.get("choices", [])):
            first = time.perf_counter() - start
        tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return response.status, time.perf_counter() - start, tokens, first


def _tokens(answer: dict, count: Callable[[str], int]) -> int:
    if "usage" in answer:
        return answer["usage"]["completion_tokens"]
    return sum(count(row["generated"]) for row in answer.get("predictions", []) if "generated" in row)


def load(port: int, clients: int, seconds: float, path: str, body: dict,
         count: Callable[[str], int]) -> tuple[list[Outcome], float]:
    """``clients`` threads sending ``body`` back to back for ``seconds``; every outcome and the wall time."""
    outcomes: list[Outcome] = []
    until = time.monotonic() + seconds

    def client() -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=300)
        while time.monotonic() < until:
            outcomes.append(request(connection, path, body, count))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - started


def summary(outcomes: list[Outcome], wall: float) -> dict:
    """Aggregate figures of one measurement."""
    done = [o for o in outcomes if o[0] == 200]
    seconds = [o[1] * 1000 for o in done] or [float("nan")]
    firsts = [o[3] * 1000 for o in done if o[3] is not None] or [float("nan")]
    statuses = {str(status): sum(o[0] == status for o in outcomes) for status in sorted({o[0] for o in outcomes})}
    return {"requests": len(outcomes), "statuses": statuses, "tokens_per_s": sum(o[2] for o in done) / wall,
            "requests_per_s": len(done) / wall, "p50_ms": float(np.percentile(seconds, 50)),
            "p99_ms": float(np.percentile(seconds, 99)), "ttft_p50_ms": float(np.percentile(firsts, 50)),
            "ttft_p99_ms": float(np.percentile(firsts, 99))}


def scoring_under_load(port: int, server: str, seconds: float, count: Callable[[str], int]) -> dict:
    """Scoring alone, then while 16 clients generate 256 tokens each back to back."""
    score = {"inputs": [PROSE[:30]], "params": {"task": "score"}}
    alone = summary(*load(port, 1, seconds, "/invocations", score, count))
    path, body = generation(server, 256)
    # the generating clients run in a process of their own: as threads of this one they would hold the GIL the
    # scoring client needs to read its answer, and count their wait as the server's
    busy = multiprocessing.get_context("spawn").Process(target=load, args=(port, 16, seconds + 4, path, body, len))
    busy.start()
    time.sleep(3.0)  # the generations are running before the scoring starts (the process imports numpy first)
    loaded = summary(*load(port, 1, seconds, "/invocations", score, count))
    busy.join()
    return {"alone": alone, "while 16 clients generate 256 tokens": loaded}


def measure(ports: dict[str, int], args, count: Callable[[str], int]) -> dict:
    """Every figure of the module docstring, configuration by configuration, one server after the other."""
    results: dict = {"generation": {}, "first token": {}, "scoring": {}}
    for server, port in ports.items():  # warm-up: both engines loaded and run once
        load(port, 1, 2, *generation(server, 8), count)
    for new_tokens in args.new:
        for clients in args.clients:
            for server, port in ports.items():
                key = f"{server}, {clients} clients, {new_tokens} tokens"
                results["generation"][key] = summary(*load(port, clients, args.seconds,
                                                           *generation(server, new_tokens), count))
                sys.stdout.write(f"{key}: {json.dumps(results['generation'][key])}\n")
    for clients in (1, 16):
        path, body = generation("new", 32, stream=True)
        results["first token"][f"new, {clients} clients"] = summary(*load(ports["new"], clients, args.seconds,
                                                                          path, body, count))
    for server, port in ports.items():
        results["scoring"][server] = scoring_under_load(port, server, args.seconds, count)
    return results


def report(bundle: Path, args, results: dict) -> str:
    """The results as markdown tables."""
    model = json.loads((bundle / "bundle.json").read_text())["model"]
    lines = [f"{model.get('parameters', 0) / 1e6:.1f}M parameters, {args.seconds:.0f} s per measurement, "
             f"load {os.getloadavg()[0]:.1f}", "",
             "| server | clients | new tokens | tokens/s | requests/s | p50 ms | p99 ms | statuses |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for key, row in results["generation"].items():
        server, clients, tokens = (part.split()[0] for part in key.split(", "))
        lines.append(f"| {server} | {clients} | {tokens} | {row['tokens_per_s']:.0f} | {row['requests_per_s']:.1f} | "
                     f"{row['p50_ms']:.0f} | {row['p99_ms']:.0f} | {row['statuses']} |")
    lines += ["", "| streaming, 32 tokens | TTFT p50 ms | TTFT p99 ms |", "|---|---:|---:|"]
    lines += [f"| {key} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} |"
              for key, row in results["first token"].items()]
    lines += ["", "| scoring | alone p50 / p99 ms | under load p50 / p99 ms | p99 ratio |", "|---|---:|---:|---:|"]
    for server, (alone, loaded) in ((s, tuple(r.values())) for s, r in results["scoring"].items()):
        lines.append(f"| {server} | {alone['p50_ms']:.0f} / {alone['p99_ms']:.0f} | {loaded['p50_ms']:.0f} / "
                     f"{loaded['p99_ms']:.0f} | {loaded['p99_ms'] / alone['p99_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    global PROMPT  # the requests' prompt (--prompt; generation_request reads it)
    parser = arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=10, help="length of each measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--new", type=int, nargs="+", default=[32, 256], help="new tokens per generation")
    parser.add_argument("--prompt", default=PROMPT,
                        help="the prompt: one whose greedy continuation runs all --new tokens on the bundle "
                             "(one that stops early at its end-of-text token measures requests, not tokens)")
    args = parser.parse_args()
    PROMPT = args.prompt
    from train_deploy.export.runtime import bundle_tokenizer, read_bundle

    tokenizer = bundle_tokenizer(args.bundle, read_bundle(args.bundle))
    count = lambda text: len(tokenizer.encode([text])[0])  # noqa: E731
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    running: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        servers(*log_model(args.bundle, WORK), running)
        results = measure({name: port for name, (_, port) in running.items()}, args, count)
        save_results(args.out, results, report(args.bundle, args, results))
    finally:
        for process, _ in running.values():
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
