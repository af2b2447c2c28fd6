"""A real ``mlflow server`` on 127.0.0.1 for tests, with a SQLite store and proxied artifacts in a temporary folder.

A test module gets the fixture by naming this module as a plugin, or by importing it::

    pytest_plugins = ["tests.mlflow_server"]
    from tests.mlflow_server import mlflow_server  # noqa: F401  (then F811 on each test that takes it)

and takes ``mlflow_server`` as an argument: a started :class:`MlflowServer` whose ``uri`` the clients use, whose
``artifacts`` folder receives what they log, and which ``stop()``/``start()`` restart on the same port and store.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

logger = logging.getLogger(__name__)

MLFLOW = Path(sys.executable).parent / "mlflow"
HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_LOG_TAIL_LINES = 40


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class MlflowServer:
    """One ``mlflow server`` process group serving ``root/mlflow.db`` and ``root/artifacts`` on a fixed port."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._group: int | None = None

    @property
    def uri(self) -> str:
        """The tracking URI clients use."""
        return f"http://{HOST}:{self.port}"

    @property
    def artifacts(self) -> Path:
        """The server-side folder that proxied artifact uploads land in."""
        return self.root / "artifacts"

    @property
    def backend_store_uri(self) -> str:
        return f"sqlite:///{(self.root / 'mlflow.db').as_posix()}"

    @property
    def log(self) -> Path:
        """Everything the server printed, over all its starts."""
        return self.root / "server.log"

    def command(self) -> list[str]:
        """The ``mlflow server`` command line, on this server's port and folders."""
        own_hosts = [f"{HOST}:{self.port}", f"localhost:{self.port}"]
        return [
            str(MLFLOW), "server",
            "--host", HOST,
            "--port", str(self.port),
            "--workers", "1",
            "--backend-store-uri", self.backend_store_uri,
            "--serve-artifacts",
            "--artifacts-destination", str(self.artifacts),
            "--allowed-hosts", ",".join(own_hosts),
            "--cors-allowed-origins", ",".join(f"http://{host}" for host in own_hosts),
        ]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the server and return once ``/health`` answers; raise with the log's tail if it dies or is late."""
        if self._process is not None:
            raise RuntimeError(f"the MLflow server on {self.uri} is already running; stop() it first")
        if not MLFLOW.exists():
            raise RuntimeError(f"no mlflow executable beside the interpreter at {MLFLOW}; install mlflow in this venv")
        self.root.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            # The job runner (a huey consumer) is one more process and nothing these tests need.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("MLFLOW_TRACKING_URI", None)
        with self.log.open("ab") as log:
            log.write(f"--- {' '.join(self.command())}\n".encode())
            log.flush()
            # Its own session, so stop() can signal the CLI and the uvicorn process it spawns as one group;
            # cwd in root, so a default ./mlruns or ./mlartifacts could never land in the caller's folder.
            self._process = subprocess.Popen(
                self.command(), cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        self._group = self._process.pid
        logger.info("Started MLflow server %s (process group %d)", self.uri, self._group)
        try:
            self._wait_until_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Terminate the server's whole process group and wait until none of it is left; idempotent."""
        if self._process is None:
            return
        process, self._process = self._process, None
        self._signal_group(signal.SIGTERM)
        if not self._wait_until_gone(process, timeout):
            logger.warning("MLflow server %s ignored SIGTERM for %.0f s; killing it", self.uri, timeout)
            self._signal_group(signal.SIGKILL)
            if not self._wait_until_gone(process, 5.0):
                raise RuntimeError(f"MLflow server processes {self.processes()} survived SIGKILL")

    def processes(self) -> list[int]:
        """The live (non-zombie) processes in the process group of the server's current or latest start."""
        if self._group is None:
            return []
        members = []
        for process in psutil.process_iter(["status"]):
            try:
                if os.getpgid(process.pid) == self._group and process.info["status"] != psutil.STATUS_ZOMBIE:
                    members.append(process.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        return members

    def log_tail(self) -> str:
        """The last lines the server printed, for error messages."""
        if not self.log.exists():
            return "(no server log)"
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def _wait_until_healthy(self, timeout: float) -> None:
        # No proxies: a proxy from the environment must not answer for a server on the loopback interface.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while True:
            if self._process is not None and (code := self._process.poll()) is not None:
                raise RuntimeError(f"MLflow server on {self.uri} exited with code {code} before answering /health:\n"
                                   f"{self.log_tail()}")
            try:
                with opener.open(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"MLflow server on {self.uri} did not answer /health within {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def _wait_until_gone(self, process: subprocess.Popen[bytes], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        while self.processes():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self._group, signum)
        except ProcessLookupError:
            pass


@pytest.fixture
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowServer]:
    """A started MLflow server of its own for one test, stopped with all its processes afterwards."""
    # The client side of the test sends no telemetry either; mlflow reads this on every event.
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
