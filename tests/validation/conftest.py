"""Held-out nights for the data gate: the champion's corpus (People's Daily), a next night with more of it, and four
bad ones (truncated, GBK read as latin-1, boilerplate repeated, English), each encoded by the corpus stage's own node
with the session's tiny tokenizer (no tokenizer training) and read as the validation stage reads it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.helpers.corpus import encode
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_document_batches, plan_corpus
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


@pytest.fixture(scope="session")
def night_texts() -> dict[str, list[str]]:
    """The champion's corpus and five later nights: one more of the same kind and four held-out bad ones."""
    champion = people_daily(120_000)
    return {
        "champion": champion,
        "good": people_daily(200_000),  # the next night: more documents of the same kind
        "truncated": champion[: len(champion) * 2 // 5],  # a half-empty dump
        "mojibake": [text.encode("gbk", errors="replace").decode("latin-1") for text in champion],
        "duplicated": champion + [BOILERPLATE] * 1000,  # a page of boilerplate, repeated
        "english": english(),
    }


@pytest.fixture(scope="session")
def nights(tmp_path_factory, tiny_tokenizer, night_texts) -> dict[str, CorpusStatistics]:
    """The statistics of each of :func:`night_texts`."""
    folder = tmp_path_factory.mktemp("nights")
    return {name: statistics(folder / name, tiny_tokenizer, texts) for name, texts in night_texts.items()}
