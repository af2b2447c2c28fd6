"""A tracking server's model store, the registry command, the gate and a served model, each in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow

REGISTERED_MODEL = "train_deploy_lm"


FRESH_TIMEOUT_S = 300


# The gate as the registry stage runs it, in a process of its own: arguments from a JSON file, the decision as the
# last line of standard output, INFO logs (the registry lock's waits, MLflow's "Created version") on standard error.
_GATE_SCRIPT = """
import json, logging, sys
import mlflow
from train_deploy.handoffs import Bundle
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.gate import register_and_gate

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
args = json.loads(open(sys.argv[1], encoding="utf-8").read())
mlflow.set_tracking_uri(args["uri"])
mlflow.set_registry_uri(args["uri"])
with mlflow.start_run(experiment_id=mlflow.set_experiment("gate-processes").experiment_id):
    result = register_and_gate(Bundle.read_folder(args["bundle"]), RegistryConfig.from_params(args["registry"]),
                               args["tags"], lambda: args["texts"])
print(json.dumps({"version": result.version, "decision": result.decision, "reason": result.reason}))
"""


@dataclass(frozen=True)
class ModelStore:
    """A SQLite tracking and registry store with its artifacts under ``root``."""

    root: Path

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{(self.root / 'mlflow.db').as_posix()}"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This store as the process's tracking and registry URI, restored afterwards."""
        tracking, registry = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        if mlflow.get_experiment_by_name("registry-tests") is None:  # artifacts under root, never in the cwd
            mlflow.create_experiment("registry-tests", artifact_location=str(self.root / "artifacts"))
        mlflow.set_experiment("registry-tests")  # runs go here, not to an experiment id of another test's store
        try:
            yield
        finally:
            mlflow.set_tracking_uri(tracking)
            mlflow.set_registry_uri(registry)

    def log(self, bundle: Path, **kwargs: Any) -> mlflow.models.model.ModelInfo:
        """``log_bundle_model(bundle, **kwargs)`` in a new run of this store."""
        from train_deploy.registry.model import log_bundle_model

        with self.active():
            with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("registry-tests").experiment_id):
                return log_bundle_model(bundle, **kwargs)

    def environment(self) -> dict[str, str]:
        """A child process's environment: this store as its tracking URI, nothing pointing at the checkout."""
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MLFLOW_REGISTRY_URI")}
        return {**env, "MLFLOW_TRACKING_URI": self.tracking_uri, "MLFLOW_DISABLE_TELEMETRY": "true",
                "PYTHONUNBUFFERED": "1"}


def registry(store: ModelStore, *args: str) -> subprocess.CompletedProcess[str]:
    """``train-deploy-registry *args``, in its own process, with the store as MLFLOW_TRACKING_URI."""
    command = Path(sys.executable).parent / "train-deploy-registry"
    return subprocess.run([str(command), *args], env=store.environment(), capture_output=True, text=True,
                          timeout=120, check=False)


def run_fresh(script: str, store: ModelStore, folder: Path, timeout: float = FRESH_TIMEOUT_S) -> Any:
    """Run ``script`` with this venv's Python in a new process started in the empty ``folder`` (no PYTHONPATH,
    ``store`` as its tracking URI); return the JSON it writes as its last line of standard output."""
    folder.mkdir(parents=True, exist_ok=True)
    assert not any(folder.iterdir()), f"{folder} is not empty"
    done = subprocess.run([sys.executable, "-c", script], cwd=folder, env=store.environment(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"the fresh process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


class ModelServer:
    """``mlflow models serve -m <uri> --env-manager local`` on 127.0.0.1 as its own process group, started in an
    empty folder with ``store`` as its tracking URI and this venv's ``bin`` first on ``PATH`` (the CLI starts
    ``uvicorn`` by name)."""

    def __init__(self, uri: str, store: ModelStore, folder: Path, workers: int = 1) -> None:
        from tests.mlflow_server import HOST, MLFLOW, free_port

        self.url = f"http://{HOST}:{free_port()}"
        self.command = [str(MLFLOW), "models", "serve", "-m", uri, "--env-manager", "local", "-h", HOST,
                        "-p", self.url.rsplit(":", 1)[1], "--workers", str(workers)]
        self.folder, self.log = folder, folder.parent / f"{folder.name}.log"
        self._env = {**store.environment(), "PATH": f"{MLFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        """Start and return once ``/ping`` answers 200; raise with the log's tail if it exits or is late."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(self.command, cwd=self.folder, env=self._env, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._answers("/ping"):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"{' '.join(self.command)} did not answer /ping:\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Terminate the server's process group (the CLI and uvicorn's processes), killing what outlives 15 s."""
        if self._process is None:
            return
        process, self._process = self._process, None
        for signum, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def post(self, body: Any) -> tuple[int, Any]:
        """POST ``body`` as JSON to ``/invocations``; return the status and the decoded JSON answer."""
        request = urllib.request.Request(f"{self.url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def _answers(self, path: str) -> bool:
        try:
            with _OPENER.open(f"{self.url}{path}", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


# No proxies: a proxy from the environment must not answer for a server on the loopback interface.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class GateProcess:
    """``register_and_gate`` of ``bundle`` against the store at ``uri``, in a new process started in the empty
    ``folder`` (its log: ``folder/gate.log``)."""

    def __init__(self, folder: Path, uri: str, bundle: Any, registry: dict[str, Any], tags: dict[str, str],
                 texts: list[str]) -> None:
        folder.mkdir(parents=True)
        arguments = folder / "gate.json"
        arguments.write_text(json.dumps({"uri": uri, "bundle": bundle.path, "registry": registry, "tags": tags,
                                         "texts": texts}), encoding="utf-8")
        self.log = folder / "gate.log"
        env = {key: value for key, value in os.environ.items()
               if key not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-c", _GATE_SCRIPT, str(arguments)], cwd=folder,
                                            env={**env, "MLFLOW_DISABLE_TELEMETRY": "true"},
                                            stdout=subprocess.PIPE, stderr=log, text=True)

    def wait_for(self, text: str, timeout: float = FRESH_TIMEOUT_S) -> None:
        """Return once the process has logged ``text``; fail if it ends first or is late."""
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text(errors="replace"):
            assert self.process.poll() is None, f"the gate ended before logging {text!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"the gate did not log {text!r}:\n{self.tail()}"
            time.sleep(0.05)

    def result(self, timeout: float = FRESH_TIMEOUT_S) -> dict[str, str]:
        """The decision the process printed; fail with its log's tail if it failed."""
        out, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, f"the gate failed:\n{self.tail()}"
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        self.process.kill()
        self.process.communicate(timeout=60)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
