"""Cleaning rules, one by one."""

from __future__ import annotations

import random

import pytest

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


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, True), (False, True, False), (True, True, False),
                                   (False, False, True)])
def test_vectorised_batch_cleaning_equals_the_regular_expression_rules(flags):
    nfkc, control, whitespace = flags
    cleaner = Cleaner(CleaningConfig(nfkc=nfkc, strip_control=control, normalize_whitespace=whitespace))
    rng = random.Random(sum(flags))
    # Characters the tables handle, and ones that send a document to the exact slow path.
    simple = list("中文，。（）ＡＢ１２ \t\n\r\u3000\xa0\x0b\x0c\x1c\x85\u2028\u2029\u200b\ufeff\x00\x07\x7f"
                  "\x9f①\ue001abc…℃Ⅱ⑵㎏¼‥㍻") + ["\r\n", "\n\n\n", "  ", " \n \n "]
    tricky = list("e\u0301\u1100\u1161가ﬁ㈱😀𝐀")

    def doc() -> str:
        chars = [rng.choice(simple) for _ in range(rng.randrange(0, 40))]
        if chars and rng.random() < 0.05:
            chars[rng.randrange(len(chars))] = rng.choice(tricky)
        return "".join(chars)

    docs = [doc() for _ in range(3000)] + people_daily_docs()
    assert cleaner.clean_batch(docs) == [cleaner.clean_one(d) for d in docs]
    with_escape = ["\x1b[31m红色\x1b[0m 文字", "普通  文字"]
    assert cleaner.clean_batch(with_escape) == [cleaner.clean_one(d) for d in with_escape]


def people_daily_docs() -> list[str]:
    from train_deploy.corpus.people_daily import strip_pos_tags
    from train_deploy.corpus.readers import people_daily_path

    return strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[:3000])


def test_every_bmp_character_cleans_alike_in_batch_and_alone_between_neighbours():
    cleaner = Cleaner(CleaningConfig())
    docs = [f"中{chr(cp)}a{chr(cp)}{chr(cp)} 1" for cp in range(0x10000) if not 0xD800 <= cp < 0xE000]
    assert cleaner.clean_batch(docs) == [cleaner.clean_one(d) for d in docs]


def test_unicode_tables_are_built_once_per_machine_and_rebuilt_from_a_bad_cache(tmp_path, monkeypatch):
    import numpy as np

    from train_deploy.corpus import cleaning

    built = {"control": cleaning._build_class_tables()[0], "space": cleaning._build_class_tables()[1],
             "mapping": cleaning._build_nfkc_tables()[0], "lengths": cleaning._build_nfkc_tables()[1]}

    def tables() -> dict:
        cleaning._tables.cache_clear()
        return cleaning._tables()

    def same(got: dict) -> bool:
        return all(np.array_equal(got[name], built[name]) and got[name].dtype == built[name].dtype for name in built)

    monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    try:
        assert same(tables())
        (stored,) = (tmp_path / "cache").iterdir()
        assert stored.name.startswith("unicode-tables-") and stored.stat().st_size == 1_245_184
        with monkeypatch.context() as m:  # the second process loads them
            m.setattr(cleaning, "_build_nfkc_tables", lambda: pytest.fail("rebuilt despite the cache"))
            assert same(tables())
        stored.write_bytes(stored.read_bytes()[:1000])  # torn or foreign file: rebuilt and replaced
        assert same(tables()) and stored.stat().st_size == 1_245_184
        monkeypatch.setenv("TRAIN_DEPLOY_CACHE_DIR", str(stored))  # not a folder: built, not cached
        assert same(tables())
    finally:
        cleaning._tables.cache_clear()
