"""A real ``mlflow server`` on 127.0.0.1 for tests, with a SQLite store and proxied artifacts in a temporary folder.

A test module gets the fixture by naming this module as a plugin, or by importing it::

    pytest_plugins = ["tests.mlflow_server"]
    from tests.mlflow_server import mlflow_server  # noqa: F401  (then F811 on each test that takes it)

and takes ``mlflow_server`` as an argument: a started :class:`MlflowServer` whose ``uri`` the clients use, whose
``artifacts`` folder receives what they log, and which ``stop()``/``start()`` restart on the same port and store.
``mlflow_auth_server`` is the same server with MLflow's authentication (:class:`MlflowAuthServer`, the README's team
server): ``admin`` holds the administrator's credentials and ``create_user()`` adds a user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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

    def environment(self) -> dict[str, str]:
        """Variables the server process gets on top of this process's environment."""
        return {}

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
            **self.environment(),
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


@contextlib.contextmanager
def running_mlflow_server(tmp_path_factory: pytest.TempPathFactory, kind: type[MlflowServer] = MlflowServer,
                          folder: str = "mlflow_server") -> Iterator[MlflowServer]:
    """A started MLflow server (``kind``) in a folder of its own, stopped with all its processes at the end; the
    client side sends no telemetry meanwhile (mlflow reads the setting on every event)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        server = kind(tmp_path_factory.mktemp(folder), free_port())
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A started MLflow server of its own for one test, stopped with all its processes afterwards."""
    with running_mlflow_server(tmp_path_factory) as server:
        yield server


@dataclass(frozen=True, slots=True)
class User:
    """A user of an authenticating server, with the credentials a client sends."""

    username: str
    password: str


class MlflowAuthServer(MlflowServer):
    """An ``mlflow server --app-name basic-auth``, set up as the README's team server: users, passwords and
    permissions in ``root/basic_auth.db``, the admin's password generated here and set at start through an auth
    configuration file readable by its owner only (``root/basic_auth.ini``), every user may edit every
    experiment (``default_permission = EDIT``), and a client without credentials is refused (HTTP 401)."""

    def __init__(self, root: Path, port: int) -> None:
        super().__init__(root, port)
        self.admin = User("admin", secrets.token_urlsafe(18))
        self._secret_key = secrets.token_hex(32)

    @property
    def auth_config(self) -> Path:
        return self.root / "basic_auth.ini"

    def command(self) -> list[str]:
        return [*super().command(), "--app-name", "basic-auth"]

    def environment(self) -> dict[str, str]:
        return {"MLFLOW_AUTH_CONFIG_PATH": str(self.auth_config), "MLFLOW_FLASK_SERVER_SECRET_KEY": self._secret_key}

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.auth_config.exists():
            # Created owner-only before the password is written into it.
            descriptor = os.open(self.auth_config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as config:
                config.write(f"[mlflow]\ndefault_permission = EDIT\n"
                             f"database_uri = sqlite:///{(self.root / 'basic_auth.db').as_posix()}\n"
                             f"admin_username = {self.admin.username}\nadmin_password = {self.admin.password}\n"
                             "auth_cache_ttl_seconds = 60\n")
        super().start(timeout)

    def create_user(self, username: str) -> User:
        """A new (non-admin) user with a generated password, created by the admin through the REST API."""
        from mlflow.server.auth.routes import CREATE_USER
        from mlflow.utils.rest_utils import MlflowHostCreds, http_request, verify_rest_response

        user = User(username, secrets.token_urlsafe(18))
        admin = MlflowHostCreds(self.uri, username=self.admin.username, password=self.admin.password)
        response = http_request(admin, CREATE_USER, "POST", json={"username": user.username, "password": user.password},
                                max_retries=0, timeout=10)
        verify_rest_response(response, CREATE_USER)
        return user


@pytest.fixture
def mlflow_auth_server(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowAuthServer]:
    """A started basic-auth MLflow server of its own for one test (``create_user`` adds users), stopped afterwards."""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        # The test says who the client is; set first, so that what kedro-mlflow exports is undone afterwards too.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with running_mlflow_server(tmp_path_factory, MlflowAuthServer, "mlflow_auth_server") as server:
        yield server
