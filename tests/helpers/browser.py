"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol on its remote-debugging port, with
the ``websockets`` client: open a page, type, click, read the page and take a screenshot, as a user would."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

from train_deploy.run_control.processes import stop_process_tree

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MISSING = "Debian's chromium is not installed (apt-get install chromium; .ci/run does so as root)"
START_TIMEOUT_S = 60.0
VIEWPORT = (1000, 800)
"""The page's size in CSS pixels, and so the screenshot's."""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def installed() -> bool:
    """Whether the chromium binary is here."""
    return Path(CHROMIUM).is_file()


class Page:
    """One browser tab over its DevTools web socket."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket, self._next_id = socket, 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events in between are dropped)."""
        self._next_id += 1
        self.socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str) -> Any:
        """The value of the JavaScript ``expression`` in the page (awaited if a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30.0) -> None:
        """Navigate to ``url`` and return once the document has loaded."""
        self.call("Page.navigate", url=url)
        self.wait_until("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def wait_until(self, expression: str, timeout: float = 30.0) -> Any:
        """The first truthy value of ``expression``, polled every 20 ms; raise after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {timeout} s: {expression}")
            time.sleep(0.02)
        return value

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element at ``selector`` and type ``text`` as keyboard input."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        """Press and release the mouse at the middle of the element at ``selector``."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def text(self, selector: str) -> str:
        """The text content of the element at ``selector``."""
        return self.evaluate(f"document.querySelector({json.dumps(selector)}).textContent")

    def screenshot(self) -> bytes:
        """The visible page as a PNG."""
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])


@contextmanager
def chromium(folder: Path) -> Iterator[Page]:
    """Headless Chromium with its profile in ``folder`` (no network beyond what the page asks of 127.0.0.1) and
    one blank tab; the browser's process tree is ended when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
               "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
               "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
               f"--user-data-dir={folder / 'profile'}", "about:blank"]
    if os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run as root inside its sandbox
    log = folder / "chromium.log"
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        with connect(_page_socket(process, folder / "profile", log), max_size=2**26, proxy=None) as socket:
            page = Page(socket)
            page.call("Page.enable")
            page.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1],
                      deviceScaleFactor=1, mobile=False)
            yield page
    finally:
        stop_process_tree(process, 5.0)


def _page_socket(process: subprocess.Popen, profile: Path, log: Path) -> str:
    """The DevTools web socket of the browser's first tab (its port from ``DevToolsActivePort``)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError, ValueError, IndexError):
            port = int((profile / "DevToolsActivePort").read_text().split()[0])
            with _OPENER.open(f"http://127.0.0.1:{port}/json/list", timeout=2) as answer:
                pages = [t for t in json.loads(answer.read()) if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"chromium did not open its DevTools port:\n{tail}")
        time.sleep(0.1)
