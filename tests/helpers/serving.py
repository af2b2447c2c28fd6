"""The server of ``train_deploy.serving`` in its own process, as ``train-deploy serve`` runs it (uvicorn with the
logged model's own code first on ``sys.path``), and raw HTTP for requests no client library would send."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import mlflow

from tests.helpers.registry import ModelServer, ModelStore


def downloaded(store: ModelStore, model_uri: str, folder: Path) -> Path:
    """The logged model ``model_uri`` of ``store`` downloaded into ``folder`` (its model folder)."""
    with store.active():
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(folder)))


class AppServer(ModelServer):
    """uvicorn running ``train_deploy.serving.app:create_app`` for the downloaded ``model`` on 127.0.0.1, started
    in the empty ``folder``; ``env`` adds to its environment (the admission settings)."""

    def __init__(self, model: Path, store: ModelStore, folder: Path, env: dict[str, str] | None = None) -> None:
        super().__init__("unused", store, folder)
        self.command = [str(Path(sys.executable).parent / "uvicorn"), "--factory", "--app-dir", str(model / "code"),
                        "--host", self.host, "--port", str(self.port), "--log-level", "info",
                        "train_deploy.serving.app:create_app"]
        self._env = {**self._env, "TRAIN_DEPLOY_SERVED_MODEL": str(model), "TRAIN_DEPLOY_SERVED_NAME":
                     "train_deploy_lm", "TRAIN_DEPLOY_SERVED_VERSION": "1", **(env or {})}

    @property
    def host(self) -> str:
        return self.url.split("//")[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def raw_request(server: AppServer, head: str, body: bytes = b"", timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Send ``head`` (the request line and headers, without the blank line) and ``body`` as they are; return the
    status, the headers (lower-case names) and the body of the answer."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := _recv(sock):
            data += chunk
    return parse_answer(data)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def parse_answer(data: bytes) -> tuple[int, dict, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def post(server: AppServer, path: str, body: Any, timeout: float = 60.0) -> tuple[int, dict, Any]:
    """POST ``body`` as JSON; the status, headers and decoded answer."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\nHost: {server.host}\nContent-Type: application/json\n"
            f"Content-Length: {len(payload)}\nConnection: close")
    status, headers, answer = raw_request(server, head, payload, timeout)
    return status, headers, json.loads(answer) if answer else None


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - started
