"""Cleaning rules, one by one."""

from __future__ import annotations

from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CleaningConfig


def clean(text: str, **options) -> str:
    return Cleaner(CleaningConfig(**options))(text)


def test_nfkc_folds_full_width_latin_digits_and_spaces():
    assert clean("１９９８年　ＷＴＯ") == "1998年 WTO"
    assert clean("１９９８年", nfkc=False) == "１９９８年"


def test_control_characters_and_ansi_escapes_are_removed():
    assert clean("\x1b[31m红色\x1b[0m文字\x00\x07\u200b\ufeff完") == "红色文字完"
    assert clean("a\x1b[1;32mb", strip_control=False, normalize_whitespace=False) == "a\x1b[1;32mb"


def test_whitespace_is_normalised_but_paragraphs_are_kept():
    text = "  第一段\t\t有  空格  \r\n\r\n\r\n\n第二段\u3000结束 \n"
    assert clean(text) == "第一段 有 空格\n\n第二段 结束"


def test_traditional_to_simplified_is_optional():
    assert clean("漢語的資訊") == "漢語的資訊"
    assert clean("漢語的資訊", traditional_to_simplified=True) == "汉语的资讯"
