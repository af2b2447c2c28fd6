"""A real etcd server (Debian's ``etcd-server``) on 127.0.0.1, on free ports, its data in a temporary folder: the
rendezvous of Paddle's elastic launcher (``--master etcd://HOST:PORT``) in the tests.

Use the :func:`etcd` fixture (a test skips, naming the package, where ``/usr/bin/etcd`` is absent)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.mlflow_server import HOST, free_port
from train_deploy.run_control.processes import stop_process_tree

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
MISSING = "Debian's etcd-server is not installed (apt-get install etcd-server; .ci/run does so as root)"
START_TIMEOUT_S = 30.0
# No proxies: a proxy from the environment must not answer for a server on the loopback interface.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def installed() -> bool:
    """Whether the etcd binary is here."""
    return Path(ETCD).is_file()


@contextmanager
def etcd_server(folder: Path) -> Iterator[str]:
    """An etcd serving clients at the ``etcd://127.0.0.1:PORT`` URL it yields, its data and log in ``folder``;
    stopped (its process tree ended) when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    client, peer = free_port(), free_port()
    log = folder / "etcd.log"
    command = [ETCD, "--name", "test", "--data-dir", str(folder / "data"),
               "--listen-client-urls", f"http://{HOST}:{client}", "--advertise-client-urls", f"http://{HOST}:{client}",
               "--listen-peer-urls", f"http://{HOST}:{peer}", "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
               "--initial-cluster", f"test=http://{HOST}:{peer}", "--log-level", "warn"]
    with log.open("ab") as out:
        process = subprocess.Popen(command, cwd=folder, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(process, f"http://{HOST}:{client}/health", log)
        yield f"etcd://{HOST}:{client}"
    finally:
        stop_process_tree(process, 10.0)


def _wait_ready(process: subprocess.Popen, health: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with _OPENER.open(health, timeout=2) as response:
                if b'"true"' in response.read():
                    return
        except (urllib.error.URLError, OSError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"etcd did not become healthy at {health}:\n{tail}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[str]:
    """An etcd for one test module: its ``etcd://127.0.0.1:PORT`` URL. Its tests share it: each elastic job keeps
    its keys under its own ``launch.job_id``."""
    if not installed():
        pytest.skip(MISSING)
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url
