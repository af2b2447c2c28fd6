"""Readers: every source, chunking at document boundaries, and streaming."""

from __future__ import annotations

import bz2
import gzip
import json
import os
from pathlib import Path

import pytest
import zstandard

from tests.helpers.corpus import multistream_dump, sample_pages, wiki_dump
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_documents, people_daily_path, plan_corpus


def read_all(reader: ReaderConfig) -> list[str]:
    plan = plan_corpus(reader)
    return [doc for chunk in plan.chunks for doc in iter_documents(chunk, reader, ReadStats())]


def blank_line_corpus(n: int) -> str:
    return "".join(f"第{i}篇文章的第一行。\n  第二行 line {i}\n\n\n" for i in range(n))


def test_text_blank_line_documents_are_blocks_between_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("甲一\n甲二\n\n乙一\n   \n\n丙一\r\n丙二\r\n", encoding="utf-8")
    docs = read_all(ReaderConfig(source="text", paths=[str(tmp_path / "a.txt")]))
    assert docs == ["甲一\n甲二", "乙一", "丙一\n丙二"]


@pytest.mark.parametrize("split", ["blank_line", "line"])
def test_small_chunks_read_the_same_documents_as_one_chunk(tmp_path, split):
    path = tmp_path / "big.txt"
    path.write_text(blank_line_corpus(3000), encoding="utf-8")
    whole = read_all(ReaderConfig(source="text", paths=[str(path)], document_split=split, chunk_bytes=1 << 30))
    reader = ReaderConfig(source="text", paths=[str(path)], document_split=split, chunk_bytes=4096)
    plan = plan_corpus(reader)
    assert len(plan.chunks) > 10
    assert [c.start for c in plan.chunks[1:]] == [c.end for c in plan.chunks[:-1]]
    assert read_all(reader) == whole
    assert len(whole) == (3000 if split == "blank_line" else 6000)


def test_text_line_and_file_modes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_text("第一行\n\n第二行\n", encoding="utf-8")
    (tmp_path / "d" / "2.txt").write_text("另一个文件\n", encoding="utf-8")
    lines = read_all(ReaderConfig(source="text", paths=[str(tmp_path / "d")], document_split="line"))
    assert lines == ["第一行", "第二行", "另一个文件"]
    files = read_all(ReaderConfig(source="text", paths=[str(tmp_path / "d" / "*.txt")], document_split="file"))
    assert files == ["第一行\n\n第二行\n", "另一个文件\n"]


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".zst"])
def test_jsonl_reads_the_configured_field_plain_and_compressed(tmp_path, suffix):
    records = [{"id": i, "content": f"文档{i}：今天天气很好。"} for i in range(50)]
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path = tmp_path / f"corpus.jsonl{suffix}"
    opener = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress,
              ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}[suffix]
    path.write_bytes(opener(data))
    docs = read_all(ReaderConfig(source="jsonl", paths=[str(path)], text_field="content", chunk_bytes=4096))
    assert docs == [r["content"] for r in records]


WIKI_ARTICLE = (
    "{{Infobox 城市|名称=北京}}'''北京市'''是[[中华人民共和国]]的[[首都|首都城市]]。"
    "&lt;ref&gt;来源&lt;/ref&gt;\n== 历史 ==\n北京有三千多年历史。[[File:Beijing.jpg|thumb|天安门]]\n"
    "* -{zh-hans:简体;zh-hant:繁體}-名称\n[[Category:城市]]"
)


def test_wiki_dump_is_streamed_and_stripped_to_plain_text(tmp_path):
    path = tmp_path / "zhwiki-pages-articles.xml.bz2"
    path.write_bytes(bz2.compress(wiki_dump([
        (0, "北京市", WIKI_ARTICLE),
        (0, "北平", "#REDIRECT [[北京市]]"),
        (4, "Wikipedia:关于", "项目页面不是条目。"),
        (0, "上海市", "'''上海市'''，简称'''沪'''。"),
    ])))
    docs = read_all(ReaderConfig(source="wiki_xml", paths=[str(path)]))
    assert docs == ["北京市是中华人民共和国的首都城市。\n历史\n北京有三千多年历史。\n简体名称\n", "上海市，简称沪。"]


@pytest.mark.parametrize("form", ["multistream .xml.bz2", "plain .xml"])
def test_a_large_wiki_dump_is_cut_into_chunks_that_read_like_the_whole(tmp_path, form):
    pages = sample_pages(300)
    whole = tmp_path / "whole.xml.bz2"
    whole.write_bytes(bz2.compress(wiki_dump(pages)))  # one bz2 stream: cannot be entered, one chunk
    path = tmp_path / ("dump.xml.bz2" if form.startswith("multi") else "dump.xml")
    path.write_bytes(multistream_dump(pages, 10) if form.startswith("multi") else wiki_dump(pages))
    reader = ReaderConfig(source="wiki_xml", paths=[str(path)], chunk_bytes=4096)
    plan = plan_corpus(reader)
    assert len(plan_corpus(ReaderConfig(source="wiki_xml", paths=[str(whole)], chunk_bytes=4096)).chunks) == 1
    assert len(plan.chunks) >= 3 and plan.chunks[0].start == 0 and plan.chunks[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(plan.chunks, plan.chunks[1:], strict=False))
    expected = read_all(ReaderConfig(source="wiki_xml", paths=[str(whole)]))
    assert len(expected) == 240 and read_all(reader) == expected
    # max_bytes (a sample of the corpus) reads the dump from its start, as one chunk
    assert len(plan_corpus(ReaderConfig(source="wiki_xml", paths=[str(path)], chunk_bytes=4096,
                                        max_bytes=10_000)).chunks) == 1


def test_people_daily_strips_pos_tags_and_groups_lines():
    head = people_daily_path().read_text(encoding="utf-8").splitlines()[:4]
    single = read_all(ReaderConfig(max_bytes=2000))
    assert single[0] == "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）"  # cleaning (NFKC) comes later
    assert "/" not in "".join(single) and "  " not in "".join(single)
    assert len(single) >= 4 and head[1].startswith("中共中央/nt")
    grouped = read_all(ReaderConfig(max_bytes=2000, lines_per_document=2))
    assert grouped[0] == single[0] + "\n" + single[1]


def test_max_bytes_limits_what_is_read(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text(blank_line_corpus(2000), encoding="utf-8")
    full = read_all(ReaderConfig(source="text", paths=[str(path)]))
    part = read_all(ReaderConfig(source="text", paths=[str(path)], max_bytes=10_000, chunk_bytes=4096))
    assert 0 < len(part) < len(full) and full[: len(part)] == part


def test_fingerprint_changes_with_content(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("一些文字\n", encoding="utf-8")
    reader = ReaderConfig(source="text", paths=[str(path)])
    first = plan_corpus(reader).input_hash
    assert plan_corpus(reader).input_hash == first
    path.write_text("另一些文字\n", encoding="utf-8")
    assert plan_corpus(reader).input_hash != first


def test_glob_and_folder_inputs_are_sorted_and_deduplicated(tmp_path):
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text(f"{name}\n", encoding="utf-8")
    plan = plan_corpus(ReaderConfig(source="text", paths=[str(tmp_path), str(tmp_path / "*.txt")]))
    assert [Path(f).name for f in plan.files] == ["a.txt", "b.txt"]


def _bytes_read() -> int:
    """Bytes this process has read through read() calls so far (the kernel's count, /proc/self/io)."""
    with open("/proc/self/io", encoding="ascii") as io_counts:
        return int(next(line for line in io_counts if line.startswith("rchar:")).split()[1])


def test_planning_unchanged_inputs_again_reads_nothing_and_a_changed_file_is_read_again(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text(blank_line_corpus(20_000), encoding="utf-8")  # ~0.9 MB
    size, reader = corpus.stat().st_size, ReaderConfig(source="text", paths=[str(corpus)], chunk_bytes=65536)
    fresh = plan_corpus(reader)  # written just now: its times are not trusted yet, so the plan is not kept
    before = _bytes_read()
    assert plan_corpus(reader) == fresh and _bytes_read() - before >= size
    past = corpus.stat().st_mtime_ns - 10 * 10**9
    os.utime(corpus, ns=(past, past))  # settled ten seconds ago
    first = plan_corpus(reader)
    before = _bytes_read()
    assert plan_corpus(reader) == first and _bytes_read() - before < size // 100  # a lookup, not a second read
    data = corpus.read_bytes()
    corpus.write_bytes(data.replace("第1篇".encode(), "第9篇".encode(), 1))  # same size, same modification time
    os.utime(corpus, ns=(past, past))
    changed = plan_corpus(reader)
    assert changed.input_hash != first.input_hash and changed.input_bytes == size  # the change time told
