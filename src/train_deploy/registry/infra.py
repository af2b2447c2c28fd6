"""The serving check before promotion, in the manner of TFX's InfraValidator.

The gate scores a candidate in the training run's own process. Production starts it differently: this
environment's ``mlflow models serve`` of the registered version, in a fresh process, from an empty folder,
with only the model's own copy of the code. Before the aliases move, :func:`check_serving` starts the
candidate exactly that way and asks it for one score and one greedy generation. A server that does not
start, does not answer within ``registry.serving_check.timeout_seconds``, or answers either request with an
error fails the check: the gate rejects the candidate, with the reason on the version, and the champion stays.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from train_deploy.processes import stop_process_tree
from train_deploy.registry.config import ServingCheckConfig

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
PROBE_TEXT = "今天天气很好。"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the loopback server, never a proxy


class ServingCheckFailed(RuntimeError):
    """The candidate's served form did not start or did not answer; the message says which, in one line."""


def serving_command(model_uri: str, host: str, port: int, workers: int = 1) -> list[str]:
    """This environment's ``mlflow models serve`` of ``model_uri``, in this Python environment."""
    mlflow = Path(sys.executable).parent / "mlflow"
    return [str(mlflow), "models", "serve", "-m", model_uri, "--env-manager", "local", "-h", host, "-p", str(port),
            "--workers", str(workers)]


def serving_environment(tracking: str, registry: str) -> dict[str, str]:
    """The server's environment: ``tracking``/``registry`` as the store, this environment's ``bin`` first on
    ``PATH`` (the CLI starts ``uvicorn`` by name)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "MLFLOW_TRACKING_URI": tracking, "MLFLOW_REGISTRY_URI": registry, "PATH": path}


def check_serving(model_uri: str, tracking: str, registry: str, config: ServingCheckConfig,
                  folder: Path | None = None) -> str:
    """Serve ``model_uri`` in a fresh process (working folder ``folder``, where the store's relative artifact
    locations resolve; a new empty folder when None) and ask it to score and to generate; return what it did
    in one line, or raise :class:`ServingCheckFailed`."""
    deadline = time.monotonic() + config.timeout_seconds
    with tempfile.TemporaryDirectory(prefix="train_deploy-serving-check-") as scratch:
        port = _free_port()
        env = {key: value for key, value in serving_environment(tracking, registry).items() if key != "PYTHONPATH"}
        log = Path(scratch) / "server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(serving_command(model_uri, HOST, port), cwd=folder or scratch, env=env,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            started = _wait_until_up(process, port, deadline, log)
            answers = [_ask(port, task, params, deadline) for task, params in _REQUESTS]
        finally:
            stop_process_tree(process, grace=10.0)
    took = config.timeout_seconds - (deadline - time.monotonic())
    return (f"served {model_uri} from a fresh process: up in {started:.1f} s, answered "
            f"{' and '.join(answers)} ({took:.1f} s in all)")


_REQUESTS = (("score", {"task": "score"}),
             ("generate", {"task": "generate", "max_new_tokens": 4, "temperature": 0.0}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _wait_until_up(process: subprocess.Popen, port: int, deadline: float, log: Path) -> float:
    start = time.monotonic()
    while True:
        if _get(port, "/ping"):
            return time.monotonic() - start
        if process.poll() is not None:
            raise ServingCheckFailed(f"the server exited with code {process.returncode} before answering"
                                     f"{_last_error(log)}")
        if time.monotonic() > deadline:
            raise ServingCheckFailed(f"the server did not answer /ping within the time limit{_last_error(log)}")
        time.sleep(0.5)


def _get(port: int, path: str) -> bool:
    try:
        with _OPENER.open(f"http://{HOST}:{port}{path}", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _ask(port: int, task: str, params: dict[str, Any], deadline: float) -> str:
    body = json.dumps({"dataframe_split": {"columns": ["text"], "data": [[PROBE_TEXT]]}, "params": params})
    request = urllib.request.Request(f"http://{HOST}:{port}/invocations", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    start, left = time.monotonic(), deadline - time.monotonic()
    if left <= 0:
        raise ServingCheckFailed(f"no time left for the {task} request")
    try:
        with _OPENER.open(request, timeout=left) as response:
            rows = json.loads(response.read()).get("predictions")
    except urllib.error.HTTPError as exc:
        raise ServingCheckFailed(f"the {task} request got HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServingCheckFailed(f"the {task} request got no answer ({type(exc).__name__})") from None
    if not isinstance(rows, list) or len(rows) != 1:
        raise ServingCheckFailed(f"the {task} request's answer holds no prediction for the one text sent")
    return f"{task} in {time.monotonic() - start:.2f} s"


def _last_error(log: Path) -> str:
    """The last line of the server's log that names an error, cut short (the reason goes on the version)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line] or lines[-1:]
    return f": {errors[-1][:200]}" if errors else ""
