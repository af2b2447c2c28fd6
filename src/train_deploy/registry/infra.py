"""The serving check before promotion, in the manner of TFX's InfraValidator.

The gate scores a candidate in the training run's own process. Production starts it differently: ``train-deploy
serve`` downloads the registered version and runs the project's server (``train_deploy.serving.app`` under this
environment's uvicorn) from the model's own copy of the code, in a fresh process. Before the aliases move,
:func:`check_serving` starts the candidate exactly that way, from an empty folder, and asks it for one score and
one greedy generation. A server that does not start, does not answer within
``registry.serving_check.timeout_seconds``, or answers either request with an error fails the check: the gate
rejects the candidate, with the reason on the version, and the champion stays.
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

from train_deploy.registry.config import ServingCheckConfig
from train_deploy.run_control.processes import stop_process_tree

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
PROBE_TEXT = "今天天气很好。"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the loopback server, never a proxy


class ServingCheckFailed(RuntimeError):
    """The candidate's served form did not start or did not answer; the message says which, in one line."""


# The server as train-deploy serve starts it: the version downloaded, then uvicorn with the model's own code first
# on sys.path (one process, so the check's process tree is the server's).
_LAUNCH = """
import os, sys
import mlflow
uri, target, uvicorn, host, port = sys.argv[1:]
model = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=target)
os.environ["TRAIN_DEPLOY_SERVED_MODEL"] = model
os.execv(uvicorn, [uvicorn, "--factory", "--app-dir", os.path.join(model, "code"), "--host", host, "--port", port,
                   "train_deploy.serving.app:create_app"])
"""


def serving_command(model_uri: str, target: Path, host: str, port: int) -> list[str]:
    """This environment's Python downloading ``model_uri`` into ``target``, then becoming uvicorn running the
    project's server from the package logged with the model."""
    uvicorn = Path(sys.executable).parent / "uvicorn"
    return [sys.executable, "-c", _LAUNCH, model_uri, str(target), str(uvicorn), host, str(port)]


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
        name, _, version = model_uri.removeprefix("models:/").partition("/")
        env.update(TRAIN_DEPLOY_SERVED_NAME=name, TRAIN_DEPLOY_SERVED_VERSION=version or "unregistered")
        log = Path(scratch) / "server.log"
        command = serving_command(model_uri, Path(scratch) / "model", HOST, port)
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=folder or scratch, env=env,
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
