"""Admission control: each lane (``score``, ``generate``) has its own workers and a bounded queue.

A request is timed from its arrival (:class:`Ticket`), not from when a worker picks it up. A lane admits at most
``workers + queue`` requests; one more is refused at once (:class:`QueueFull`: HTTP 429 with ``Retry-After``),
never queued. Each lane runs its work on its own threads (generation on the engine the host runs best: the
batcher's, ``batched.py``, admitted here all the same), so scoring never waits behind generation and no lane
shares asyncio's default pool with the other. A request whose deadline passes, or whose client goes away, is
cancelled where it stands: still queued, it is dropped when a worker reaches it; running, the work sees
:meth:`Ticket.stopped` between steps (after every generated token) and ends.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The lane holds as many requests as it may; ``retry_after`` is the whole seconds to wait."""

    def __init__(self, lane: str, waiting: int, retry_after: int) -> None:
        super().__init__(f"{lane}: the queue is full ({waiting} requests waiting); retry after {retry_after} s")
        self.lane, self.waiting, self.retry_after = lane, waiting, retry_after


class Expired(Exception):
    """The request's deadline passed before a worker could start it (``waited``: seconds since its arrival)."""


class Cancelled(Exception):
    """The request was cancelled (its client went away) before or while it ran."""


class Ticket:
    """One request's clock and cancellation: ``deadline`` is ``arrival`` plus the time budget
    (``time.monotonic()``)."""

    def __init__(self, arrival: float, budget_s: float) -> None:
        self.arrival, self.deadline = arrival, arrival + budget_s
        self._cancelled = threading.Event()
        self.reason: str | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request's work at its next step (``reason``: ``cancelled`` or ``deadline``)."""
        if not self._cancelled.is_set():
            self.reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def stopped(self) -> bool:
        """Whether the work should end now: cancelled, or past the deadline."""
        return self._cancelled.is_set() or time.monotonic() >= self.deadline

    def left(self) -> float:
        """Seconds until the deadline (0 once past)."""
        return max(self.deadline - time.monotonic(), 0.0)


class Lane:
    """``workers`` threads for one task and room for ``queue`` more requests waiting; ``on_depth(lane, waiting)``
    is told the number waiting whenever it changes (the metrics' queue-depth gauge)."""

    def __init__(self, name: str, workers: int, queue: int,
                 on_depth: Callable[[str, int], None] | None = None) -> None:
        if workers < 1 or queue < 0:
            raise ValueError(f"lane {name}: workers {workers} must be at least 1 and queue {queue} not negative")
        self.name, self.workers, self.queue = name, workers, queue
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"lane-{name}")
        self._on_depth = on_depth
        self._lock = threading.Lock()
        self._admitted = self._running = 0
        self._service_s = 1.0  # a running mean of how long one request holds a worker, for Retry-After

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._admitted - self._running

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    def retry_after(self) -> int:
        """Whole seconds until a place is likely free: the waiting requests' expected service, at least 1."""
        return max(1, math.ceil(self._service_s * (self.waiting + 1) / self.workers))

    def admit(self) -> None:
        """Count one more request in this lane; raises :class:`QueueFull` when it holds ``workers + queue``. Each
        admission is ended by :meth:`release` once."""
        with self._lock:
            full = self._admitted >= self.workers + self.queue
            if not full:
                self._admitted += 1
        if full:
            raise QueueFull(self.name, self.waiting, self.retry_after())
        self._report()

    def release(self) -> None:
        with self._lock:
            self._admitted -= 1
        self._report()

    def started(self) -> None:
        """One admitted request now holds a worker (it no longer counts as waiting)."""
        with self._lock:
            self._running += 1
        self._report()

    def finished(self, seconds: float) -> None:
        with self._lock:
            self._running -= 1
            self._service_s = 0.8 * self._service_s + 0.2 * seconds
        self._report()

    def submit(self, ticket: Ticket, work: Callable[[Ticket], T]) -> asyncio.Future[T]:
        """Admit the request and run ``work(ticket)`` on one of the lane's threads; the future raises
        :class:`Expired` or :class:`Cancelled` for a request whose deadline passed or whose client left while it
        waited. Raises :class:`QueueFull` at once when the lane is full."""
        self.admit()
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._run, ticket, work)
        except BaseException:
            self.release()
            raise
        future.add_done_callback(lambda _: self.release())
        return future

    def _run(self, ticket: Ticket, work: Callable[[Ticket], T]) -> T:
        if ticket.cancelled:
            raise Cancelled
        if ticket.expired():
            raise Expired
        self.started()
        start = time.monotonic()
        try:
            return work(ticket)
        finally:
            self.finished(time.monotonic() - start)

    def _report(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self.name, self.waiting)

    def close(self) -> None:
        """Stop taking work; requests still queued are dropped (their tickets are cancelled by their handlers)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
