"""What a night's text says, not only how much of it there is (issue 39).

Two figures of the kept documents, both from one seeded sample of them (:func:`draw_sample`: documents drawn
without replacement from both splits of the token files, decoded with the tokenizer they were encoded with):

- **A model's loss in nats per character** on :data:`SAMPLE_DOCUMENTS` documents of the validation split (text the
  night's model was not trained on), each cut to :data:`TEXT_CHARS` characters and then to the model's context
  (:func:`score_sample`). Per character, so
  models with different tokenizers compare. A registered version records its own figure on its own corpus; the
  data gate scores tonight's sample with the champion and compares the two.
- **The character distribution**: the shares of the :data:`TOP_CHARACTERS` most frequent characters and
  :data:`OTHER` for the rest (:func:`character_shares`, a few kB however large the corpus: never the corpus
  itself), counted over the sample's first :data:`SUMMARY_CHARACTERS` characters; tonight's counts are compared
  with the champion's shares by Jensen–Shannon distance over the champion's buckets (:func:`character_distance`).

The loss sees what the counts cannot (another script, shuffled characters, advertising); the distance needs no
model (it catches another script or alphabet; not shuffling, which keeps every character's count).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train_deploy.corpus.indexed import document_sizes
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.redaction import redact_uri
from train_deploy.registry.evalset import cut

SAMPLE_DOCUMENTS = 256
"""Documents a model scores (how close 64 come to the whole corpus: ``benchmarks/calibrate_data_gate.py``)."""
SAMPLE_SEED = 0
"""The sample's generator seed: the same token files always give the same sample."""
TEXT_CHARS = 100
"""Each scored document is cut to at most this many characters (at a sentence end when there is one)."""
SUMMARY_CHARACTERS = 1_000_000
"""Characters of the sample counted for the character distribution (all of a smaller corpus)."""
MAX_SAMPLED_DOCUMENTS = 20_000
"""Most documents drawn for the sample (about 2 M characters of People's Daily paragraphs)."""
TOP_CHARACTERS = 256
"""Characters whose shares are recorded; the rest are :data:`OTHER`."""
OTHER = "other"
"""The key of the share of every character outside the top ones (a character is one code point: no clash)."""
SHOWN_CHARS = 80
"""A sample line in a report is cut to this many characters."""


@dataclass(frozen=True, slots=True)
class Sample:
    """The seeded sample of a corpus's kept documents."""

    texts: list[str]
    """:data:`SAMPLE_DOCUMENTS` documents of the validation split, cut to :data:`TEXT_CHARS` characters."""
    counts: Counter
    """Character counts over the sample's first :data:`SUMMARY_CHARACTERS` characters (whole documents), white
    space left out (line breaks and spaces say more of the reader than of the text)."""


@dataclass(frozen=True, slots=True)
class SampleScores:
    """A model's score of each text of a sample: nats (``-Σ log p``) and characters, in the sample's order."""

    texts: list[str]
    nats: np.ndarray
    chars: np.ndarray

    @property
    def nats_per_char(self) -> float:
        """``Σ nats / Σ chars`` over the sample (NaN for an empty one)."""
        return float(self.nats.sum() / self.chars.sum()) if self.chars.sum() else float("nan")

    def per_text(self) -> np.ndarray:
        """Each text's nats per character."""
        return self.nats / np.maximum(self.chars, 1)

    def worst(self, count: int = 3) -> list[str]:
        """The ``count`` texts that scored worst (most nats per character), as :func:`shown_line` shows them."""
        order = np.argsort(-self.per_text(), kind="stable")[:count]
        return [shown_line(self.texts[i]) for i in order.tolist()]


def draw_sample(manifest: TokenManifest, tokenizer: TokenizerInfo, seed: int = SAMPLE_SEED) -> Sample:
    """The seeded sample of ``manifest``'s kept documents (see the module), decoded with ``tokenizer``: the texts
    to score from the validation split (text no model trained on that night; all documents when it holds fewer
    than :data:`SAMPLE_DOCUMENTS`), the characters from every split."""
    from train_deploy.corpus.tokenizer import TokenEncoder

    spans = _document_spans(manifest)
    decode = TokenEncoder(tokenizer).decode
    held_out = [span for span in spans if span[0] == "valid" and len(span[2]) >= SAMPLE_DOCUMENTS]
    texts = []
    for text in _documents(held_out or spans, manifest.dtype, tokenizer.eos_id, decode, seed):
        if kept := cut(text, TEXT_CHARS):
            texts.append(kept)
            if len(texts) == SAMPLE_DOCUMENTS:
                break
    counts: Counter = Counter()
    for text in _documents(spans, manifest.dtype, tokenizer.eos_id, decode, seed):
        counts.update(_SPACE.sub("", text))
        if counts.total() >= SUMMARY_CHARACTERS:
            break
    return Sample(texts, counts)


def _documents(spans: list[tuple[str, Path, np.ndarray, np.ndarray]], dtype: str, eos_id: int,
               decode: Callable[[list[int]], str], seed: int) -> Iterator[str]:
    """Up to :data:`MAX_SAMPLED_DOCUMENTS` documents of ``spans`` drawn without replacement (seeded), decoded."""
    firsts = np.cumsum([0] + [len(sizes) for _, _, sizes, _ in spans])
    if not firsts[-1]:
        return
    order = np.random.default_rng(seed).choice(int(firsts[-1]), size=min(int(firsts[-1]), MAX_SAMPLED_DOCUMENTS),
                                               replace=False)
    files = [np.memmap(path, dtype=np.dtype(dtype), mode="r") for _, path, _, _ in spans]
    for index in order.tolist():
        split = int(np.searchsorted(firsts, index, side="right")) - 1
        _, _, sizes, starts = spans[split]
        at = index - int(firsts[split])
        ids = np.asarray(files[split][starts[at] : starts[at] + sizes[at]]).tolist()
        yield decode([i for i in ids if i != eos_id])


def _document_spans(manifest: TokenManifest) -> list[tuple[str, Path, np.ndarray, np.ndarray]]:
    """Per split with tokens: its name, ``.bin`` file, each document's size in tokens and first token's index."""
    spans = []
    for name, split in sorted(manifest.splits.items()):
        if split.tokens:
            prefix = manifest.prefix(name)
            sizes = document_sizes(prefix.parent / f"{prefix.name}.idx").astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            spans.append((name, prefix.parent / f"{prefix.name}.bin", sizes, starts))
    return spans


def score_sample(model, texts: list[str]) -> SampleScores:
    """``model`` (a ``LanguageModel``)'s nats on each text, cut to fit its context (:func:`fitted`)."""
    fitting = [fitted(model, text) for text in texts]
    fitting = [text for text in fitting if text]
    scores = model.score(fitting) if fitting else []
    return SampleScores(texts=fitting, nats=np.array([-math.fsum(s.log_probs) for s in scores], dtype=np.float64),
                        chars=np.array([len(s.text) for s in scores], dtype=np.int64))


def fitted(model, text: str) -> str:
    """``text`` cut until its tokens under ``model`` fit the context after the end-of-document id it is scored
    after (text in another script takes more tokens per character: it is cut shorter)."""
    for _ in range(16):
        tokens = len(model.tokenizer.encode([model.normalize(text)])[0])
        if tokens < model.context or len(text) <= 1:
            return text
        text = text[: max(1, min(len(text) - 1, len(text) * (model.context - 1) // tokens))]
    return text


def character_shares(counts: Counter, top: int = TOP_CHARACTERS) -> dict[str, float]:
    """The shares of the ``top`` most frequent characters of ``counts`` (4 significant digits: the version's tag
    stays under 5,000 characters) and :data:`OTHER` (empty: no characters)."""
    total = sum(counts.values())
    if not total:
        return {}
    shares = {char: float(f"{count / total:.4g}") for char, count in counts.most_common(top)}
    shares[OTHER] = max(0.0, 1.0 - math.fsum(shares.values()))
    return shares


def character_distance(counts: Counter, reference: dict[str, float]) -> float | None:
    """The Jensen–Shannon distance (base 2: 0 the same, 1 disjoint) between the characters ``counts`` and the
    ``reference`` shares, over the reference's buckets: each of its characters, and :data:`OTHER` for every other
    character. None when either side is empty."""
    keys = [key for key in reference if key != OTHER]
    total = sum(counts.values())
    if not total or not reference:
        return None
    q = np.array([counts.get(key, 0) for key in keys] + [0], dtype=np.float64) / total
    q[-1] = max(0.0, 1.0 - q[:-1].sum())
    p = np.array([reference[key] for key in keys] + [reference.get(OTHER, 0.0)], dtype=np.float64)
    p = np.clip(p, 0.0, None) / max(p.sum(), 1e-300)
    m = (p + q) / 2
    divergence = (_kl(p, m) + _kl(q, m)) / 2
    return float(math.sqrt(max(divergence, 0.0)))


def _kl(p: np.ndarray, m: np.ndarray) -> float:
    inside = p > 0
    return float(np.sum(p[inside] * np.log2(p[inside] / m[inside])))


# What a sample line never shows: a URI's query (tokens ride there) and credentials, file paths, key=value secrets,
# long random-looking strings (API keys, hashes). QQ numbers and host names stay: they are what a reader looks for.
_QUERY = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^\s?#]*)[?#]\S*")
_PATH = re.compile(r"(?<![\w:/.~-])(?:~|[A-Za-z]:)?[/\\](?:[^\s/\\]+[/\\])+[^\s/\\]*|(?i:\b[A-Z]:\\\S+)")
_ASSIGNED = re.compile(r"(?i)(?<![a-z])(password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|auth)"
                       r"(\s*[:=：]\s*)\S+")
_RANDOM = re.compile(r"(?<![A-Za-z0-9_+/=-])(?=[A-Za-z0-9_+/=-]*\d)(?=[A-Za-z0-9_+/=-]*[A-Za-z])"
                     r"[A-Za-z0-9_+/=-]{20,}(?![A-Za-z0-9_+/=-])")
_SPACE = re.compile(r"\s+")


def shown_line(text: str, width: int = SHOWN_CHARS) -> str:
    """``text`` as a report shows it: one line, without credentials, secrets or paths, at most ``width``
    characters (``…`` marks a cut)."""
    line = _SPACE.sub(" ", text).strip()
    line = _QUERY.sub(r"\1", redact_uri(line))
    line = _ASSIGNED.sub(r"\1\2<secret>", line)
    line = _RANDOM.sub("<secret>", line)
    line = _PATH.sub("<path>", line)
    return line if len(line) <= width else line[: width - 1] + "…"
