"""Quality filters: each rule drops what it should and is counted by reason; the output stays deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.corpus import ALL_ON, CASES, encode, output_bytes, random_chinese
from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.filters import QualityFilter, repeated_line_share

CHINESE = "中国人民银行今天宣布，从下月起调整部分存款利率，以支持实体经济的稳定发展。"


def test_each_rule_drops_its_document_and_names_its_reason():
    quality = QualityFilter(CleaningConfig(**ALL_ON))
    texts = [CHINESE, *CASES.values(), CHINESE + "\n今天的天气很好。"]
    assert quality.reasons(texts) == [None, *CASES, None]


def test_rules_are_off_at_their_neutral_values():
    off = QualityFilter(CleaningConfig(min_chars=0, max_chars=None, min_cjk_share=0.0, max_repeated_line_share=1.0,
                                       max_repeated_ngram_share=1.0, max_symbol_share=1.0))
    assert off.reasons(list(CASES.values())) == [None] * len(CASES)


def test_batch_results_do_not_depend_on_the_neighbours():
    quality = QualityFilter(CleaningConfig(**ALL_ON))
    texts = [*CASES.values(), CHINESE] * 3
    together = quality.reasons(texts)
    assert together == [quality.reasons([t])[0] for t in texts]
    # The same n-gram in two documents is not a repetition inside either.
    twins = ["欢迎光临本店铺，" + CHINESE, "欢迎光临本店铺，" + CHINESE]
    assert quality.reasons(twins) == [None, None]


def test_repeated_line_share_counts_characters_of_lines_seen_twice():
    assert repeated_line_share("甲乙丙\n甲乙丙\n丁") == pytest.approx(6 / 7)
    assert repeated_line_share("一行\n\n另一行") == 0.0


def test_every_filter_on_is_counted_in_the_manifest_and_identical_for_one_and_two_workers(tmp_path, tiny_tokenizer):
    keep = random_chinese(300, 400)
    near = [text[:200] + "的" + text[201:] for text in keep[:20]]  # one character changed
    drops = [text for text in CASES.values() for _ in range(3)] + near
    path = tmp_path / "mixed.txt"
    mixed = [t for pair in zip(keep, drops + [""] * (300 - len(drops)), strict=True) for t in pair if t]
    path.write_text("\n\n".join(mixed) + "\n", encoding="utf-8")
    outputs = []
    for workers in (1, 2):
        _, manifest = encode(tmp_path / f"w{workers}", tiny_tokenizer, cleaning=ALL_ON,
                             encoding={"workers": workers},
                             reader={"source": "text", "paths": [str(path)], "chunk_bytes": 16384, "max_bytes": None})
        assert manifest.input["chunks"] > 2 and manifest.workers == workers
        assert manifest.documents.dropped == {**{reason: 3 for reason in CASES}, "duplicate": 0, "near_duplicate": 19,
                                              "near_duplicate_of_training": 1}  # a validation one: a training twin
        assert manifest.documents.kept == 300 and manifest.documents.read == 300 + len(drops)
        outputs.append(output_bytes(Path(manifest.path)))
    assert outputs[0] == outputs[1]
