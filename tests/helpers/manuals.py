"""Manuals published as one web page each, the corpus a new user brings (issue 36: two single-page HTML manuals).

The text is the People's Daily corpus's (real Chinese a tiny model can learn), cut into chapters (``h2``) and
sections (``h3``) with the navigation, table of contents and footer such a page has.
"""

from __future__ import annotations

from pathlib import Path

from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path

PARAGRAPHS_PER_SECTION = 5
SECTIONS_PER_CHAPTER = 4


def paragraphs(first: int, count: int) -> list[str]:
    """``count`` non-empty paragraphs of the People's Daily corpus from paragraph ``first``."""
    with people_daily_path().open(encoding="utf-8") as corpus:
        lines = [line for line in (next(corpus) for _ in range(3 * (first + count))) if line.strip()]
    return [text for text in strip_pos_tags(lines) if text.strip()][first:first + count]


def sections(texts: list[str]) -> list[tuple[str, list[str]]]:
    """``texts`` as (section title, paragraphs), ``PARAGRAPHS_PER_SECTION`` paragraphs each."""
    step = PARAGRAPHS_PER_SECTION
    return [(f"第{i // step + 1}节 {texts[i][:8]}", texts[i:i + step]) for i in range(0, len(texts), step)]


def single_page_manual(title: str, texts: list[str]) -> str:
    """A manual as one HTML page: a chapter heading before every ``SECTIONS_PER_CHAPTER`` sections."""
    parts = []
    for number, (heading, body) in enumerate(sections(texts)):
        if number % SECTIONS_PER_CHAPTER == 0:
            parts.append(f"<h2>第{number // SECTIONS_PER_CHAPTER + 1}章</h2>")
        parts.append(f"<h3>{heading}</h3>" + "".join(f"<p>{text}</p>" for text in body))
    contents = "".join(f"<li><a href='#s{i}'>{heading}</a></li>" for i, (heading, _) in enumerate(sections(texts)))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<nav class='menu'><a href='/'>首页</a><a href='/docs'>文档</a></nav>"
            f"<div id='toc' class='sidebar'><ul>{contents}</ul></div>"
            f"<main><h1>{title}</h1><p>本手册说明系统的安装与使用。</p>{''.join(parts)}</main>"
            f"<footer>版权所有 © 手册编写组</footer></body></html>")


def write_manuals(folder: Path, per_manual: int = 400) -> list[Path]:
    """Two single-page manuals of ``per_manual`` paragraphs each (different text) in the new ``folder``."""
    folder.mkdir(parents=True)
    written = []
    for index, title in enumerate(("安装手册", "用户手册")):
        path = folder / f"manual-{index + 1}.html"
        path.write_text(single_page_manual(title, paragraphs(index * per_manual, per_manual)), encoding="utf-8")
        written.append(path)
    return written
