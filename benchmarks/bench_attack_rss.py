"""Issue 38's attack cases against the new server: its peak RSS during each case against its idle RSS, and whether
every answer arrived within its deadline. Run beside ``bench_llm_server.py`` (same bundle, same logging of the
model, the server started the same way as ``train-deploy serve`` starts it, with its default settings).

    .venv/bin/python benchmarks/bench_attack_rss.py --bundle PATH

The server's RSS is sampled every 5 ms from its pid with psutil. Idle: after one generation and one scoring
(engine loaded and run), the largest sample of 2 s at rest. Each case then runs on its own and reports the
largest sample from its start until every answer is in (goal: within 1.2x of idle), the statuses, and the
slowest answer against its deadline:

1. ``parquet``: the review's body (a dictionary-encoded, zstd-compressed parquet of 10**7 identical rows, 543 bytes
   that unfolded into 5 GB inside MLflow) 20 times on each route: 415, at once (deadline 1 s).
2. ``two content types``: 20 JSON requests with two ``Content-Type`` headers: 400 at once (1 s).
3. ``deep nesting``: 20 bodies of 200,000 ``[``: 400 at once (1 s).
4. ``stalled bodies``: 100 connections that declare the largest body the limits allow (``max_request_bytes``),
   send all but 100 kB of it and stall: each 408 at the read deadline (``body_timeout_s`` + 1 s).
5. ``burst past the budget``: 16 clients at once, each 24 prompts x 256 new tokens sampled (the review's burst, over the
   model's ``time_budget_s`` in all), then one scoring request: each generation 200, 429 or 503 within the budget
   + 1 s from its arrival, the scoring request within 1 s.

Prints a markdown table and writes it with every figure to ``results.json`` in ``--out`` (default: not kept).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import serving_harness as harness  # the same folder: benchmarks run as scripts
from serving_harness import HOST, MODEL, PROMPT, PROSE

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "benchmarks" / ".work" / "attack_rss"
GRACE_S = 1.0
"""How late past its deadline an answer may come and still count as in time."""
Answer = tuple[int, float]
"""One answer's status (0: none, the connection closed or timed out) and seconds from the request's first byte."""


class RssSampler:
    """The RSS of a process, sampled every 5 ms in a thread; :meth:`peak` is the largest since :meth:`reset`."""

    def __init__(self, pid: int) -> None:
        self._process, self._peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def reset(self) -> None:
        self._peak = self._process.memory_info().rss

    def peak(self) -> int:
        return self._peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def raw(port: int, head: str, body: bytes, timeout: float, stall: bool = False) -> Answer:
    """Send ``head`` and ``body`` as they are (``stall``: then wait without sending the rest); the answer's status."""
    started = time.perf_counter()
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and not stall:
                    break
    except OSError:
        return 0, time.perf_counter() - started
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, time.perf_counter() - started


def post(port: int, path: str, body: dict, timeout: float) -> Answer:
    started = time.perf_counter()
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    except OSError:
        return 0, time.perf_counter() - started
    finally:
        connection.close()


def together(calls: list[Callable[[], Answer]]) -> list[Answer]:
    """Every call at once, one thread each; their answers in order."""
    answers: list[Answer] = [(0, 0.0)] * len(calls)

    def one(i: int) -> None:
        answers[i] = calls[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def parquet_body() -> bytes:
    """The review's body: 10**7 identical rows, dictionary-encoded and zstd-compressed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.DictionaryArray.from_arrays(pa.array([0] * 10**7, pa.int32()), pa.array([PROMPT]))
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": column}), sink, compression="zstd")
    return sink.getvalue()


def cases(port: int, limits: Any, body_timeout: float) -> dict[str, tuple[Callable[[], list[Answer]], float]]:
    """Each case's run (its answers) and its deadline in seconds per answer (module docstring)."""
    parquet = parquet_body()
    nested = b"[" * 200_000
    json_head = "Content-Type: application/json"
    most, budget = limits.max_request_bytes, float(limits.serving.time_budget_s)

    def head(path: str, length: int, *headers: str) -> str:
        return "\n".join([f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", *headers])

    def burst() -> list[Answer]:
        bodies = [{"model": MODEL, "prompt": [PROMPT] * 24, "max_tokens": 256, "temperature": 1.0, "seed": seed}
                  for seed in range(16)]  # sampled: greedy text of one prompt reaches the end of document early
        answers = together([lambda b=body: post(port, "/v1/completions", b, budget + 30) for body in bodies])
        score = {"inputs": [PROSE[:30]], "params": {"task": "score"}}
        return [*answers, post(port, "/invocations", score, 30)]

    parquet_head = "Content-Type: application/vnd.apache.parquet"
    return {
        "parquet (543 bytes of 10^7 rows), 40 requests": (lambda: together(
            [lambda p=path: raw(port, head(p, len(parquet), parquet_head), parquet, 10)
             for path in ("/invocations", "/v1/completions") for _ in range(20)]), GRACE_S),
        "two Content-Type headers, 20 requests": (lambda: together(
            [lambda: raw(port, head("/invocations", 2, json_head, "Content-Type: text/csv"), b"{}", 10)] * 20),
            GRACE_S),
        "200,000 '[' (deep nesting), 20 requests": (lambda: together(
            [lambda: raw(port, head("/invocations", len(nested), json_head), nested, 10)] * 20), GRACE_S),
        f"100 stalled bodies ({most - 100_000:,} of {most:,} bytes sent)": (lambda: together(
            [lambda: raw(port, head("/invocations", most, json_head), b"{" + b" " * (most - 100_001), 60, stall=True)]
            * 100), body_timeout + GRACE_S),
        "16 clients x 24 prompts x 256 tokens at once, then 1 score": (burst, budget + GRACE_S),
    }


def measure(process: subprocess.Popen, port: int, limits: Any, body_timeout: float) -> dict:
    """Idle RSS, then each case's peak RSS, statuses and slowest answer against its deadline."""
    post(port, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}, 60)
    post(port, "/invocations", {"inputs": [PROSE[:30]], "params": {"task": "score"}}, 60)
    sampler = RssSampler(process.pid)
    try:
        time.sleep(1.0)
        sampler.reset()
        time.sleep(2.0)
        idle = sampler.peak()
        results: dict = {"idle_rss_mib": idle / 2**20, "cases": {}}
        for name, (run, deadline) in cases(port, limits, body_timeout).items():
            time.sleep(1.0)  # what the last case freed is given back
            sampler.reset()
            answers = run()
            time.sleep(0.05)
            statuses = {str(s): sum(a[0] == s for a in answers) for s in sorted({a[0] for a in answers})}
            slowest = max(a[1] for a in answers)
            if name.startswith("16 clients"):  # the scoring request after the burst: 1 s
                in_time = max(a[1] for a in answers[:-1]) <= deadline and answers[-1][1] <= GRACE_S
            else:
                in_time = slowest <= deadline
            results["cases"][name] = {"peak_rss_mib": sampler.peak() / 2**20, "ratio": sampler.peak() / idle,
                                      "statuses": statuses, "slowest_s": slowest, "deadline_s": deadline,
                                      "in_time": in_time, "after_burst_score_s": answers[-1][1]
                                      if name.startswith("16 clients") else None}
            sys.stdout.write(f"{name}: {json.dumps(results['cases'][name])}\n")
        return results
    finally:
        sampler.close()


def report(results: dict) -> str:
    lines = [f"idle RSS {results['idle_rss_mib']:.0f} MiB, load {os.getloadavg()[0]:.1f}", "",
             "| attack case | peak RSS MiB | peak / idle | statuses | slowest answer s | deadline s | in time |",
             "|---|---:|---:|---|---:|---:|---|"]
    for name, row in results["cases"].items():
        lines.append(f"| {name} | {row['peak_rss_mib']:.0f} | {row['ratio']:.2f}x | {row['statuses']} | "
                     f"{row['slowest_s']:.2f} | {row['deadline_s']:.0f} | {'yes' if row['in_time'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = harness.arguments(__doc__).parse_args()
    from train_deploy.registry.model import Limits
    from train_deploy.serving.app import ServerSettings

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    process = None
    try:
        uri, model = harness.log_model(args.bundle, WORK)
        process, port = harness.start("new", harness.new_server_command(model), harness.server_env(uri, model), WORK)
        limits = Limits()  # as log_bundle_model records them by default
        results = measure(process, port, limits, ServerSettings().body_timeout_s)
        harness.save_results(args.out, results, report(results))
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
