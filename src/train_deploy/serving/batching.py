"""Batching across requests with iteration-level scheduling, as TGI and vLLM do it.

One decode thread owns the engine. Between two decode steps it drops the sequences that finished, were cancelled
or passed their deadline, prefills the waiting ones (together, left-padded) and joins their caches to the running
batch's (``kv_cache.py``: on ONNX Runtime one buffer per layer that the decode step writes in place), then feeds one
token per running sequence. A sequence's greedy tokens are the ones ``LanguageModel.generate(prompt, temperature=0)``
gives alone: positions count each row's own tokens (``cumsum(mask) - 1``, ``graph.py``) and a row attends over its
own keys only, so the other rows never change a row's logits.

A sequence that outgrows the context shifts it as it does alone (``runtime.py``'s module docstring): it leaves the
batch, its last half context is prefilled and it joins again as a new row would, while the others keep decoding
with their caches. Prefills run in groups of at most :data:`PREFILL_TOKENS`
positions: their logits cover every position (``rows × width × vocabulary`` floats, 70 MiB for 16 rows of 256 at
a vocabulary of 4,500), so a group bounds the memory a burst takes, at the same cost (a prefill is bound by its
arithmetic).

>>> batcher = Batcher(model, max_running=16)
>>> job = batcher.submit([model.eos_id, *ids], 32, Sampling(temperature=0), time.monotonic() + 30)
>>> async for token in job.stream(): ...

The batcher is the only user of ``model``'s engine while it runs (Paddle predictors are not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from train_deploy.export.runtime import (
    LanguageModel,
    greedy_tokens,
    is_greedy,
    log_softmax,
    sample_token,
    shifted_start,
)

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 256
"""The most positions (rows × left-padded width) one prefill pass of the batcher computes (module docstring); a
longer window is prefilled alone. Measured on the default bundle: 16 windows of 128 prefill in 39 ms in groups of
1,024 positions and in 38-41 ms in groups of 256 or one by one, and the burst of docs/benchmarks.md peaks at 1.18x
idle RSS with 256 against 1.25-1.31x with 1,024."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a job picks its tokens (as :meth:`LanguageModel.generate`)."""

    temperature: float = 1.0
    """<= 0: greedy."""
    top_k: int = 50
    """Sample among the ``top_k`` likeliest tokens (0: all)."""
    top_p: float = 1.0
    """... whose probabilities add up to ``top_p``."""
    seed: int | None = 0
    """The job's own generator's seed: the same seed gives ``generate(prompt, seed=seed)``'s tokens."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A new token's natural-log probability under the model (its raw logits, before temperature or top-p) and
    the likeliest tokens' at that step."""

    logprob: float
    top: list[tuple[int, float]]
    """``(token, logprob)`` of the ``top_logprobs`` likeliest tokens, likeliest first."""


class Job:
    """One prompt's sequence in the running batch: its tokens as they are decoded, and why it ended."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, deadline: float,
                 top_logprobs: int | None = None) -> None:
        self.prompt_ids, self.max_new_tokens = prompt_ids, max_new_tokens
        self.sampling, self.deadline, self.top_logprobs = sampling, deadline, top_logprobs
        self.finish_reason: str | None = None
        """``stop`` (eos) | ``length`` | ``cancelled`` | ``deadline`` | ``error``; None while running."""
        self.first_token_s: float | None = None
        """Seconds from submit to the first token."""
        self.tokens: list[int] = []
        """The new tokens so far (eos not included)."""
        self.logprobs: list[TokenLogprob] = []
        """Each new token's log-probability, when asked for (``top_logprobs`` not None); set before the token is
        streamed, so ``logprobs[i]`` is there once ``tokens[i]`` has come."""
        self._submitted = time.monotonic()
        self._rng = np.random.default_rng(sampling.seed)
        self._cancelled = False
        self._lock = threading.Lock()
        self._pending: deque[int] = deque()
        self._done = threading.Event()
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._woken = False  # a wake-up is on its way to the reader, which has not drained since

    def cancel(self) -> None:
        """Leave the batch at the next step; the stream ends with reason ``cancelled``."""
        self._cancelled = True

    async def stream(self) -> AsyncIterator[int]:
        """Token ids as they are decoded (not eos); ends when the job is done."""
        event = asyncio.Event()
        with self._lock:
            self._wake = (asyncio.get_running_loop(), event)
        while True:
            event.clear()
            with self._lock:
                ready, done = list(self._pending), self._done.is_set()
                self._pending.clear()
                self._woken = False
            for token in ready:
                yield token
            if done and not ready:
                return
            if not ready:
                await event.wait()

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block until the job is done (or ``timeout`` seconds pass); its new tokens."""
        self._done.wait(timeout)
        return list(self.tokens)

    def _stop_reason(self, now: float) -> str | None:
        """Why the job leaves before its next step (None: it stays)."""
        return "cancelled" if self._cancelled else "deadline" if now >= self.deadline else None

    @property
    def greedy(self) -> bool:
        return is_greedy(self.sampling.temperature, self.sampling.top_k)

    def _pick(self, logits: np.ndarray) -> int:
        s = self.sampling
        return sample_token(logits, s.temperature, s.top_k, self._rng, s.top_p)

    def _record(self, token: int, logits: np.ndarray) -> None:
        """``token``'s log-probability and the ``top_logprobs`` likeliest tokens' under ``logits``."""
        if self.top_logprobs is None:
            return
        logprobs, k = log_softmax(logits.astype(np.float64)), min(self.top_logprobs, len(logits))
        top = np.argpartition(-logprobs, k - 1)[:k] if k else np.zeros(0, np.int64)
        top = top[np.argsort(-logprobs[top], kind="stable")]
        self.logprobs.append(TokenLogprob(float(logprobs[token]), [(int(t), float(logprobs[t])) for t in top]))

    def _push(self, token: int) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self._submitted
        self.tokens.append(token)
        with self._lock:
            self._pending.append(token)
        self._notify()

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._done.set()
            self._notify()

    def _notify(self) -> None:
        """Wake the reader's loop, once until it drains: a reader that falls behind takes the tokens decoded
        meanwhile in one wake-up, not one wake-up (a write to the loop's pipe) each."""
        with self._lock:
            wake = None if self._woken else self._wake
            self._woken = wake is not None
        if wake is not None:
            try:
                wake[0].call_soon_threadsafe(wake[1].set)
            except RuntimeError:  # the reader's loop is closed: it went away
                pass


class _Batch:
    """The running rows: their jobs, the token each feeds next, and their key/value cache (``kv_cache.py``)."""

    def __init__(self, cache: Any) -> None:
        self.jobs: list[Job] = []
        self.next_ids: list[int] = []
        self.cache = cache
        self.shifting: list[Job] = []
        """Jobs out of the rows until their shifted context is prefilled (module docstring)."""

    @property
    def running(self) -> list[Job]:
        return [*self.jobs, *self.shifting]

    def leave_full(self, context: int) -> None:
        """Move the rows whose next token would outgrow ``context`` to :attr:`shifting`."""
        full = self.cache.lengths + 1 > context
        if full.any():
            self.shifting = [job for job, out in zip(self.jobs, full, strict=True) if out]
            self.keep([row for row, out in enumerate(full) if not out])

    def keep(self, rows: list[int]) -> None:
        """Only ``rows``, in their order."""
        if len(rows) != len(self.jobs):
            self.jobs, self.next_ids = [self.jobs[r] for r in rows], [self.next_ids[r] for r in rows]
            self.cache.keep(rows)

    def join(self, jobs: list[Job], next_ids: list[int], mask: np.ndarray, step: Any, rows: list[int]) -> None:
        """Add ``rows`` of a prefill (its mask and step) as the rows of ``jobs``."""
        self.cache.join(mask, step, rows)
        self.jobs, self.next_ids = self.jobs + jobs, self.next_ids + next_ids


class Batcher:
    """One decode thread over ``model``; sequences join and leave between decode steps (module docstring).
    ``on_step(batch size)`` is called after every decode step with the number of sequences it ran (metrics)."""

    def __init__(self, model: LanguageModel, max_running: int = 16,
                 on_step: Callable[[int], None] | None = None) -> None:
        self._model, self._max_running, self._on_step = model, max_running, on_step
        self._waiting: deque[Job] = deque()
        self._batch = _Batch(model._form.new_cache())
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, deadline: float,
               top_logprobs: int | None = None) -> Job:
        """Queue ``prompt_ids`` (``[eos_id, *ids]`` fitted to the context, as LanguageModel builds them) to be
        decoded up to ``max_new_tokens`` tokens until ``deadline`` (``time.monotonic()``); with ``top_logprobs``
        (0 or more), each token's log-probability and the likeliest ones' are kept in :attr:`Job.logprobs`."""
        job = Job(list(prompt_ids), max_new_tokens, sampling, deadline, top_logprobs)
        with self._wake:
            if self._closed:
                job._finish("cancelled")
                return job
            self._waiting.append(job)
            self._wake.notify()
        return job

    @property
    def running(self) -> int:
        return len(self._batch.running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Stop the thread; every job not done ends as ``cancelled``."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for job in [*self._batch.running, *self._waiting]:
            job._finish("cancelled")

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._batch.running:
                    self._wake.wait()
                if self._closed:
                    return
                admitted = self._admit()
            try:
                self._iterate(admitted)
            except Exception:  # one failed pass ends its jobs, never the thread
                failed = list(dict.fromkeys([*self._batch.running, *admitted]))  # admitted ones may have joined
                logger.exception("Batched generation failed; its %d sequences end with an error", len(failed))
                for job in failed:
                    job._finish("error")
                self._batch = _Batch(self._model._form.new_cache())

    def _admit(self) -> list[Job]:
        """Waiting jobs that fit in the batch now; waiting ones cancelled or past their deadline end, whether or
        not there is room."""
        admitted: list[Job] = []
        now = time.monotonic()
        for job in [job for job in self._waiting if job._stop_reason(now)]:
            self._waiting.remove(job)
            job._finish(job._stop_reason(now) or "cancelled")
        while self._waiting and len(self._batch.running) + len(admitted) < self._max_running:
            job = self._waiting.popleft()
            reason = job._stop_reason(now)
            if reason or job.max_new_tokens <= 0:
                job._finish(reason or "length")
            else:
                admitted.append(job)
        return admitted

    def _iterate(self, admitted: list[Job]) -> None:
        """Drop the rows that must leave, prefill and join ``admitted``, then one step: a decode of the cached rows
        and a prefill of those that shift their context (module docstring)."""
        now = time.monotonic()
        batch = self._batch
        stay = []
        for row, job in enumerate(batch.jobs):
            reason = job._stop_reason(now)
            if reason:
                job._finish(reason)
            else:
                stay.append(row)
        batch.keep(stay)
        if admitted:
            self._prefill(admitted, [job.prompt_ids for job in admitted])
        size = len(batch.jobs)
        if size:
            batch.leave_full(self._model.context)
            if batch.jobs:
                self._decode()
            if batch.shifting:  # they stay in batch.running until joined again, for a failure to end them too
                self._prefill(batch.shifting, [self._shift(job) for job in batch.shifting])
                batch.shifting = []
            if self._on_step is not None:
                self._on_step(size)

    def _shift(self, job: Job) -> list[int]:
        """``job``'s window after the context shift (module docstring): its last half context."""
        sequence = job.prompt_ids + job.tokens
        return sequence[shifted_start(len(sequence), self._model.context):]

    def _prefill(self, jobs: list[Job], windows: list[list[int]]) -> None:
        """Prefill ``jobs``' ``windows`` (in groups, module docstring) and join the rows that go on to the batch."""
        for group in _groups([len(window) for window in windows]):
            mask, step = self._model._prefill([windows[i] for i in group])
            picked = self._picks([jobs[i] for i in group], step.logits)
            rows = [row for row, token in enumerate(picked) if token is not None]
            if rows:
                self._batch.join([jobs[group[r]] for r in rows], [picked[r] for r in rows],  # type: ignore[misc]
                                 mask, step, rows)

    def _decode(self) -> None:
        """One token per cached row, its cache grown by it."""
        batch = self._batch
        ids = np.asarray([[token] for token in batch.next_ids], dtype=np.int64)
        picked = self._picks(batch.jobs, batch.cache.decode(ids))
        batch.next_ids = [token if token is not None else 0 for token in picked]
        batch.keep([row for row, token in enumerate(picked) if token is not None])

    def _picks(self, jobs: list[Job], logits: np.ndarray) -> list[int | None]:
        """Each job's next token from its last logits, pushed to its stream; None where the job ends here."""
        picked: list[int | None] = []
        last = logits[:, -1]
        greedy = greedy_tokens(last)  # every row's at once; a sampled row draws from its own below
        for row, job in enumerate(jobs):
            token = int(greedy[row]) if job.greedy else job._pick(last[row].astype(np.float64))
            if token == self._model.eos_id:
                job._finish("stop")
                picked.append(None)
                continue
            job._record(token, last[row])
            job._push(token)
            if len(job.tokens) >= job.max_new_tokens:
                job._finish("length")
                picked.append(None)
            else:
                picked.append(token)
        return picked


def _groups(lengths: list[int]) -> list[list[int]]:
    """Indexes of ``lengths`` in order, grouped so that each group's rows × longest length stays within
    :data:`PREFILL_TOKENS` (a longer row alone)."""
    groups: list[list[int]] = []
    for i, length in enumerate(lengths):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * max(length, *(lengths[j] for j in group)) <= PREFILL_TOKENS:
            group.append(i)
        else:
            groups.append([i])
    return groups
