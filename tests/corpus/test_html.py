"""The web page reader: charsets (UTF-8, GBK declared and undeclared), main text only, bad pages per on_error, long
pages cut at their headings."""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.corpus import encode, read_all
from tests.helpers.manuals import write_manuals
from train_deploy.corpus.build import check_splits
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import CorpusError, ReadStats, iter_documents, plan_corpus
from train_deploy.handoffs import TokenManifest

ARTICLE = ["国务院常务会议部署进一步扩大内需。", "会议指出，要坚持稳中求进，推动经济持续健康发展。"]


def page(charset: str | None, title: str = "新闻标题") -> str:
    meta = f'<meta charset="{charset}">' if charset else ""
    return f"""<!DOCTYPE html><html><head>{meta}<title>网站名称</title>
<style>body {{ font-family: sans-serif; }}</style><script>var tracker = "点击统计";</script></head>
<body><header><div class="logo">新闻网</div></header>
<nav><ul><li><a href="/">首页</a></li><li><a href="/china">国内</a></li><li><a href="/world">国际</a></li></ul></nav>
<div id="breadcrumb"><a href="/">首页</a> &gt; 正文</div>
<article><h1>{title}</h1><p>{ARTICLE[0]}</p><p>{ARTICLE[1]}<br></p></article>
<div class="share-bar">分享到微博</div><aside>热门推荐</aside>
<footer>版权所有 1998 新闻网</footer><script>document.write("广告");</script></body></html>"""


def write_pages(folder: Path) -> None:
    folder.mkdir()
    (folder / "a_utf8.html").write_text(page("utf-8", "统一编码的页面"), encoding="utf-8")
    (folder / "b_gbk.htm").write_bytes(page("gbk", "国标编码的页面").encode("gbk"))
    (folder / "c_gb2312.html.gz").write_bytes(gzip.compress(page("gb2312", "压缩的页面").encode("gbk")))
    (folder / "d_undeclared.html").write_bytes(page(None, "没有声明编码的页面，内容是简体中文").encode("gbk"))
    (folder / "notes.txt").write_text("不是网页", encoding="utf-8")


def test_pages_in_utf8_and_gbk_give_their_main_text_without_navigation_scripts_or_footers(tmp_path):
    write_pages(tmp_path / "site")
    docs = read_all(ReaderConfig(source="html", paths=[str(tmp_path / "site")]))
    titles = ["统一编码的页面", "国标编码的页面", "压缩的页面", "没有声明编码的页面，内容是简体中文"]
    assert docs == ["\n".join([title, *ARTICLE]) for title in titles]


def test_an_undecodable_page_is_named_or_skipped_and_counted(tmp_path):
    (tmp_path / "good.html").write_text(page("utf-8"), encoding="utf-8")
    bad = tmp_path / "bad.html"
    bad.write_bytes(b'<meta charset="utf-8"><p>' + bytes([0xFF, 0xFE, 0x81, 0x9F, 0xC0]) * 300)
    reader = ReaderConfig(source="html", paths=[str(tmp_path)])
    with pytest.raises(CorpusError, match=f"^{bad}: cannot decode the page \\(tried utf-8; no charset detected\\)$"):
        read_all(reader)
    reader = ReaderConfig(source="html", paths=[str(tmp_path)], on_error="skip")
    stats = ReadStats()
    docs = [doc for chunk in plan_corpus(reader).chunks for doc in iter_documents(chunk, reader, stats)]
    assert len(docs) == 1 and stats.skipped == {"undecodable_page": 1}


def test_web_pages_encode_into_token_files(tmp_path, tiny_tokenizer):
    write_pages(tmp_path / "site")
    _, manifest = encode(tmp_path, tiny_tokenizer, reader={"source": "html", "paths": [str(tmp_path / "site")],
                                                          "max_bytes": None})
    assert manifest.input["chunks"] == 4 and manifest.documents.read == 4
    # The same article under other titles: two are near-duplicates of the first; the long title makes the last differ.
    assert manifest.documents.dropped["near_duplicate"] == 2 and manifest.documents.kept == 2


MANUAL = ("<html><body><nav class='menu'>首页 文档</nav><main><h1>安装手册</h1><p>本手册说明系统的安装。</p>"
          "<h2>第一章 准备</h2><h3>1.1 硬件</h3><p>需要一台电脑。</p><p>内存至少两千兆字节。</p>"
          "<div><h3>1.2 软件</h3>操作系统<b>最新版</b></div><h2>第二章 安装</h2><p>运行安装程序。</p></main>"
          "<footer>版权所有</footer></body></html>")
SECTIONS = ["安装手册\n本手册说明系统的安装。", "第一章 准备\n1.1 硬件\n需要一台电脑。\n内存至少两千兆字节。",
            "1.2 软件\n操作系统最新版", "第二章 安装\n运行安装程序。"]


@pytest.mark.parametrize(("split_chars", "expected"), [
    (20, SECTIONS),  # longer than 20 characters: one document per section, a bare chapter heading with its first
    (len("\n".join(SECTIONS)), ["\n".join(SECTIONS)]),  # not longer: the page is one document
    (None, ["\n".join(SECTIONS)]),  # never cut
])
def test_a_long_page_is_cut_before_its_headings_into_one_document_per_section(tmp_path, split_chars, expected):
    (tmp_path / "manual.html").write_text(MANUAL, encoding="utf-8")
    assert read_all(ReaderConfig(source="html", paths=[str(tmp_path)], html_split_chars=split_chars)) == expected


def _checked(tmp_path: Path, tokenizer, fraction: float, **reader) -> TokenManifest:
    """Two single-page manuals encoded and checked as a run with the default training batch checks them."""
    shutil.rmtree(tmp_path / "tokens", ignore_errors=True)
    _, manifest = encode(tmp_path, tokenizer, reader={"source": "html", "paths": [str(tmp_path / "manuals")],
                                                      "max_bytes": None, **reader},
                         encoding={"validation_fraction": fraction})
    return check_splits(manifest, window=129, validation_fraction=fraction, batch=8)


def test_two_single_page_manuals_give_a_validation_split_or_an_error_naming_what_works(tmp_path, tiny_tokenizer):
    write_manuals(tmp_path / "manuals")
    manifest = _checked(tmp_path, tiny_tokenizer, 0.2)  # the share docs/configuration.md gives a small site
    assert manifest.documents.read == 162 and manifest.splits["valid"].documents == 36

    with pytest.raises(CorpusError) as one_page_one_document:  # as before: two documents, none for validation
        _checked(tmp_path, tiny_tokenizer, 0.2, html_split_chars=None)
    assert str(one_page_one_document.value) == (
        "corpus.encoding.validation_fraction: 0.2 of the 2 documents put 0 documents (0 tokens) in the validation "
        "split, fewer tokens than one evaluation window of training.batch.seq_length + 1 = 129; 2 documents of 66185 "
        "tokens are too few to split: cut the pages at their headings, one document per section (--params "
        "corpus.reader.html_split_chars=1000), or give more text")
    assert _checked(tmp_path, tiny_tokenizer, 0.2, html_split_chars=1000).splits["valid"].documents == 36

    with pytest.raises(CorpusError, match=r"; set it to 0\.\d+ \(--params corpus\.encoding\.validation_fraction=") \
            as too_small:
        _checked(tmp_path, tiny_tokenizer, 0.001)
    suggested = float(re.search(r"validation_fraction=([0-9.]+)\)", str(too_small.value)).group(1))
    assert suggested == 0.02 and _checked(tmp_path, tiny_tokenizer, suggested).splits["valid"].tokens >= 8 * 128 + 1
