"""An HTTP receiver on 127.0.0.1 for the alert tests: it records every POST (headers, body) and answers ``status``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """A threaded HTTP server on a free port of 127.0.0.1; :meth:`close` stops it."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.status, self.delay, self.received = status, delay, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((dict(self.headers), body))
                time.sleep(receiver.delay)
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/T0KEN-secret-path"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def wait_for(self, count: int, timeout: float) -> list[tuple[dict[str, str], bytes]]:
        """The first ``count`` POSTs, once received (raises after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.received)} of {count} POSTs arrived within {timeout:.0f} s")
            time.sleep(0.1)
        return self.received[:count]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StallingReceiver:
    """A receiver on 127.0.0.1 that never finishes an answer: ``trickle`` sends ``HTTP/1.1 200 OK\\r\\nX-Slow: ``
    and then one byte every 1.5 s (each socket read gets something, so no read times out); ``silent`` accepts,
    reads the request and says nothing. ``connections`` counts the connections accepted."""

    def __init__(self, mode: str) -> None:
        assert mode in ("trickle", "silent")
        self.mode, self.connections = mode, 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/hooks/T0KEN-secret-path"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._stall, args=(connection,), daemon=True).start()

    def _stall(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(1.0)
            with contextlib.suppress(OSError):
                connection.recv(65536)
            if self.mode == "trickle":
                with contextlib.suppress(OSError):
                    connection.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not self._closed.wait(1.5):
                if self.mode == "trickle":
                    try:
                        connection.sendall(b"x")
                    except OSError:
                        return

    def close(self) -> None:
        self._closed.set()
        self._server.close()
