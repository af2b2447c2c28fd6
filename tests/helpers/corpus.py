"""Corpus test helpers: encoding the tiny slice, reading documents back, made-up inputs."""

from __future__ import annotations

import bz2
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.helpers.project import corpus_params, publish
from train_deploy.corpus.config import CorpusConfig, ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_documents, plan_corpus
from train_deploy.corpus.tokenizer import SP_MODEL_FILE
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs


def encode(tmp_path: Path, tokenizer: TokenizerInfo, **blocks) -> tuple[CorpusConfig, TokenManifest]:
    """Run the encoding node and publish its work at ``tmp_path/tokens`` as the catalog does."""
    config, plan = plan_inputs(corpus_params(**blocks))
    return config, publish(encode_tokens(config, plan, tokenizer), tmp_path / "tokens", TokenManifest)


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".idx")}


# Every filter on, with thresholds that the documents below cross one rule at a time.
ALL_ON = {"min_chars": 8, "max_chars": 1000, "min_cjk_share": 0.3, "max_repeated_line_share": 0.3,
          "max_repeated_ngram_share": 0.4, "repetition_ngram": 6, "max_symbol_share": 0.4}


CASES = {
    "too_short": "太短了",
    "too_long": "".join(chr(0x4E00 + i * 7 % 3000) for i in range(1200)),
    "low_cjk_share": "The quick brown fox jumps over the lazy dog, 中文。",
    "repeated_lines": "点击这里订阅本报\n今日要闻，经济形势稳中向好。\n点击这里订阅本报\n点击这里订阅本报",
    "repeated_ngrams": "欢迎光临本店铺欢迎光临本店铺欢迎光临本店铺欢迎光临本店铺，谢谢。",
    "symbol_share": "二零二四年价格表：１２３４５６ 789012 ＄＄＄ 新品上市",
}


def random_chinese(count: int, length: int, seed: int = 0) -> list[str]:
    """Distinct documents of common CJK characters in no order: nothing repeats, nothing is a near-duplicate."""
    rng = random.Random(seed)
    return ["".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(length)) + "。" for _ in range(count)]


def read_all(reader: ReaderConfig) -> list[str]:
    plan = plan_corpus(reader)
    return [doc for chunk in plan.chunks for doc in iter_documents(chunk, reader, ReadStats())]


def wiki_dump(pages: list[tuple[int, str, str]]) -> bytes:
    body = "".join(
        f"<page><title>{title}</title><ns>{ns}</ns><id>{i}</id><revision><id>{i}</id>"
        f"<text xml:space=\"preserve\">{text}</text></revision></page>"
        for i, (ns, title, text) in enumerate(pages)
    )
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="zh">'
           f"<siteinfo><sitename>维基百科</sitename></siteinfo>{body}</mediawiki>")
    return xml.encode("utf-8")


def multistream_dump(pages: list[tuple[int, str, str]], per_stream: int) -> bytes:
    """The dump as Wikipedia's multistream .xml.bz2: header, ``per_stream`` pages per bz2 stream, footer."""
    xml = wiki_dump(pages).decode()
    head, _, rest = xml.partition("<page>")
    parts = ["<page>" + p for p in rest.removesuffix("</mediawiki>").split("<page>")]
    groups = [head] + ["".join(parts[i : i + per_stream]) for i in range(0, len(parts), per_stream)] + ["</mediawiki>"]
    return b"".join(bz2.compress(g.encode()) for g in groups)


def sample_pages(n: int) -> list[tuple[int, str, str]]:
    return [(4 if i % 5 == 4 else 0, f"条目{i}", f"'''条目{i}'''是[[测试]]条目，{'内容' * (40 + i % 9)}。")
            for i in range(n)]


GOOD = "".join(f"第{i}篇正常的文档，内容足够长。\n\n" for i in range(30))


def stopped_mid_chunk(deadline: float, candidates: Callable[[], list[psutil.Process]], marker: str,
                      shard: re.Pattern) -> tuple[psutil.Process, int]:
    """Find a process among ``candidates()`` whose command line holds ``marker`` and stop it (SIGSTOP) while it
    has a shard file open (``shard`` matches its path, group 1 the chunk); return it and the chunk."""
    while time.monotonic() < deadline:
        for process in candidates():
            try:
                if marker not in " ".join(process.cmdline()):
                    continue  # e.g. multiprocessing's resource tracker
                process.send_signal(signal.SIGSTOP)
                chunks = [int(m[1]) for f in process.open_files() if (m := shard.search(f.path))]
                if chunks:
                    return process, chunks[0]
                process.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.002)
    pytest.fail(f"no process with {marker!r} was seen encoding a chunk")


RAW = "１９９８年，中国经济（ＧＤＰ）增长。"


CLEANED = "1998年，中国经济（GDP）增长。"


def drop_record(folder: Path) -> None:
    """Make the tokenizer folder ``folder`` one saved before the policy was recorded: SentencePiece's identity
    normaliser, no rules."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((folder / SP_MODEL_FILE).read_bytes())
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.ClearField("precompiled_charsmap")
    (folder / SP_MODEL_FILE).write_bytes(proto.SerializeToString())
