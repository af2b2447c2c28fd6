"""Documents separated by marker lines (`document_split: separator`) and WikiExtractor's `<doc>` blocks."""

from __future__ import annotations

import pytest

from tests.helpers.corpus import read_all
from train_deploy.config import ConfigError
from train_deploy.corpus.config import CorpusConfig, ReaderConfig
from train_deploy.corpus.readers import plan_corpus


def test_percent_marker_lines_end_documents_and_are_dropped(tmp_path):
    path = tmp_path / "fortunes.txt"
    path.write_text("第一条。\n\n第一条的第二段。\n%\n第二条\n%\n%\n  \n第三条\n50% 不是分隔行\n", encoding="utf-8")
    docs = read_all(ReaderConfig(source="text", paths=[str(path)], document_split="separator", separator="%"))
    assert docs == ["第一条。\n\n第一条的第二段。", "第二条", "第三条\n50% 不是分隔行"]


def test_wiki_extractor_doc_blocks_are_documents_without_their_tags(tmp_path):
    path = tmp_path / "wiki_00"
    url = "https://zh.wikipedia.org/wiki?curid="
    path.write_text(f'<doc id="1" url="{url}1" title="数学">\n数学\n\n数学是研究数量的学科。\n</doc>\n'
                    f'<doc id="2" url="{url}2" title="物理">\n物理\n\n物理学研究物质。\n</doc>\n', encoding="utf-8")
    docs = read_all(ReaderConfig(source="text", paths=[str(path)], document_split="wiki_extractor"))
    assert docs == ["数学\n\n数学是研究数量的学科。", "物理\n\n物理学研究物质。"]


@pytest.mark.parametrize(("split", "separator", "marker"), [("separator", "-{4,}", "----"),
                                                            ("wiki_extractor", None, "</doc>\n<doc id=\"x\">")])
def test_small_chunks_cut_after_separator_lines_and_read_the_same_documents(tmp_path, split, separator, marker):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"第{i}篇。\n\n第{i}篇第二段。\n{marker}\n" for i in range(2000)), encoding="utf-8")
    whole = read_all(ReaderConfig(source="text", paths=[str(path)], document_split=split, separator=separator,
                                  chunk_bytes=1 << 30))
    reader = ReaderConfig(source="text", paths=[str(path)], document_split=split, separator=separator, chunk_bytes=4096)
    assert len(plan_corpus(reader).chunks) > 10
    assert read_all(reader) == whole
    assert len(whole) == 2000 and whole[7] == "第7篇。\n\n第7篇第二段。"


@pytest.mark.parametrize(("reader", "message"), [
    ({"source": "text", "paths": ["x"], "document_split": "separator"}, "needs a separator regular expression"),
    ({"source": "text", "paths": ["x"], "separator": "%"}, "only document_split: separator"),
    ({"source": "text", "paths": ["x"], "document_split": "separator", "separator": "(%"}, "is not a regular expr"),
    ({"source": "text", "paths": ["x"], "document_split": "separator", "separator": "%*"}, "matches an empty line"),
])
def test_bad_separator_is_refused_naming_the_key(reader, message):
    with pytest.raises(ConfigError, match=f"^corpus.reader.separator: .*{message}"):
        CorpusConfig.from_params({"reader": reader})
