"""Web pages → plain text: the page's charset, then its main text without navigation, scripts and footers.

The charset is taken, in this order, from a byte-order mark, the page's own ``<meta charset>`` (or
``http-equiv`` Content-Type), strict UTF-8, and last ``charset-normalizer``'s guess. GB2312 and GBK pages
are decoded as GB18030, their superset (pages labelled GB2312 routinely hold GBK characters). The text is
extracted with selectolax (lexbor): elements that are never main text (scripts, styles, navigation,
headers, footers, asides, forms, and elements whose role, id or class names them as navigation, menus,
breadcrumbs, sidebars, footers, share bars or comments) are removed, and every block element ends a line.

A page is one document, unless its main text is longer than a limit (``corpus.reader.html_split_chars``): a
manual published as one page is then cut before each heading (``h1``–``h6``) into one document per section, so
that a corpus of a few such pages still has enough documents for a validation split.
"""

from __future__ import annotations

import codecs
import re

_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_SNIFF_BYTES = 4096
_SUPERSETS = {"gb2312": "gb18030", "gbk": "gb18030", "x-gbk": "gb18030", "big5": "big5hkscs",
              "iso-8859-1": "cp1252", "latin-1": "cp1252", "ascii": "utf-8", "us-ascii": "utf-8"}
_NEVER_TEXT = ("script, style, noscript, template, svg, iframe, object, nav, header, footer, aside, form, button, "
               "select, [role=navigation], [role=banner], [role=contentinfo], [role=complementary], [hidden]")
_BOILERPLATE = re.compile(r"(^|[-_ ])(nav|navbar|menu|breadcrumbs?|sidebar|footer|share|social|comments?|"
                          r"copyright|related|advert|ads)([-_ ]|$)", re.IGNORECASE)
_HEADINGS = "h1, h2, h3, h4, h5, h6"
# Marks where a heading starts a section in the extracted text: a Unicode noncharacter (no text exchanges it; a
# private-use one could be a GBK user-defined character), not whitespace (lines are stripped), and removed from
# the page before the marks go in.
_SECTION = "\uffff"
_BLOCKS = ("p, div, h1, h2, h3, h4, h5, h6, li, dt, dd, tr, pre, blockquote, section, article, main, table, "
           "ul, ol, dl, figure, figcaption, address, hr, br")


class PageError(ValueError):
    """A page that cannot be decoded; the message says what was tried."""


def decode_page(data: bytes) -> tuple[str, str]:
    """The page's text and the charset it was decoded with (BOM, ``<meta charset>``, UTF-8, then a guess)."""
    for bom, name in ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if data.startswith(bom):
            return data.decode(name), name
    declared = _META_CHARSET.search(data[:_SNIFF_BYTES])
    tried = []
    if declared:
        name = declared.group(1).decode("ascii").lower()
        name = _SUPERSETS.get(name, name)
        tried.append(name)
        try:
            return data.decode(name), name
        except (LookupError, UnicodeDecodeError):
            pass
    if "utf-8" not in tried:
        try:
            return data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            tried.append("utf-8")
    from charset_normalizer import from_bytes

    guess = from_bytes(data).best()
    if guess is None or guess.encoding is None:
        raise PageError(f"cannot decode the page (tried {', '.join(tried)}; no charset detected)")
    name = _SUPERSETS.get(guess.encoding, guess.encoding)
    try:
        return data.decode(name), name
    except (LookupError, UnicodeDecodeError) as exc:
        raise PageError(f"cannot decode the page (tried {', '.join([*tried, name])}: {exc})") from None


def page_documents(page: str, split_chars: int | None) -> list[str]:
    """The page's main text (boilerplate elements removed, one line per block element, blank lines dropped) as one
    document, or, when it is longer than ``split_chars`` characters (None: never), one document per section: each
    heading starts one (the text before the first heading is one too), and a heading with no text of its own, such
    as a chapter's right before its first section's, goes with the next."""
    marked = _extract(page, mark_sections=split_chars is not None)
    whole = _lines(marked.replace(_SECTION, ""))
    if split_chars is None or len(whole) <= split_chars:
        return [whole] if whole else []
    documents, heading = [], ""
    for section in map(_lines, marked.split(_SECTION)):
        if "\n" not in section:  # a heading right before another (a chapter's, then its first section's)
            heading = f"{heading}\n{section}".strip()
            continue
        documents.append(f"{heading}\n{section}".strip())
        heading = ""
    return [*documents, heading] if heading else documents


def _extract(page: str, mark_sections: bool) -> str:
    """The main text with a newline after every block element (and :data:`_SECTION` before every heading)."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(page.replace(_SECTION, "") if mark_sections else page)
    root = tree.body or tree.root
    if root is None:
        return ""
    for node in root.css(_NEVER_TEXT):
        node.decompose()
    for node in root.css("[id], [class], [role]"):
        names = " ".join(node.attributes.get(key) or "" for key in ("id", "class", "role"))
        if _BOILERPLATE.search(names) and node.tag not in ("body", "html", "main", "article"):
            node.decompose()
    if mark_sections:
        for node in root.css(_HEADINGS):
            node.insert_before(_SECTION)
    for node in root.css(_BLOCKS):
        node.insert_after("\n")
    return root.text(deep=True, separator="")


def _lines(text: str) -> str:
    """``text``'s lines stripped, blank ones dropped."""
    lines = (line.strip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line)
