"""Held-out nights for the data gate: the champion's corpus (People's Daily), a next night with more of it, and four
bad ones (truncated, GBK read as latin-1, boilerplate repeated, English), each encoded by the corpus stage's own node
with the session's tiny tokenizer (no tokenizer training) and read as the validation stage reads it."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.corpus import encode
from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_document_batches, plan_corpus
from train_deploy.handoffs import TokenizerInfo, TokenManifest
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


# --- a champion that has learnt something (issue 39) ------------------------------------------------------------
# The session's tiny bundle (6 steps) is close to uniform: it scores shuffled characters as it scores the text
# (measured: +28% against +20-25% for good slices, whose rarer characters its 98%-coverage tokenizer spells in
# bytes). The content checks need a model that knows which character follows which: this one trains the tiny preset
# for CHAMPION_STEPS steps on the first CHAMPION_BYTES of People's Daily, with a tokenizer covering 99.95% of it.

CHAMPION_BYTES = 2_000_000
CHAMPION_STEPS = 600


@dataclass(frozen=True)
class Champion:
    """A trained champion: its bundle folder, the token files it was trained on, and their tokenizer."""

    bundle: Path
    token_files: TokenManifest
    tokenizer: TokenizerInfo


@pytest.fixture(scope="session")
def champion(tmp_path_factory) -> Champion:
    """The tiny preset trained for :data:`CHAMPION_STEPS` steps on :data:`CHAMPION_BYTES` of People's Daily and
    exported through the export node (about a minute)."""
    from tests.helpers.export import export_params, selected, training_logs
    from tests.helpers.project import corpus_params, publish
    from tests.helpers.training import launch, training_params
    from train_deploy.handoffs import Bundle, DataSpec
    from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs, prepare_tokenizer
    from train_deploy.pipelines.export.nodes import export_model

    folder = tmp_path_factory.mktemp("champion")
    params = corpus_params(reader={"max_bytes": CHAMPION_BYTES}, tokenizer={"character_coverage": 0.9995},
                           encoding={"validation_fraction": 0.05})
    tokenizer = publish(prepare_tokenizer(*plan_inputs(params)), folder / "tokenizer", TokenizerInfo)
    config, plan = plan_inputs(params)
    token_files = publish(encode_tokens(config, plan, tokenizer), folder / "tokens", TokenManifest)
    run = launch(folder / "run", DataSpec.of(token_files), training_params(
        1, batch={"seq_length": 64}, schedule={"max_steps": CHAMPION_STEPS, "eval_every": CHAMPION_STEPS,
                                               "checkpoint_every": CHAMPION_STEPS, "log_every": 50}))
    logs = training_logs(folder / "logs", run)
    work, _ = export_model(export_params(), selected(Path(run.checkpoint)), tokenizer, token_files, run, logs)
    bundle = publish(work, folder / "bundles" / "bundle", Bundle, versions=True)
    return Champion(Path(bundle.path), token_files, tokenizer)
