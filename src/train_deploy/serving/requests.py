"""What the server reads from a request before any model code sees it: the headers (once, the same way for every
route), the body (within a byte limit and a read deadline) and its JSON (within a nesting depth).

Each refusal is a :class:`HttpRefusal`: a status and one line that names what to change, never quoting the request.
Only JSON is read (:data:`ACCEPTED_TYPES`); any other type, parquet and CSV included, is a 415 before a byte of the
body is read, so a small compressed body can never unfold into gigabytes. Nothing is decompressed: a
``Content-Encoding`` other than ``identity`` is a 415 too, so the byte limit is a limit on the decoded request.
The server holds at most :data:`BODY_BUDGET_BYTES` of large bodies at once (:class:`BodyBudget`): a large body
beyond it is read and dropped, then answered 429, so a hundred stalled 1.6 MB bodies hold 16 MiB, not 150.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

ACCEPTED_TYPES = ("application/json",)
"""The media types a body may have (``Content-Type``, parameters aside; only ``charset=utf-8`` is accepted)."""
SINGLE_HEADERS = (b"content-type", b"content-length", b"content-encoding", b"transfer-encoding")
"""Headers a request may send once: two of them (which one wins?) is a 400."""
MAX_DEPTH = 32
"""The deepest nesting of arrays and objects a JSON body may have (the request formats need 4)."""
BODY_BUDGET_BYTES = 16 * 2**20
"""The bytes of large bodies the server holds at once while it reads and parses them (at least one body within
the limits). Issue 38's goal is a peak RSS within 1.2x of idle under attack; idle is about 260 MiB here."""
SMALL_BODY_BYTES = 65536
"""A body declared this small needs no share of the budget: uvicorn buffers as much for every connection anyway
before it stops reading the socket."""
DRAIN_BYTES = 2**30
"""A body over the limit is read on (and dropped, never held) up to this much more, within the read deadline, so
that a client that sends its whole body before reading the answer gets the refusal, not a reset connection."""

Receive = Callable[[], Awaitable[dict[str, Any]]]
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class HttpRefusal(Exception):
    """A request refused before the model: HTTP ``status`` and a one-line ``message`` (``param``: the field it
    names, for OpenAI's error shape); ``close`` asks the server to close the connection after the answer."""

    def __init__(self, status: int, message: str, *, param: str | None = None, close: bool = False,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.close, self.retry_after = status, message, param, close, \
            retry_after


class ClientGone(Exception):
    """The client disconnected before its request was read or answered: there is no one to answer."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    """The headers every route reads, parsed once from the ASGI scope."""

    media_type: str | None
    charset: str | None
    content_length: int | None
    content_encoding: str | None

    @classmethod
    def of(cls, scope: dict[str, Any]) -> RequestHead:
        """The request's head; raises :class:`HttpRefusal` 400 for a header sent twice or a bad length."""
        seen: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or []:
            name = name.lower()
            if name in SINGLE_HEADERS and name in seen:
                raise HttpRefusal(400, f"request: {name.decode()} sent more than once; send it once", close=True)
            seen[name] = value
        media_type, charset = _content_type(seen.get(b"content-type"))
        length = seen.get(b"content-length")
        if length is not None and not length.strip().isdigit():
            raise HttpRefusal(400, "request: content-length is not a number of bytes", close=True)
        encoding = seen.get(b"content-encoding")
        return cls(media_type, charset, int(length) if length is not None else None,
                   encoding.decode("latin-1").strip().lower() if encoding is not None else None)

    def require_json(self) -> None:
        """Raise :class:`HttpRefusal` 415 unless the body is declared as uncompressed UTF-8 JSON."""
        if self.media_type not in ACCEPTED_TYPES:
            shown = "none" if self.media_type is None else repr(self.media_type[:60])
            raise HttpRefusal(415, f"request: content-type {shown} is not accepted; send {ACCEPTED_TYPES[0]}",
                              close=True)
        if self.charset not in (None, "utf-8", "utf8"):
            raise HttpRefusal(415, f"request: charset {self.charset[:20]!r} is not accepted; send UTF-8", close=True)
        if self.content_encoding not in (None, "identity"):
            raise HttpRefusal(415, f"request: content-encoding {self.content_encoding[:20]!r} is not accepted; send "
                                   "the body uncompressed", close=True)


def _content_type(value: bytes | None) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    media_type, *parameters = value.decode("latin-1").split(";")
    charset = None
    for parameter in parameters:
        key, _, found = parameter.partition("=")
        if key.strip().lower() == "charset":
            charset = found.strip().strip('"').lower()
    return media_type.strip().lower() or None, charset


class BodyBudget:
    """The bytes of large bodies held at once, at most ``most`` (one event loop: no lock)."""

    def __init__(self, most: int) -> None:
        self.most, self.held = most, 0

    def take(self, declared: int | None, largest: int) -> int | None:
        """The share a body of ``declared`` bytes (None: chunked, up to ``largest``) holds: 0 for a small one; None
        when it does not fit now. Give it back with :meth:`give`."""
        if declared is not None and declared <= SMALL_BODY_BYTES:
            return 0
        share = min(largest, declared if declared is not None else largest)
        if self.held + share > self.most:
            return None
        self.held += share
        return share

    def give(self, share: int) -> None:
        self.held -= share


async def read_body(receive: Receive, most: int, deadline: float, too_large: str, hold: bool = True) -> bytes:
    """The whole body, read by ``deadline`` (``time.monotonic()``); raises :class:`HttpRefusal` 400 with
    ``too_large`` for a body over ``most`` bytes (read on and dropped up to :data:`DRAIN_BYTES`), 408 when it does
    not arrive in time, :class:`ClientGone` when the client leaves. ``hold`` False reads it all and drops it
    (returns no bytes), so that the refusal that follows reaches the client."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        left = deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
        except TimeoutError:
            raise HttpRefusal(408, f"request: the body did not arrive within the read deadline ({size} bytes came); "
                                   "send it at once", close=True) from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size <= most and hold:
            chunks.append(chunk)
        elif size > most + DRAIN_BYTES:
            break
        else:
            chunks.clear()
    if size > most:
        raise HttpRefusal(400, too_large, close=True)
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """``body`` as JSON; raises :class:`HttpRefusal` 400 for one that is not UTF-8, not JSON, or nested deeper
    than :data:`MAX_DEPTH` (checked before it is parsed: 200,000 ``[`` cost a scan, not a recursion)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HttpRefusal(400, f"request: not UTF-8 (byte {exc.start})") from None
    depth = nesting_depth(body)
    if depth > MAX_DEPTH:
        raise HttpRefusal(400, f"request: JSON nested {depth} levels deep, deeper than {MAX_DEPTH}; send the "
                               "request formats as documented")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise HttpRefusal(400, f"request: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # not reached after the depth check; kept so that no body can make a 500
        raise HttpRefusal(400, f"request: JSON nested deeper than {MAX_DEPTH}") from None


def nesting_depth(body: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in ``body`` outside its strings (an unbalanced body counts as far as it
    goes)."""
    depth = deepest = 0
    stripped = _STRINGS.sub(b'""', body) if b'"' in body else body
    for chunk in re.finditer(rb"[\[{]+|[\]}]+", stripped):
        run = chunk.group()
        if run[0] in b"[{":
            depth += len(run)
            deepest = max(deepest, depth)
        else:
            depth -= len(run)
    return deepest
