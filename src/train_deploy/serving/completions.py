"""OpenAI's ``POST /v1/completions`` request and answer shapes, and the stop sequences that end a text.

The request is checked field by field against the model's limits: ``prompt`` (a string or a list of at most
``max_batch`` strings of at most ``max_chars`` characters), ``max_tokens`` (16, as OpenAI; at most the model's
``max_new_tokens``), ``temperature`` (1), ``top_p`` (1), ``seed`` (0), ``stop`` (a string or up to 4), ``stream``,
``n`` (1 only), ``logprobs`` (0 to 5) and ``model`` (the served model's name). Sampling is over the whole
vocabulary (no top-k: the API has none). An unknown field, or a known one this server does not implement set to
anything but its default, is a 400 naming it, as the API does, so a misspelling is never dropped.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from train_deploy.serving.batching import TokenLogprob
from train_deploy.serving.requests import HttpRefusal

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""
MAX_STOPS = 4
MAX_LOGPROBS = 5
"""How many of the likeliest tokens ``logprobs`` may ask for at each step (OpenAI's limit for completions)."""
IGNORED = {"user": None, "stream_options": None, "echo": False, "best_of": 1, "frequency_penalty": 0,
           "presence_penalty": 0, "logit_bias": None, "suffix": None}
"""Fields OpenAI defines that are accepted at these values only (``user`` and ``stream_options`` at any)."""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A checked ``/v1/completions`` request."""

    prompts: list[str]
    single: bool
    """Whether ``prompt`` was one string (else a list)."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """How many of the likeliest tokens to return with each new token's log-probability (None: no logprobs)."""

    def settings(self) -> dict[str, Any]:
        """The model's generation parameters (``registry.model.PARAMS``) for this request."""
        return {"task": "generate", "max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_k": 0,
                "top_p": self.top_p, "seed": self.seed, "backend": "auto", "int8": False}


def parse_completion(body: Any, model_name: str, max_batch: int, max_chars: int,
                     max_new_tokens: int) -> CompletionRequest:
    """The request in ``body`` (parsed JSON), checked; raises :class:`HttpRefusal` (400, or 404 for another
    model) naming the field."""
    if not isinstance(body, dict):
        raise HttpRefusal(400, "request: expected a JSON object")
    known = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n", "logprobs",
             *IGNORED}
    unknown = sorted(str(name)[:40] for name in body if name not in known)
    if unknown:
        raise HttpRefusal(400, f"unknown field {unknown[0]}; see the API reference for /v1/completions",
                          param=unknown[0])
    if body.get("model") != model_name:
        raise HttpRefusal(404, f"model: not served here; this server serves {model_name} (GET /v1/models)",
                          param="model")
    for name, default in IGNORED.items():
        if default is not None:
            if body.get(name, default) not in (default, None):
                raise HttpRefusal(400, f"{name}: not supported by this server; leave it out", param=name)
    if body.get("n", 1) != 1:
        raise HttpRefusal(400, "n: only 1 completion per prompt is supported", param="n")
    prompts, single = _prompts(body.get("prompt"), max_batch, max_chars)
    options = body.get("stream_options") or {}
    return CompletionRequest(
        prompts, single, max_tokens=_integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 0, max_new_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_top_p(body),
        seed=_integer(body, "seed", 0, 0, 2**63 - 1), stop=_stops(body.get("stop")), stream=_flag(body, "stream"),
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        logprobs=None if body.get("logprobs") is None else _integer(body, "logprobs", 0, 0, MAX_LOGPROBS))


def _prompts(prompt: Any, max_batch: int, max_chars: int) -> tuple[list[str], bool]:
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, list) or not prompts:
        raise HttpRefusal(400, "prompt: expected a string or a list of strings", param="prompt")
    if len(prompts) > max_batch:
        raise HttpRefusal(400, f"prompt: {len(prompts)} prompts exceed max_batch {max_batch}; send at most "
                               f"{max_batch}", param="prompt")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise HttpRefusal(400, f"prompt {i}: a {type(text).__name__}, not a string (token ids are not accepted)",
                              param="prompt")
        if len(text) > max_chars:
            raise HttpRefusal(400, f"prompt {i}: {len(text)} characters exceed the limit of {max_chars} (max_chars); "
                                   "send a shorter prompt", param="prompt")
    return prompts, single


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise HttpRefusal(400, f"{name}: expected an integer", param=name)
    if not low <= value <= high:
        raise HttpRefusal(400, f"{name}: {value} is outside {low} to {high}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise HttpRefusal(400, f"{name}: expected a finite number", param=name)
    if not low <= value <= high:
        raise HttpRefusal(400, f"{name}: {value} is outside {low:g} to {high:g}", param=name)
    return float(value)


def _top_p(body: dict[str, Any]) -> float:
    value = _number(body, "top_p", 1.0, 0.0, 1.0)
    if value == 0:
        raise HttpRefusal(400, "top_p: 0 is outside (0, 1]", param="top_p")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise HttpRefusal(400, f"{name}: expected true or false", param=name)
    return bool(value)


def _stops(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise HttpRefusal(400, f"stop: expected a string or a list of up to {MAX_STOPS} non-empty strings",
                          param="stop")
    return stops


class StopText:
    """One sequence's text as it grows, cut at the first stop sequence; :meth:`add` returns what may be sent
    now (a tail that could begin a stop sequence is held back until it cannot)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False

    def add(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        ends = [found for stop in self.stops if (found := self.text.find(stop, max(self.sent - len(stop), 0))) >= 0]
        if ends:
            self.stopped, self.text = True, self.text[:min(ends)]
            return self._release(len(self.text))
        held = next((k for k in range(min(len(self.text), max(map(len, self.stops), default=1) - 1), 0, -1)
                     if any(stop.startswith(self.text[-k:]) for stop in self.stops)), 0)
        return self._release(len(self.text) - held)

    def flush(self) -> str:
        """The held-back tail, at the end of the sequence."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


class Logprobs:
    """One sequence's new tokens with their log-probabilities, in OpenAI's ``logprobs`` shape: ``tokens`` (the text
    each token adds, so they join to the text: a token that leaves a character incomplete adds ``""`` and the one
    that completes it the whole character), ``token_logprobs``, ``top_logprobs`` (the chosen token's under its text
    in ``tokens``, and the likeliest tokens' texts, each decoded alone, the likelier one where two decode alike: up to
    ``logprobs`` + 1 entries) and ``text_offset`` (each token's first character in the completion's text).
    Log-probabilities are the model's own (its raw logits), whatever the temperature and top-p."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.entries: list[tuple[str, float, dict[str, float], int]] = []
        self.length = self.taken = 0

    def add(self, token: int, piece: str, logprob: TokenLogprob) -> None:
        top = {piece: logprob.logprob}
        for each, value in logprob.top:  # two tokens that decode alike: the likelier one's figure
            if each != token:
                top.setdefault(self.decode([each]), value)
        self.entries.append((piece, logprob.logprob, top, self.length))
        self.length += len(piece)

    def release(self, upto: int) -> dict[str, list[Any]]:
        """The tokens not yet released that lie wholly within the first ``upto`` characters of the text."""
        end = self.taken
        while end < len(self.entries) and self.entries[end][3] + len(self.entries[end][0]) <= upto:
            end += 1
        return self._take(end)

    def rest(self, limit: int | None) -> dict[str, list[Any]]:
        """The tokens not yet released that begin within the first ``limit`` characters (None: all of them)."""
        end = self.taken
        while end < len(self.entries) and (limit is None or self.entries[end][3] < limit):
            end += 1
        return self._take(end)

    def _take(self, end: int) -> dict[str, list[Any]]:
        entries, self.taken = self.entries[self.taken:end], max(self.taken, end)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def completion(ident: str, model: str, texts: list[str], reasons: list[str], usage: dict[str, int],
               logprobs: list[dict[str, list[Any]]] | None = None) -> dict[str, Any]:
    """A non-streamed answer (``logprobs``: one per text, :meth:`Logprobs.rest`)."""
    choices = [{"text": text, "index": i, "logprobs": logprobs[i] if logprobs else None, "finish_reason": reason}
               for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))]
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def chunk(ident: str, model: str, index: int, text: str, reason: str | None,
          logprobs: dict[str, list[Any]] | None = None) -> bytes:
    """One server-sent event of a streamed answer (``logprobs``: those of the tokens whose text it carries)."""
    return event({"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
                  "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": reason}]})


def usage_chunk(ident: str, model: str, usage: dict[str, int]) -> bytes:
    return event({"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
                  "choices": [], "usage": usage})


def event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
