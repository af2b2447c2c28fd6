"""The web page reader: charsets (UTF-8, GBK declared and undeclared), main text only, bad pages per on_error."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tests.helpers.corpus import encode, read_all
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import CorpusError, ReadStats, iter_documents, plan_corpus

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
