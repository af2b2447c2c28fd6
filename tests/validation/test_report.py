"""The data gate on held-out bad corpora: each kind is stopped, a good next night passes, and warn or force lets a bad
one through. The corpora are encoded by the corpus stage's own node with the session's tiny tokenizer (no
tokenizer training), their statistics read as the validation stage reads them."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from tests.corpus.test_build import encode
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_document_batches, plan_corpus
from train_deploy.validation.config import ValidationConfig
from train_deploy.validation.report import ValidationStopped, decide
from train_deploy.validation.statistics import CorpusStatistics, corpus_statistics

BOILERPLATE = ("本网站所有内容版权归人民日报社所有，未经书面授权不得转载、摘编或以其他方式使用。\n"
               "联系我们 | 网站地图 | 广告服务 | 招聘信息 | 法律声明 | 隐私政策\n"
               "京ICP备05068797号  违法和不良信息举报电话：010-65363263")


def people_daily(max_bytes: int) -> list[str]:
    """The first documents of People's Daily, about ``max_bytes`` of them, as the default reader reads them."""
    reader = ReaderConfig(max_bytes=max_bytes)
    return [text for chunk in plan_corpus(reader).chunks
            for batch in iter_document_batches(chunk, reader, ReadStats(), 512) for text in batch]


def english() -> list[str]:
    """Paragraphs of English prose: the docstrings of a few standard-library modules."""
    import argparse
    import collections
    import json as json_module
    import logging
    import subprocess
    import typing

    texts = [inspect.getdoc(obj) or "" for module in (argparse, collections, json_module, logging, subprocess, typing)
             for obj in [module, *vars(module).values()] if inspect.isclass(obj) or inspect.isfunction(obj)
             or inspect.ismodule(obj)]
    return [p for text in texts for p in re.split(r"\n\s*\n", text) if len(p) > 40]


def statistics(folder: Path, tokenizer, documents: list[str]) -> CorpusStatistics:
    """``documents`` written as a text file and encoded as the corpus stage does; their statistics."""
    folder.mkdir(parents=True)
    (folder / "corpus.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    _, manifest = encode(folder, tokenizer, reader={"source": "text", "paths": [str(folder / "corpus.txt")],
                                                    "max_bytes": None})
    return corpus_statistics(manifest, tokenizer)


@pytest.fixture(scope="module")
def nights(tmp_path_factory, tiny_tokenizer) -> dict[str, CorpusStatistics]:
    """The champion's corpus and five later nights: one more of the same kind and four held-out bad ones."""
    folder = tmp_path_factory.mktemp("nights")
    champion = people_daily(120_000)
    corpora = {
        "champion": champion,
        "good": people_daily(200_000),  # the next night: more documents of the same kind
        "truncated": champion[: len(champion) * 2 // 5],  # a half-empty dump
        "mojibake": [text.encode("gbk", errors="replace").decode("latin-1") for text in champion],
        "duplicated": champion + [BOILERPLATE] * 1000,  # a page of boilerplate, repeated
        "english": english(),
    }
    return {name: statistics(folder / name, tiny_tokenizer, texts) for name, texts in corpora.items()}


def _failing(nights: dict[str, CorpusStatistics], night: str, **config) -> list[str]:
    report = decide(nights[night], ("1", nights["champion"]), ValidationConfig(**config), "lm")
    return [finding.statistic for finding in report.failures]


def test_statistics_of_the_champions_corpus_describe_chinese_prose(nights):
    s = nights["champion"]
    assert s.documents_kept <= s.documents_read and s.characters > 15_000
    assert 0.8 < s.cjk_share < 1 and 0.3 < s.tokens_per_character < 1.5
    assert s.length_quantiles["p10"] < s.length_quantiles["p50"] < s.length_quantiles["p90"]
    assert 0 <= s.byte_fallback_rate < 0.1 and s.duplicate_share < 0.05  # the tiny tokenizer covers 98%
    assert json.loads(s.compact())["documents_read"] == s.documents_read  # the version's tag, compact
    assert CorpusStatistics.from_json(json.loads(json.dumps(s.to_json()))) == s


@pytest.mark.parametrize(("night", "expected"), [
    ("truncated", {"documents_kept", "characters"}),
    ("mojibake", {"cjk_share", "tokens_per_character"}),
    ("duplicated", {"duplicate_share", "drop_shares.duplicate"}),
    ("english", {"cjk_share", "byte_fallback_rate"}),
])
def test_each_kind_of_bad_corpus_is_stopped_naming_the_statistics_past_their_bounds(nights, night, expected):
    report = decide(nights[night], ("1", nights["champion"]), ValidationConfig(), "lm")
    assert report.outcome == "stopped"
    assert expected <= {finding.statistic for finding in report.failures}, report.block()
    stopped = ValidationStopped(report)
    assert "\n" not in str(stopped) and "lm version 1" in str(stopped)
    line = report.block().splitlines()[1]  # each failing statistic: both values and the bound, naming its key
    assert "champion" in line or "tonight" in line
    assert "(validation.max_" in line


def test_a_good_next_night_with_more_documents_of_the_same_kind_passes(nights):
    report = decide(nights["good"], ("1", nights["champion"]), ValidationConfig(), "lm")
    assert report.outcome == "passed", report.block()
    assert nights["good"].documents_kept > nights["champion"].documents_kept


def test_warn_mode_and_retrain_force_let_a_bad_night_through_with_the_report(nights):
    warned = decide(nights["english"], ("1", nights["champion"]), ValidationConfig(mode="warn"), "lm")
    forced = decide(nights["english"], ("1", nights["champion"]), ValidationConfig(), "lm", force=True)
    assert (warned.outcome, forced.outcome) == ("warned", "warned")
    assert "validation.mode: warn" in warned.reason and "retrain.force: true" in forced.reason
    assert warned.failures == forced.failures != []


def test_without_a_champion_or_its_statistics_nothing_is_compared(nights):
    first = decide(nights["english"], None, ValidationConfig(), "lm")
    older = decide(nights["english"], ("4", None), ValidationConfig(), "lm")
    assert (first.outcome, older.outcome) == ("not_compared", "not_compared")
    assert first.reason == "Corpus statistics recorded; nothing compared: lm has no champion yet"
    assert "version 4 (champion) records none" in older.reason and older.failures == []


def test_a_bound_set_to_null_is_not_checked(nights):
    assert _failing(nights, "truncated", max_documents_decrease=None, max_characters_decrease=None) == []
