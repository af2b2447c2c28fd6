"""The manual page reader: troff rendered by groff where installed, else its requests stripped; real pages too."""

from __future__ import annotations

import difflib
import gzip
import shutil
from pathlib import Path

import pytest

from tests.helpers.corpus import read_all
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.errors import CorpusError
from train_deploy.corpus.man import decode_page, find_renderer, man_text
from train_deploy.corpus.readers import ReadStats, iter_documents, plan_corpus

# Modelled on manpages-zh's pages (po4a translations of man-db and shadow): comments, strings, po4a's
# conditionals, font escapes, tagged paragraphs, a no-fill block and a tbl table.
LS_1 = r""".\" 本页由 manpages-zh 项目翻译
.\"*******************************************************************
.pc ""
.ie \n(.g .ds Aq \(aq
.el       .ds Aq '
.TH LS 1 "2024年1月" "GNU coreutils 9.4" 用户命令
.SH 名称
ls \- 列出目录内容
.SH 概述
\fBls\fP [\fI选项\fP]... [\fI文件\fP]...
.SH 描述
.\" 这一段是描述
列出 \fI文件\fP（默认为当前目录）的信息。
如果既没有指定 \fB\-cftuvSUX\fP 也没有指定
\fB\-\-sort\fP，则按字母顺序排列条目。
.PP
长选项必须使用的参数对于短选项也是必须使用的\(em例如 \fB\-w\fP。
.TP
\fB\-a\fR, \fB\-\-all\fR
不隐藏任何以 . 开始的项目
.TP
.if  !'po4a'hide' .BR \-A ", " \-\-almost\-all
列出除 . 及 .. 以外的任何项目
.SS 退出状态
.TS
tab (@);
l lx.
0@T{
正常。
T}
1@T{
小问题（如：无法访问子文件夹）。
T}
.TE
.SH 示例
.nf
ls \-l /etc
ls \-\-color=auto
.fi
.SH 参见
\fBdir\fP(1)，\fBvdir\fP(1)，完整文档：\*(Aqinfo coreutils\*(Aq
"""

STRIPPED = [
    "名称", "ls - 列出目录内容",
    "概述", "ls [选项]... [文件]...",
    "描述", "列出 文件（默认为当前目录）的信息。如果既没有指定 -cftuvSUX 也没有指定 --sort，则按字母顺序排列条目。",
    "长选项必须使用的参数对于短选项也是必须使用的—例如 -w。",
    "-a, --all", "不隐藏任何以 . 开始的项目",
    "-A, --almost-all", "列出除 . 及 .. 以外的任何项目",
    "退出状态", "0 正常。", "1 小问题（如：无法访问子文件夹）。",
    "示例", "ls -l /etc", "ls --color=auto",
    "参见", "dir(1)，vdir(1)，完整文档：'info coreutils'",
]
ZH_CN = Path("/usr/share/man/zh_CN")
no_groff = pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed (Debian: groff-base)")


def test_without_a_renderer_the_requests_and_escapes_are_stripped_to_the_text_they_print():
    assert man_text(LS_1, None).splitlines() == STRIPPED


@no_groff
def test_groff_renders_the_same_text_without_its_header_and_footer():
    rendered = man_text(LS_1, "groff").splitlines()
    assert rendered[:4] == STRIPPED[:4] and rendered[-2:] == STRIPPED[-2:]  # no "LS(1) … LS(1)" lines
    assert difflib.SequenceMatcher(None, "\n".join(rendered), "\n".join(STRIPPED), autojunk=False).ratio() > 0.95
    assert not [line for line in rendered if line.startswith((".", "'")) or "\\f" in line or "\x08" in line]


def test_a_page_that_only_includes_another_is_no_document():
    assert man_text('.\\" alias\n.so man1/ls.1\n', None) == ""


@no_groff
@pytest.mark.skipif(not ZH_CN.is_dir(), reason="no Chinese manual pages installed (Debian: manpages-zh)")
def test_real_chinese_pages_stripped_read_as_groff_renders_them():
    pages = sorted(ZH_CN.glob("man*/*.gz"))[:12]
    for page in pages:
        source = decode_page(gzip.decompress(page.read_bytes()))
        rendered, stripped = man_text(source, "groff"), man_text(source, None)
        similarity = difflib.SequenceMatcher(None, rendered, stripped, autojunk=False).ratio()
        assert similarity > 0.95, (page, similarity)
        markup = {line for line in stripped.splitlines() if line[:1] in ".'" or "\\f" in line}
        assert markup <= set(rendered.splitlines()), page  # only what the page prints (lexgrog's examples)


def test_the_man_reader_takes_pages_from_a_folder_one_document_each(tmp_path):
    pages = tmp_path / "man" / "zh_CN" / "man1"
    pages.mkdir(parents=True)
    (pages / "ls.1.gz").write_bytes(gzip.compress(LS_1.encode("utf-8")))
    (pages / "dir.1.gz").write_bytes(gzip.compress(b".so man1/ls.1\n"))
    (pages / "vdir.1").write_bytes(LS_1.replace("ls", "vdir").encode("gb18030"))  # an older page in GB2312
    (pages / "README").write_text("不是手册页", encoding="utf-8")
    reader = ReaderConfig(source="man", paths=[str(tmp_path / "man")], man_renderer="strip")
    assert [Path(file).name for file in plan_corpus(reader).files] == ["dir.1.gz", "ls.1.gz", "vdir.1"]
    assert read_all(reader) == ["\n".join(STRIPPED), "\n".join(STRIPPED).replace("ls", "vdir")]


@no_groff
def test_the_renderer_is_part_of_the_corpus_fingerprint(tmp_path):
    (tmp_path / "ls.1").write_text(LS_1, encoding="utf-8")
    hashes = {choice: plan_corpus(ReaderConfig(source="man", paths=[str(tmp_path)], man_renderer=choice)).input_hash
              for choice in ("strip", "groff")}
    assert hashes["strip"] != hashes["groff"]


def test_an_unreadable_page_is_bad_input_and_a_missing_renderer_names_the_key(tmp_path, monkeypatch):
    bad = tmp_path / "bad.1"
    bad.write_bytes(b".TH BAD 1\n\xff\xfe\xff not text\n")
    reader = ReaderConfig(source="man", paths=[str(bad)], man_renderer="strip", on_error="skip")
    [chunk] = plan_corpus(reader).chunks
    stats = ReadStats()
    assert list(iter_documents(chunk, reader, stats)) == []
    assert stats.skipped == {"unreadable_man_page": 1} and stats.warnings == [f"{bad}: not UTF-8 or GB18030 text"]

    monkeypatch.setenv("PATH", str(tmp_path))  # neither groff nor mandoc there
    find_renderer.cache_clear()
    try:
        assert find_renderer("auto") is None
        with pytest.raises(CorpusError, match=r"^corpus\.reader\.man_renderer: mandoc is not installed \(on Debian: "
                                              r"apt-get install mandoc\); auto falls back to strip$"):
            find_renderer("mandoc")
    finally:
        find_renderer.cache_clear()


@no_groff
def test_the_corpus_stage_chooses_the_renderer_once_for_every_worker(tmp_path):
    from tests.helpers.project import corpus_params
    from train_deploy.pipelines.corpus.nodes import plan_inputs

    (tmp_path / "ls.1").write_text(LS_1, encoding="utf-8")
    config, _ = plan_inputs(corpus_params(reader={"source": "man", "paths": [str(tmp_path)]}))
    assert config.reader.man_renderer == "groff"  # not auto: what workers here and on other nodes use
