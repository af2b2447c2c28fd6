"""A real Prometheus server (Debian's ``prometheus``) on 127.0.0.1, scraping one target every second, with its
configuration and storage in a temporary folder, and queries through its HTTP API (``/api/v1/query``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.mlflow_server import HOST, free_port
from train_deploy.run_control.processes import stop_process_tree

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MISSING = "Debian's prometheus is not installed (apt-get install prometheus; .ci/run does so as root)"
START_TIMEOUT_S = 60.0
CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: train_deploy
    metrics_path: {path}
    static_configs:
      - targets: ["{target}"]
"""
# No proxies: a proxy from the environment must not answer for a server on the loopback interface.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def installed() -> bool:
    """Whether the prometheus binary is here."""
    return Path(PROMETHEUS).is_file()


class Prometheus:
    """A started Prometheus at ``url``."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant vector ``expression`` evaluates to now (each item's ``metric`` labels and ``value``)."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
        with _OPENER.open(address, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, expression: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The first non-empty answer to ``expression`` (scrapes come every second); raise after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not (result := self.query(expression)):
            if time.monotonic() > deadline:
                targets = _get(f"{self.url}/api/v1/targets")
                raise AssertionError(f"{expression}: no samples after {timeout} s; targets: {targets[:2000]}")
            time.sleep(0.25)
        return result


@contextmanager
def scraping(target: str, folder: Path, path: str = "/metrics") -> Iterator[Prometheus]:
    """Prometheus scraping ``target`` (``host:port``) at ``path`` every second, its configuration, storage and log
    in ``folder``; stopped (and its process tree ended) when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(CONFIG.format(path=path, target=target))
    url, log = f"http://{HOST}:{free_port()}", folder / "prometheus.log"
    command = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
               f"--web.listen-address={url.split('//')[1]}", "--log.level=warn"]
    with log.open("ab") as out:
        process = subprocess.Popen(command, cwd=folder, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(process, url, log)
        yield Prometheus(url, log)
    finally:
        stop_process_tree(process, 10.0)


def _wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while _get(f"{url}/-/ready") is None:
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"prometheus did not become ready at {url}:\n{tail}")
        time.sleep(0.2)


def _get(address: str) -> str | None:
    try:
        with _OPENER.open(address, timeout=2) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
