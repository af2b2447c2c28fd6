"""`kedro run --params`: Kedro's items, split and parsed as Kedro does, but never a traceback.

Kedro splits the option at every comma and hands the items to OmegaConf, whose YAML parser raises a
``ScannerError`` (a hundred-line traceback that names no key) on a value such as ``%``. Here:

- an item ends at a comma only where the next item starts (``key=``) outside brackets, braces and quotes, so
  ``corpus.reader.paths=[/a,/b]`` and ``corpus.reader.separator=-{4,}`` arrive whole;
- a value is YAML, as in Kedro (``3`` is a number, ``[a, b]`` a list, ``'%'`` a string); a bare value YAML cannot
  start (``%``, ``@x``, a backtick) is taken as the string it reads, with a warning showing the quoting that says so;
- any other value YAML cannot read (an unclosed ``[``, ``{`` or quote) stops the command with one line naming the
  key and the quoting to use.

:func:`parse_params` is the ``--params`` callback of the project's ``kedro run`` (:func:`with_project_params`).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Sequence
from typing import Any

import click

logger = logging.getLogger(__name__)

_KEY = re.compile(r"\s*([A-Za-z_][\w-]*(?:\.[\w-]+)*)\s*=")
_OPEN, _CLOSE = "[{", "]}"
_STRUCTURED = tuple("[{'\"")
"""What a value YAML must read as a structure or a quoted string starts with: its failure is refused, not taken
as text."""


class ParamsError(click.ClickException):
    """A ``--params`` item that cannot be read; click prints ``Error: <message>`` on one line and exits 2."""

    exit_code = 2


def parse_params(ctx: click.Context | None, param: click.Parameter | None, value: Any) -> dict[str, Any]:
    """The ``--params`` string as Kedro's nested dictionary (``a.b=1`` → ``{"a": {"b": 1}}``); a dictionary (a
    default, or a caller's) is returned as it is. Raises :class:`ParamsError` naming the item that cannot be read."""
    if isinstance(value, dict):
        return value
    from omegaconf import OmegaConf

    dot_list = [_dot_item(item) for item in split_items(value or "")]
    return OmegaConf.to_container(OmegaConf.from_dotlist(dot_list))


def split_items(value: str) -> list[str]:
    """The ``key=value`` items of ``value``: split at commas outside brackets, braces and quoted values that
    are followed by the next item's ``key=``."""
    items, start, depth, quote = [], 0, 0, None
    for i, char in enumerate(value):
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"" and _starts_scalar(value, i):
            quote = char
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth = max(0, depth - 1)
        elif char == "," and depth == 0 and _KEY.match(value, i + 1):
            items.append(value[start:i])
            start = i + 1
    items.append(value[start:])
    return [item.strip() for item in items if item.strip()]


def _starts_scalar(value: str, i: int) -> bool:
    """Whether the quote at ``i`` opens a YAML quoted scalar: right after ``=``, ``[``, ``{``, ``,`` or ``:``."""
    before = value[:i].rstrip()
    return not before or before[-1] in "=[{,:"


def _dot_item(item: str) -> str:
    """``key=value`` as OmegaConf's dot list takes it: ``value`` quoted when it is text YAML cannot start."""
    from omegaconf import OmegaConf

    key, equals, raw = item.partition("=")
    key = key.strip()
    if not equals or not key:
        raise ParamsError(f"--params {item!r}: an item is key=value (e.g. --params corpus.reader.max_bytes=200000)")
    try:
        OmegaConf.from_dotlist([f"{key}={raw}"])
        return f"{key}={raw}"
    except Exception as exc:  # yaml's ScannerError, ParserError, …; OmegaConf's own for a bad key
        problem = _problem(exc)
    text = raw.strip()
    inner = text[1:].removesuffix(text[0]) if text[:1] in ("'", '"') else text  # an unclosed quote: its text
    quoted = "'" + inner.replace("'", "''") + "'"
    if text and not text.startswith(_STRUCTURED):
        logger.warning("--params %s=%s: YAML cannot read %r (%s): taken as the string %r; write "
                       "--params \"%s=%s\" to say so", key, raw, text, problem, text, key, quoted)
        return f"{key}={quoted}"
    raise ParamsError(f"--params {key}={raw}: YAML cannot read the value ({problem}); close it, or quote it as a "
                      f"string: --params \"{key}={quoted}\"")


def _problem(exc: Exception) -> str:
    """YAML's reason in a few words (``found character '%' that cannot start any token``)."""
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    return " ".join(str(problem).split())


def with_project_params(options: Sequence[click.Parameter]) -> list[click.Parameter]:
    """Kedro's ``run`` options with ``--params`` read by :func:`parse_params` (copies: Kedro's command is untouched)."""
    replaced = []
    for option in options:
        if option.name == "params":
            option = copy.copy(option)
            option.callback = parse_params
        replaced.append(option)
    return replaced
