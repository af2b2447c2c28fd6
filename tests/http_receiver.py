"""An HTTP receiver on 127.0.0.1 for the alert tests: it records every POST (headers, body) and answers ``status``."""

from __future__ import annotations

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
