"""Streaming MediaWiki XML dump reader and a wiki-markup → plain-text stripper (WikiExtractor style)."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import IO
from xml.etree import ElementTree

# Block elements whose content is not prose.
_DROP_ELEMENTS = re.compile(
    r"<(ref|gallery|math|chem|timeline|score|syntaxhighlight|source|pre|imagemap|templatedata|graph|mapframe)"
    r"\b[^>]*?(?:/>|>.*?</\1\s*>)",
    re.DOTALL | re.IGNORECASE,
)
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.DOTALL)
_TEMPLATE = re.compile(r"\{\{(?:(?!\{\{|\}\})[\s\S])*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\|)[\s\S])*?\|\}")
_LANG_CONVERSION = re.compile(r"-\{(.*?)\}-", re.DOTALL)
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+\s*([^\]]*)\]")
_BARE_URL_BRACKETS = re.compile(r"\[(?:https?|ftp)://[^\]]*\]")
_QUOTES = re.compile(r"'{2,5}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.MULTILINE)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_MAGIC = re.compile(r"__[A-Z]+__|__[^\s_]+__")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_TABLE_REMNANT = re.compile(r"^\s*[|!].*$", re.MULTILINE)

# Link namespaces that carry no prose: files, images, categories (English and Chinese names).
_DROP_NAMESPACES = {
    "file", "image", "category", "media", "文件", "檔案", "档案", "图像", "圖像", "图片", "分类", "分類", "媒体",
}
# Preferred variants of Chinese wiki language conversion markup -{zh-hans:…;zh-hant:…}-.
_VARIANTS = ("zh-hans", "zh-cn", "zh-sg", "zh", "zh-hant", "zh-tw", "zh-hk")


def strip_wiki_markup(text: str) -> str:
    """Return the prose of a wikitext page: templates, tables, references, files and markup removed."""
    text = _COMMENT.sub("", text)
    text = _DROP_ELEMENTS.sub("", text)
    text = _repeat(_TEMPLATE, "", text)
    text = _repeat(_TABLE, "", text)
    text = _LANG_CONVERSION.sub(_pick_variant, text)
    text = _repeat(_INNER_LINK, _link_text, text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1), text)
    text = _BARE_URL_BRACKETS.sub("", text)
    text = _QUOTES.sub("", text)
    text = _HEADING.sub(lambda m: m.group(2), text)
    text = _TAG.sub("", text)
    text = _MAGIC.sub("", text)
    text = _TABLE_REMNANT.sub("", text)
    text = _LIST_MARKER.sub("", text)
    return html.unescape(text)


def iter_pages(stream: IO[bytes]) -> Iterator[tuple[str, str]]:
    """Yield ``(title, wikitext)`` of every article (namespace 0, not a redirect) in a dump.

    Parsed incrementally; each page is cleared once read, so memory does not grow with the dump.
    """
    parser = ElementTree.iterparse(stream, events=("start", "end"))
    root = None
    for event, elem in parser:
        if root is None and event == "start":
            root = elem
        if event != "end" or _local(elem.tag) != "page":
            continue
        title = ns = text = ""
        redirect = False
        for child in elem.iter():
            name = _local(child.tag)
            if name == "title":
                title = child.text or ""
            elif name == "ns":
                ns = (child.text or "").strip()
            elif name == "redirect":
                redirect = True
            elif name == "text":
                text = child.text or ""
        if ns in ("0", "") and not redirect and not text.lstrip().lower().startswith(("#redirect", "#重定向")):
            yield title, text
        if root is not None:
            root.clear()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _repeat(pattern: re.Pattern[str], repl, text: str, limit: int = 20) -> str:
    """Apply ``pattern`` until nothing changes: templates, tables and links nest."""
    for _ in range(limit):
        new = pattern.sub(repl, text)
        if new == text:
            return new
        text = new
    return text


def _link_text(match: re.Match[str]) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    namespace = target.split(":", 1)[0].strip().lower() if ":" in target else ""
    if namespace in _DROP_NAMESPACES:
        return ""
    if label:
        return label.rsplit("|", 1)[-1]
    return target.lstrip(":").split("#", 1)[0]


def _pick_variant(match: re.Match[str]) -> str:
    body = match.group(1)
    if ":" not in body:
        return body
    variants = {}
    for part in body.split(";"):
        code, sep, value = part.partition(":")
        if sep:
            variants[code.strip().lower()] = value
    for code in _VARIANTS:
        if code in variants:
            return variants[code]
    return next(iter(variants.values()), "")
