"""Load an exported bundle and use it: ``score(texts)`` and ``generate(prompt, …)``.

>>> from train_deploy.export import LanguageModel
>>> model = LanguageModel.load("data/07_model_output/bundle/<version>/bundle")           # the fastest engine here
>>> paddle = LanguageModel.load("…/<version>/bundle", backend="paddle")                  # Paddle Inference
>>> edge = LanguageModel.load("…/<version>", backend="onnx", int8=True)                   # ONNX Runtime, int8
>>> model.score(["今天天气很好。"])[0].perplexity
>>> model.generate("中国", max_new_tokens=20, temperature=0)                               # greedy
>>> model.generate(["中国", "经济"], temperature=0.8, top_p=0.9, seed=1)                   # a batch, sampled
>>> for token in model.generate_stream("中国"): ...                                        # token by token

Texts are scored after the end-of-document id, the context every training document was seen in.
Every text and prompt is first normalised with the policy the bundle's tokenizer records (``zh``: full-width
Latin, digits and spaces folded, Chinese punctuation kept), as the training corpus was; a bundle whose tokenizer
records none (saved before the record, or a tokenizer loaded from elsewhere) takes texts as given, and says
so in the log when loaded.
Generation prefills the prompts once and decodes one token per step with the bundle's KV cache
(``graph.py``): linear, not quadratic, in the output length; ``generate_stream`` yields the tokens as they come.
A sequence that outgrows the context shifts it, as llama.cpp's context shift does: it goes on from its last
``context // 2`` tokens (:func:`shifted_start`), prefilled once, and decodes with the cache again until it fills
the context once more. Each token keeps at least half a context in view, and a long output costs one prefill of
half a context per half a context of tokens, where sliding by one token (a full prefill per token: the keys of a
causal model change when the oldest token leaves) cost 83% of a 16-sequence batch's time at 256 new tokens.
Bundles exported before the current graphs (format < 7) are refused with a line saying to re-export them.
Every file is checked against ``bundle.json``'s record of its size and hash when the bundle is loaded
(``integrity.py``): a missing, truncated or altered file is a :class:`BundleError` naming it.

The engine and graph are chosen from the host (``engines.py``) and run by ``backends.py``: Paddle Inference runs
the fused graph on GPU and on a CPU where the kernel probe passes (``probe.py``), else the portable graph; with no
backend pinned, the fastest engine the host can run at the export's measured figures. A format 7 bundle (the
fused graph only) on a CPU that cannot run it is refused in one line for ``backend="paddle"``; unpinned, it runs
on ONNX Runtime. The load logs what it took and why; :attr:`LanguageModel.engine` says it too. The hardware
settings of the engines (MKL's code path, float32 on GPU, TensorRT) are in ``hardware.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend, Step
from train_deploy.export.config import ServerConfig
from train_deploy.export.edge import INT8_FILE, ONNX_FILE
from train_deploy.export.engines import BACKENDS, choose_engine, server_prefix
from train_deploy.export.errors import BundleError, TooLongError
from train_deploy.export.integrity import verify_bundle
from train_deploy.handoffs import BUNDLE_FILE, BundleMeta, DescriptionError, TokenizerInfo, from_json

logger = logging.getLogger(__name__)
E = TypeVar("E")
"""A token event of :class:`HeldText`: a dataclass with a ``text`` field."""

_MAX_NATS = math.log(sys.float_info.max)  # a larger mean negative log-probability overflows math.exp



@dataclass(frozen=True, slots=True)
class TextScore:
    text: str
    tokens: list[int]
    """Ids of the text (after truncation, if any)."""
    log_probs: list[float]
    """Natural-log probability of each token given the ones before it."""
    perplexity: float


@dataclass(frozen=True, slots=True)
class GeneratedToken:
    """One new token of a stream (:meth:`LanguageModel.generate_stream`)."""

    sequence: int
    """Index of the prompt it continues."""
    token: int
    text: str
    """The text it adds to the sequence's output (empty while a character's bytes are incomplete: a character
    is shown once whole, so an output cut inside one ends without it)."""


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """The last generation's size and time (prefill included, as the caller waited for it)."""

    sequences: int
    prompt_tokens: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class LanguageModel:
    """A deployed bundle: its tokenizer and one backend (Paddle Inference or ONNX Runtime).

    ``form`` is called for logits (``(input_ids, attention_mask) -> logits``) and has ``prefill`` and
    ``decode`` (:class:`PaddleInferenceBackend`, :class:`OnnxRuntimeBackend`) for generation.
    """

    def __init__(self, form, tokenizer, *, context: int, eos_id: int,
                 too_long: Literal["raise", "truncate"] = "raise") -> None:
        self._form, self.tokenizer = form, tokenizer
        self.last_stats: GenerationStats | None = None
        """Size, time and tokens/s of the last finished generation."""
        self.context, self.eos_id, self.too_long = context, eos_id, too_long
        self.engine: str | None = None
        """The form :meth:`load` chose (parity.json's name: ``paddle_inference``, ``paddle_portable``,
        ``onnx_fp32``, ``onnx_int8``); None when built from a form directly."""
        self.normalization = getattr(tokenizer, "normalization", None)
        """The tokenizer's recorded normalisation policy, applied to every input (None: texts as given)."""

    def normalize(self, text: str) -> str:
        """``text`` as the corpus was normalised (unchanged when the tokenizer records no policy)."""
        from train_deploy.corpus.cleaning import normalize

        return text if self.normalization is None else normalize(text, self.normalization)

    @classmethod
    def load(cls, bundle: str | Path, backend: Literal["auto", "paddle", "onnx"] | None = None, *, int8: bool = False,
             server: ServerConfig | None = None, threads: int | None = None,
             too_long: Literal["raise", "truncate"] | None = None) -> LanguageModel:
        """Open ``bundle`` with ``backend`` (None or ``"auto"``: the fastest engine this host runs, module
        docstring); ``int8`` picks the quantised ONNX model; ``server`` and ``threads`` override the settings
        recorded at export."""
        folder = Path(bundle)
        meta = read_bundle(folder)
        if backend not in (None, *BACKENDS):
            raise BundleError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
        if int8 and backend != "onnx":
            raise BundleError("int8: the int8 model is ONNX; load it with backend='onnx'")
        verify_bundle(folder, meta)  # every file as bundle.json records it (integrity.py), before it is opened
        server = server or ServerConfig(**meta.server)
        if threads is not None:
            server = dataclasses.replace(server, cpu_threads=threads)
        choice = choose_engine(folder, meta, backend, server.device)
        if choice.refusal:
            raise BundleError(choice.refusal)
        if choice.backend == "paddle":
            form: Any = PaddleInferenceBackend(server_prefix(folder, choice), server, meta.model.context)
        else:
            form = OnnxRuntimeBackend(folder / "edge" / (INT8_FILE if int8 else ONNX_FILE),
                                      threads or meta.edge["threads"])
        model = cls(form, bundle_tokenizer(folder, meta), context=meta.model.context, eos_id=meta.model.eos_id,
                    too_long=too_long or meta.too_long)
        model.engine = "onnx_int8" if int8 else choice.form
        logger.info("Loaded %s: %s", folder, "ONNX Runtime int8 (asked for)" if int8 else choice.why)
        if model.normalization is None:
            logger.info("%s: the tokenizer records no normalisation policy (saved before train_deploy recorded one, "
                        "or not trained by train_deploy): texts are tokenized as given", folder)
        return model

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Raw logits ``[batch, sequence, vocabulary]`` (float32)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        return self._form(ids, np.ones_like(ids) if attention_mask is None else attention_mask)

    def score(self, texts: Sequence[str], batch_size: int = 8) -> list[TextScore]:
        """Per-token log-probabilities and perplexity of each text."""
        encoded = [self._fit([self.eos_id, *ids], what=f"text {i}") for i, ids in
                   enumerate(self.tokenizer.encode([self.normalize(text) for text in texts]))]
        scores = []
        for first in range(0, len(encoded), batch_size):
            batch = encoded[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            ids = np.zeros((len(batch), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, sequence in enumerate(batch):  # right padding: causal attention never looks at it
                ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
            log_probs = log_softmax(self.logits(ids, mask))
            for row, sequence in enumerate(batch):
                steps = np.arange(len(sequence) - 1)
                token_lp = log_probs[row, steps, sequence[1:]].astype(np.float64)
                ppl = self._perplexity(token_lp, f"text {first + row}")
                scores.append(TextScore(texts[first + row], sequence[1:], token_lp.tolist(), ppl))
        return scores

    def _perplexity(self, token_lp: np.ndarray, what: str) -> float:
        """exp of the mean negative log-probability (NaN for no tokens); log-probabilities that are not finite,
        or a perplexity beyond the float range, come only from broken weights: :class:`BundleError`."""
        if not len(token_lp):
            return float("nan")
        nats = -float(token_lp.mean())
        if not math.isfinite(nats) or nats > _MAX_NATS:
            found = "not finite (inf or NaN logits)" if not math.isfinite(nats) else f"{nats:.3g} nats per token"
            raise BundleError(f"{what}: the model's log-probabilities are {found}, beyond what a trained model "
                              f"gives ({self.engine or 'this engine'}); its weights are damaged: re-export the bundle")
        return math.exp(nats)

    def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 32, temperature: float = 1.0,
                 top_k: int = 50, seed: int | None = None, *, top_p: float = 1.0) -> str | list[str]:
        """Continue ``prompt`` (a text, or a list of texts continued as one batch); returns the new text (a list
        for a list). ``temperature <= 0`` (or ``top_k == 1``) decodes greedily; otherwise tokens are sampled
        among the ``top_k`` likeliest (0: all) whose probabilities add up to ``top_p``, each prompt with its own
        generator seeded by ``seed``. Each sequence stops at end of document. Tokens/s: :attr:`last_stats`.

        Generation uses the bundle's KV cache: the prompts are prefilled once, left-padded, then each step
        feeds one token per unfinished sequence. When a sequence outgrows the context, it goes on from its last
        half context, prefilled again once (the context shift, module docstring).
        """
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        new: list[list[int]] = [[] for _ in texts]
        for event in self.generate_stream(prompt, max_new_tokens, temperature, top_k, seed, top_p=top_p):
            new[event.sequence].append(event.token)
        outputs = [self.tokenizer.decode(ids) for ids in new]
        return outputs[0] if isinstance(prompt, str) else outputs

    def generate_stream(self, prompt: str | Sequence[str], max_new_tokens: int = 32, temperature: float = 1.0,
                        top_k: int = 50, seed: int | None = None, *, top_p: float = 1.0) -> Iterator[GeneratedToken]:
        """:meth:`generate` one token at a time: a :class:`GeneratedToken` per new token of each sequence, in
        step order, except that a token which leaves a character incomplete comes with the one that completes
        it (or at the end, with the text :meth:`generate` gives). :attr:`last_stats` is set when the iterator is
        exhausted."""
        if max_new_tokens < 0:
            raise BundleError(f"max_new_tokens: {max_new_tokens} is negative")
        if not 0 < top_p <= 1:
            raise BundleError(f"top_p: {top_p} is outside (0, 1]")
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts = [self._fit([self.eos_id, *ids], what="prompt" if isinstance(prompt, str) else f"prompt {i}")
                   for i, ids in enumerate(self.tokenizer.encode([self.normalize(text) for text in texts]))]
        rngs = [np.random.default_rng(seed) for _ in prompts]
        texts_out = [HeldText(self.tokenizer.decode) for _ in prompts]
        start = time.perf_counter()
        for row, token in self.stream_ids(prompts, max_new_tokens,
                                       lambda row, logits: sample_token(logits, temperature, top_k, rngs[row], top_p)):
            yield from texts_out[row].add(token, functools.partial(GeneratedToken, row, token))
        for held in texts_out:  # an output that ends inside a character ends as decode() has it
            yield from held.end()
        self.last_stats = GenerationStats(len(prompts), sum(map(len, prompts)),
                                          sum(len(held.text.ids) for held in texts_out), time.perf_counter() - start)
        logger.debug("Generated %d tokens for %d prompts at %.1f tokens/s", self.last_stats.new_tokens,
                     len(prompts), self.last_stats.tokens_per_second)

    def stream_ids(self, prompts: list[list[int]], max_new_tokens: int,
                pick: Callable[[int, np.ndarray], int]) -> Iterator[tuple[int, int]]:
        """``(sequence, token)`` for each new token of the id ``prompts`` (each ``[eos_id, *ids]`` within the
        context), ``pick(sequence, last logits)`` choosing it: prefill, then one decode step per token with the
        cache; a sequence that picks ``eos_id`` leaves the batch (its end of document is not yielded)."""
        if max_new_tokens == 0 or not prompts:
            return
        tokens = [list(ids) for ids in prompts]
        starts = [0] * len(prompts)  # where each sequence's window begins (the context shift)
        alive = list(range(len(prompts)))
        cache, logits = self._prefilled(tokens)
        for count in range(max_new_tokens):
            chosen = [pick(i, logits[row, -1].astype(np.float64)) for row, i in enumerate(alive)]
            keep = [row for row, token in enumerate(chosen) if token != self.eos_id]
            for row in keep:
                tokens[alive[row]].append(chosen[row])
                yield alive[row], chosen[row]
            if not keep or count == max_new_tokens - 1:
                return
            alive, ids = [alive[row] for row in keep], np.asarray([[chosen[row]] for row in keep], dtype=np.int64)
            cache.keep(keep)
            full = [i for i in alive if len(tokens[i]) - starts[i] > self.context]
            if full:  # the context shift: those go on from their last half context, every row prefilled again
                for i in full:
                    starts[i] = shifted_start(len(tokens[i]), self.context)
                cache, logits = self._prefilled([tokens[i][starts[i]:] for i in alive])
            else:
                logits = cache.decode(ids)

    def _prefilled(self, sequences: list[list[int]]) -> tuple[Any, np.ndarray]:
        """A new cache (``kv_cache.py``) holding ``sequences`` prefilled, and the prefill's logits."""
        cache = self._form.new_cache()
        mask, step = self._prefill(sequences)
        cache.join(mask, step, range(len(sequences)))
        return cache, step.logits

    def _prefill(self, sequences: list[list[int]]) -> tuple[np.ndarray, Step]:
        """Left-padded ``sequences`` through the prefill graph: their mask and the step."""
        width = max(map(len, sequences))
        ids = np.full((len(sequences), width), self.eos_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, sequence in enumerate(sequences):
            ids[row, width - len(sequence):], mask[row, width - len(sequence):] = sequence, 1
        return mask, self._form.prefill(ids, mask)

    def _fit(self, ids: list[int], what: str) -> list[int]:
        if len(ids) <= self.context:
            return ids
        if self.too_long == "truncate":
            return [self.eos_id, *ids[-(self.context - 1) :]]
        raise TooLongError(what, len(ids) - 1, self.context - 1)


def read_bundle(folder: Path) -> BundleMeta:
    """``folder``'s ``bundle.json`` (:meth:`BundleMeta.read`); a missing, unreadable or too old one raises
    :class:`BundleError` naming the file."""
    try:
        return BundleMeta.read(Path(folder))
    except DescriptionError as exc:
        raise BundleError(str(exc)) from None


def bundle_tokenizer(folder: Path, meta: BundleMeta):
    from train_deploy.corpus.tokenizer import TokenEncoder

    where = str(Path(folder) / BUNDLE_FILE)
    return TokenEncoder(from_json(TokenizerInfo, {**meta.tokenizer, "path": str(Path(folder) / "tokenizer")}, where))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def shifted_start(length: int, context: int) -> int:
    """Where a sequence of ``length`` tokens that outgrew ``context`` goes on from: its last ``context // 2``
    tokens (at least one), prefilled again (the context shift, module docstring)."""
    return length - max(1, context // 2)


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """The likeliest token of each row of last-position ``logits`` (``rows × vocabulary``), after the check that
    :func:`sample_token` makes: one call for a whole batch instead of one per row."""
    _check_finite(logits)
    return np.argmax(logits, axis=-1)


def sample_token(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator,
                 top_p: float = 1.0) -> int:
    """The next token from one position's ``logits``: greedy, or sampled (:meth:`LanguageModel.generate`).
    With ``top_k``, only its candidates are exponentiated and sorted (in id order, so a seed draws as over the
    whole vocabulary); the whole vocabulary is sorted only for ``top_p`` with ``top_k == 0``."""
    _check_finite(logits)
    if is_greedy(temperature, top_k):
        return int(np.argmax(logits))
    candidates = np.sort(np.argpartition(logits, -top_k)[-top_k:]) if 0 < top_k < len(logits) else None
    scaled = (logits if candidates is None else logits[candidates]) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1:  # the smallest set of likeliest tokens whose probabilities reach top_p (the likeliest always)
        order = np.argsort(-probs, kind="stable")
        outside = order[np.searchsorted(np.cumsum(probs[order]), top_p) + 1:]
        probs[outside] = 0
        probs /= probs.sum()
    picked = int(rng.choice(len(probs), p=probs))
    return picked if candidates is None else int(candidates[picked])


class Detokenizer:
    """The text each new token of one sequence adds, decoding a few tokens per step rather than the whole output
    (TGI's prefix and read offsets): the window starts at the last token before the text shown so far, so a
    tokenizer that drops a leading space or joins bytes into a character decodes it as in the whole text."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def add(self, token: int) -> str:
        """``token``'s text (empty while a character's bytes are incomplete; then the whole character)."""
        self.ids.append(token)
        return self._advance(final=False)

    @property
    def pending(self) -> bool:
        """Whether tokens wait for the rest of their character."""
        return self._read < len(self.ids)

    def flush(self) -> str:
        """The text of the tokens still pending, as decoding them gives it (an incomplete character included)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


class HeldText(Generic[E]):
    """One sequence's token events (dataclasses with a ``text``) in the order a reader gets them: an event whose
    token leaves a character incomplete is held and comes with the one that completes it (whose text is the whole
    character); at the end the last held one has the text decoding gives (:meth:`LanguageModel.generate_stream`
    and the server's batch, ``serving/batched.py``)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.text = Detokenizer(decode)
        self._held: list[E] = []

    def add(self, token: int, event: Callable[[str], E]) -> list[E]:
        """``event(token's text)`` and the events held before it, or nothing while its character is incomplete."""
        self._held.append(event(self.text.add(token)))
        if self.text.pending:
            return []
        ready, self._held = self._held, []
        return ready

    def end(self) -> list[E]:
        """The events still held, the last with the text of the tokens still pending."""
        held, self._held = self._held, []
        return [*held[:-1], dataclasses.replace(held[-1], text=self.text.flush())] if held else []


def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether sampling with these settings is the likeliest token (:func:`sample_token`)."""
    return temperature <= 0 or top_k == 1


def _check_finite(logits: np.ndarray) -> None:
    """Logits that are inf or NaN come only from broken weights (as in scoring): :class:`BundleError`, not a token
    picked from NaN or numpy's error about probabilities."""
    if not np.isfinite(logits).all():
        bad = int((~np.isfinite(logits)).sum())
        raise BundleError(f"generation: {bad} of the model's {logits.size} next-token logits are not finite (inf or "
                          "NaN), beyond what a trained model gives; its weights are damaged: re-export the bundle")
