"""Manual pages (troff ``man`` macros, as ``manpages-zh`` ships them, gzipped) → plain text.

Where ``groff`` or ``mandoc`` is installed (``corpus.reader.man_renderer: auto`` takes groff, then mandoc) a page
is rendered by it, in its safe mode, to UTF-8 text with no fonts, no line breaks inside a paragraph and no
hyphenation; its header and footer lines (``LS(1) … LS(1)``) are dropped. Otherwise (``strip``) the requests are
stripped here: comments, macro and string definitions and conditionals are resolved or dropped, ``.SH``/``.SS``
headings, ``.TP``/``.IP`` tags and ``tbl`` rows become lines of their own, the font alternations (``.BR a b``) and
escapes (``\\fB``, ``\\-``, ``\\(em``, ``\\[u4E00]``) become the characters they print, and the lines of a filled
paragraph are joined (with no space between two CJK characters, a space otherwise).

A page that only includes another one (``.so man1/other.1``: an alias) gives no document.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import unicodedata
from collections.abc import Iterator

from train_deploy.corpus.errors import CorpusError

RENDERERS = ("groff", "mandoc")
_TIMEOUT_S = 60
_COMMANDS = {
    # -k -K utf-8: preconv reads UTF-8; -t: tbl; -P-cbou: no SGR, bold, underline or overstrike; a line as long as
    # the paragraph; no hyphenation. groff runs in its safe mode (no .sy, .pi, .open) unless -U is given.
    "groff": ["groff", "-man", "-t", "-k", "-K", "utf-8", "-Tutf8", "-P-cbou", "-rLL=100000n", "-rHY=0"],
    "mandoc": ["mandoc", "-man", "-Tutf8", "-Owidth=100000"],
}
_SGR = re.compile(r"\x1b\[[0-9;]*m|.\x08")


class ManPageError(ValueError):
    """A page that cannot be decoded or rendered; the message says why."""


@functools.cache
def find_renderer(choice: str) -> str | None:
    """The program ``corpus.reader.man_renderer`` names, resolved (``auto``: groff, else mandoc, else None:
    strip); None for ``strip``. Raises ``CorpusError`` when a named one is not installed."""
    if choice == "strip":
        return None
    if choice == "auto":
        return next((name for name in RENDERERS if shutil.which(name)), None)
    if shutil.which(choice) is None:
        raise CorpusError(f"corpus.reader.man_renderer: {choice} is not installed (on Debian: apt-get install "
                           f"{'groff-base' if choice == 'groff' else 'mandoc'}); auto falls back to strip")
    return choice


@functools.cache
def renderer_version(renderer: str | None) -> str:
    """The renderer's own version line (``GNU groff version 1.22.4``), part of the corpus fingerprint."""
    if renderer != "groff":
        return renderer or "strip"
    done = subprocess.run(["groff", "--version"], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    return (done.stdout.splitlines() or ["groff"])[0]


def decode_page(data: bytes) -> str:
    """The page's text: UTF-8, else GB18030 (manpages-zh's older pages are GB2312)."""
    for encoding in ("utf-8-sig", "gb18030"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    raise ManPageError("not UTF-8 or GB18030 text")


def is_alias(source: str) -> bool:
    """A page whose only request is ``.so other-page`` (an alias of another page)."""
    requests = [line for line in source.splitlines() if line.strip() and not _is_comment(line)]
    return len(requests) == 1 and re.match(r"[.']\s*so\s", requests[0]) is not None


def man_text(source: str, renderer: str | None) -> str:
    """The text ``source`` prints: rendered by ``renderer`` (``groff``, ``mandoc``), or stripped (None)."""
    if is_alias(source):
        return ""
    lines = _rendered(source, renderer) if renderer else strip_requests(source)
    return "\n".join(line for line in (" ".join(line.split()) for line in lines) if line)


def _rendered(source: str, renderer: str) -> list[str]:
    try:
        done = subprocess.run(_COMMANDS[renderer], input=source.encode("utf-8"), capture_output=True,
                              timeout=_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ManPageError(f"{renderer} took more than {_TIMEOUT_S} s") from None
    if done.returncode != 0:
        reason = (done.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise ManPageError(f"{renderer} failed ({reason})")
    lines = [line for line in _SGR.sub("", done.stdout.decode("utf-8", "replace")).splitlines() if line.strip()]
    return lines[1:-1]  # the header (LS(1) … LS(1)) and footer (version, date, LS(1))


# --- the fallback: the requests stripped here ------------------------------------------------------------

_CHARACTERS = {
    "em": "—", "en": "–", "hy": "-", "mi": "-", "bu": "•", "co": "©", "rg": "®", "tm": "™", "lq": "“", "rq": "”",
    "oq": "‘", "cq": "’", "aq": "'", "dq": '"', "Fo": "«", "Fc": "»", "fo": "‹", "fc": "›", "ga": "`", "aa": "´",
    "ti": "~", "ha": "^", "pl": "+", "mu": "×", "di": "÷", ">=": "≥", "<=": "≤", "!=": "≠", "->": "→", "<-": "←",
    "de": "°", "sc": "§", "ps": "¶", "dg": "†", "sh": "#", "rs": "\\", "sl": "/", "ba": "|", "br": "│", "ul": "_",
    "lh": "☜", "rh": "☞", "Tm": "™", "R": "®", "tno": "~",
}
_SINGLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "t": "\t", "'": "'", "`": "`", ".": "."}
_ESCAPE = re.compile(r"""\\(?:
      (?P<font>[fFmMsg](?:\[[^\]]*\]|\([^\\]{2}|[+-]?\d\d?|.)?)       # fonts, colours, sizes: nothing printed
    | (?P<motion>[hvwlLNoSXZDbxkRAB]'[^']*')                           # motions, widths, drawing: nothing
    | (?P<register>[nYV*](?:\[[^\]]*\]|\(..|.))                        # registers; strings, looked up below
    | \((?P<named2>..)                                                  # \(em
    | \[(?P<named>[^\]]*)\]                                             # \[em], \[u4E00]
    | (?P<single>.)                                                     # \- \e \& \| \c …
)""", re.VERBOSE)


def strip_requests(source: str) -> list[str]:
    """The lines ``source`` prints, its troff requests and escapes resolved or dropped (without a renderer)."""
    return _Stripper().run(source)


def _is_comment(line: str) -> bool:
    return re.match(r"[.']\s*(?:\\\"|\\#|$)", line) is not None


class _Stripper:
    """One page's state: defined strings, fill mode, the open paragraph, the last ``.ie`` result, a table."""

    def __init__(self) -> None:
        self.strings: dict[str, str] = {}
        self.lines: list[str] = []
        self.paragraph: list[str] = []
        self.fill = True
        self.last_if = True
        self.tag = False
        """The next text line is a ``.TP`` tag: a line of its own."""

    def run(self, source: str) -> list[str]:
        lines = iter(_logical_lines(source))
        for line in lines:
            self.line(line, lines)
        self.flush()
        return self.lines

    def flush(self) -> None:
        if self.paragraph:
            self.lines.append(_join(self.paragraph))
            self.paragraph = []

    def text(self, text: str) -> None:
        if self.tag and text.strip():
            self.tag = False
            self.flush()
            self.lines.append(text)
        elif not self.fill:
            self.lines.append(text)
        elif text.strip():
            self.paragraph.append(text.strip())

    def line(self, line: str, rest: Iterator[str]) -> None:
        line = line.replace("\\}", "").replace("\\{", "")  # a block's braces: its lines are read as they come
        if not line.strip():
            self.flush()
        elif line[0] in ".'":
            self.request(line[1:].strip(), rest)
        else:
            if line[0] in " \t":
                self.flush()  # a line starting with a space breaks the paragraph
            self.text(self.escapes(line))

    def request(self, body: str, rest: Iterator[str]) -> None:
        name, _, tail = body.partition(" ")
        name, tail = name.strip(), tail.strip()
        if name in ("if", "ie", "el"):
            self.conditional(name, tail, rest)
        elif name in ("de", "de1", "am", "ig"):
            _skip_block(rest)
        elif name == "ds":
            key, _, value = tail.partition(" ")
            self.strings[key] = self.escapes(value.strip().removeprefix('"'))
        elif name == "TS":
            self.table(rest)
        else:
            self.macro(name, _arguments(tail), rest)

    def macro(self, name: str, args: list[str], rest: Iterator[str]) -> None:
        """The ``man`` macros that print (headings, tags, fonts); other requests only break or print nothing."""
        if name in ("SH", "SS", "SY"):
            self.flush()
            self.lines.append(" ".join(self.escapes(a) for a in args) if args else self.escapes(next(rest, "")))
        elif name in ("B", "I", "SM", "SB"):
            self.text(" ".join(self.escapes(a) for a in args) if args else self.escapes(next(rest, "")))
        elif name in ("BR", "BI", "IB", "IR", "RB", "RI"):
            self.text("".join(self.escapes(a) for a in args))
        elif name in ("IP", "TP", "TQ", "HP", "PP", "P", "LP", "sp", "br", "bp", "RS", "RE", "YS", "ne"):
            self.flush()
            if name == "IP" and args:
                self.lines.append(self.escapes(args[0]))
            self.tag = name in ("TP", "TQ")
        elif name in ("OP",):
            self.text("[" + " ".join(self.escapes(a) for a in args) + "]")
        elif name in ("nf", "EX", "fi", "EE"):
            self.flush()
            self.fill = name in ("fi", "EE")

    def conditional(self, name: str, tail: str, rest: Iterator[str]) -> None:
        if name == "el":
            holds, body = not self.last_if, tail
        else:
            holds, body = _condition(tail)
            if name == "ie":
                self.last_if = holds
        if holds:
            self.line(body.lstrip(), rest)
        elif body.lstrip().startswith("\\{"):
            _skip_braces(body, rest)

    def table(self, rest: Iterator[str]) -> None:
        """A ``tbl`` table (``.TS`` … ``.TE``): one line per row, its cells separated by spaces; ``T{`` … ``T}``
        cells joined into their row."""
        self.flush()
        tab, row, data, block = "\t", [], False, False
        for line in rest:
            if re.match(r"[.']\s*TE\b", line):
                break
            if not data:  # an options line ending in ";" (tab(@)), then format lines, the last ending in "."
                if line.rstrip().endswith(";") and (options := re.search(r"tab\s*\((.)\)", line)):
                    tab = options[1]
                data = line.rstrip().endswith(".")
                continue
            if line[:1] in ".'" or line.strip() in ("_", "="):
                continue
            if block and not line.startswith("T}"):  # a text block's line
                row.append(self.escapes(line))
                continue
            text = line.removeprefix("T}").rstrip() if block else line.rstrip()
            block = text.endswith("T{")
            row.append(self.escapes(text.removesuffix("T{").replace(tab, " ")))
            if not block:
                self.lines.append(" ".join(cell.strip() for cell in row if cell.strip()))
                row = []

    def escapes(self, text: str) -> str:
        return _ESCAPE.sub(self._escape, text)

    def _escape(self, match: re.Match[str]) -> str:
        if match["register"] is not None:
            kind, name = match["register"][0], match["register"][1:].strip("[]").removeprefix("(")
            return self.strings.get(name, _CHARACTERS.get(name, "")) if kind == "*" else ""
        if match["named2"] is not None or match["named"] is not None:
            return _character(match["named2"] or match["named"])
        if match["single"] is not None:
            return _SINGLE.get(match["single"], "")
        return ""


def _logical_lines(source: str) -> Iterator[str]:
    """Source lines without comments, a line ending in an escaped newline joined to the next."""
    pending = ""
    for raw in source.splitlines():
        line = pending + raw
        pending = ""
        if _is_comment(line):
            continue
        line = re.sub(r'(?<!\\)\\".*$', "", line)
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = line[:-1]
            continue
        if (hashed := re.search(r"(?<!\\)\\#", line)) is not None:
            pending = line[:hashed.start()]
            continue
        yield line
    if pending:
        yield pending


def _arguments(tail: str) -> list[str]:
    """A macro's arguments: words, or double-quoted strings (``""`` inside one is a quote)."""
    return [match[1].replace('""', '"') if match[1] is not None else match[2]
            for match in re.finditer(r'"((?:[^"]|"")*)"?|(\S+)', tail)]


def _condition(tail: str) -> tuple[bool, str]:
    """Whether an ``.if``/``.ie`` condition holds, and the body after it. Only what decides text in a man page is
    evaluated: ``n`` (nroff: true), ``t``, ``o``, ``e``, ``v`` (false), and string comparisons ``'a'b'``; any other
    condition (a register, a defined name) is false."""
    negate = tail.startswith("!")
    tail = tail.removeprefix("!")
    compare = re.match(r"(['\"|/])(.*?)\1(.*?)\1", tail)
    if compare is not None:
        holds, body = compare[2] == compare[3], tail[compare.end():]
    else:
        word, _, body = tail.partition(" ")
        holds = word == "n"
    return holds != negate, body


def _skip_block(rest: Iterator[str]) -> None:
    """Skip a macro definition or ``.ig`` block up to its ``..`` line."""
    for line in rest:
        if line.strip() == "..":
            return


def _skip_braces(body: str, rest: Iterator[str]) -> None:
    """Skip a false condition's ``\\{`` … ``\\}`` block (nested ones too)."""
    depth = body.count("\\{") - body.count("\\}")
    while depth > 0:
        line = next(rest, None)
        if line is None:
            return
        depth += line.count("\\{") - line.count("\\}")


def _character(name: str) -> str:
    if name in _CHARACTERS:
        return _CHARACTERS[name]
    if re.fullmatch(r"u[0-9A-F]{4,6}", name):
        return chr(int(name[1:], 16))
    if re.fullmatch(r"char\d+", name):
        return chr(int(name[4:]))
    return ""


def _join(pieces: list[str]) -> str:
    """A filled paragraph's lines: no space between two CJK characters (or CJK punctuation), a space otherwise."""
    text = pieces[0]
    for piece in pieces[1:]:
        text += ("" if _wide(text[-1:]) and _wide(piece[:1]) else " ") + piece
    return text


def _wide(char: str) -> bool:
    return bool(char) and unicodedata.east_asian_width(char) in ("W", "F")
