"""Generation through the :class:`~train_deploy.serving.batching.Batcher`: each prompt of a request is a job in
the running batch, so concurrent requests share forward passes; the request is one admission in the generate lane.

:func:`start` submits the jobs and returns a queue of :class:`TokenEvent` (text pieces decoded per prompt, as
``LanguageModel.generate_stream`` gives them, with their log-probabilities when asked for, then None at the end)
and a future of the new tokens per prompt. The jobs leave the batch at their deadline (the request's, counted from
arrival), and when the request's ticket is cancelled (its client went away, or every prompt reached a stop
sequence).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from train_deploy.export.runtime import HeldText
from train_deploy.serving.admission import Lane, Ticket
from train_deploy.serving.batching import Batcher, Job, Sampling, TokenLogprob


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One new token of a request's prompt ``sequence``: the text it adds and, when asked for, its log-probability."""

    sequence: int
    token: int
    text: str
    logprob: TokenLogprob | None


def start(batcher: Batcher, lane: Lane, ticket: Ticket, prompt_ids: list[list[int]], max_new_tokens: int,
          sampling: Sampling, tokenizer: Any | None,
          top_logprobs: int | None = None) -> tuple[asyncio.Queue, asyncio.Future, list[Job]]:
    """Admit the request to ``lane`` (raises ``QueueFull``) and submit one job per prompt; ``tokenizer`` None sends
    no text pieces (the caller decodes at the end); ``top_logprobs`` as :meth:`Batcher.submit`."""
    lane.admit()
    jobs = [batcher.submit(ids, max_new_tokens, sampling, ticket.deadline, top_logprobs) for ids in prompt_ids]
    queue: asyncio.Queue = asyncio.Queue()
    pieces = _Pieces(tokenizer, len(jobs), lane)
    future = asyncio.ensure_future(_follow_all(jobs, queue, ticket, pieces))

    def ended(_: asyncio.Future) -> None:
        for job in jobs:
            job.cancel()
        if pieces.running_since is not None:
            lane.finished(time.monotonic() - pieces.running_since)
        lane.release()
        queue.put_nowait(None)

    future.add_done_callback(ended)
    return queue, future, jobs


async def _follow_all(jobs: list[Job], queue: asyncio.Queue, ticket: Ticket, pieces: _Pieces) -> list[int]:
    await asyncio.gather(*(_follow(i, job, jobs, queue, ticket, pieces) for i, job in enumerate(jobs)))
    return [len(job.tokens) for job in jobs]


async def _follow(i: int, job: Job, jobs: list[Job], queue: asyncio.Queue, ticket: Ticket, pieces: _Pieces) -> None:
    """``job``'s tokens as events on ``queue``; a token that leaves a character incomplete comes with the one that
    completes it, or at the end with the text decoding gives (``runtime.HeldText``)."""
    count = 0
    async for token in job.stream():
        logprob = job.logprobs[count] if job.top_logprobs is not None else None
        count += 1
        for event in pieces.add(i, token, functools.partial(TokenEvent, i, token, logprob=logprob)):
            queue.put_nowait(event)
        if ticket.cancelled:
            for each in jobs:
                each.cancel()
    for event in pieces.end(i):
        queue.put_nowait(event)


class _Pieces:
    """Each prompt's token events with the text each token adds to its output (``runtime.HeldText``: a few tokens
    decoded per token, not the whole output); no text without a tokenizer (the caller decodes at the end)."""

    def __init__(self, tokenizer: Any | None, prompts: int, lane: Lane) -> None:
        self.lane = lane
        self.running_since: float | None = None
        """When the request's first token came: from then on it runs in the batch, no longer waits in the lane."""
        self.texts = [HeldText(tokenizer.decode) for _ in range(prompts)] if tokenizer is not None else None

    def add(self, i: int, token: int, event: Callable[[str], TokenEvent]) -> list[TokenEvent]:
        if self.running_since is None:
            self.running_since = time.monotonic()
            self.lane.started()
        return self.texts[i].add(token, event) if self.texts is not None else [event("")]

    def end(self, i: int) -> list[TokenEvent]:
        return self.texts[i].end() if self.texts is not None else []
