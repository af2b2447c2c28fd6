"""Cleaning rules, one by one."""

from __future__ import annotations

import random

import numpy as np
import pytest

from train_deploy.corpus import cleaning, native
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CleaningConfig


def clean(text: str, **options) -> str:
    return Cleaner(CleaningConfig(**options))(text)


def test_nfkc_folds_full_width_latin_digits_and_spaces():
    assert clean("１９９８年　ＷＴＯ，好") == "1998年 WTO，好"
    assert clean("１９９８年　ＷＴＯ，好", normalization="nfkc") == "1998年 WTO,好"
    assert clean("１９９８年，", normalization="none") == "１９９８年，"


def test_zh_policy_keeps_chinese_punctuation_and_folds_latin_digits_and_the_ideographic_space():
    kept = "，：；！？（）、。《》「」【】〔〕…～［］"
    assert clean(kept) == kept
    assert clean("ＡＢＣ１２３　ａｂｃ") == "ABC123 abc"
    assert clean("１．５％，ａ＋ｂ＝ｃ") == "1.5%，a+b=c"  # symbols inside numbers and formulas are folded
    assert clean("｢引号｣､句号｡") == "「引号」、句号。"  # half-width CJK forms become the full-width ones
    assert clean("e\u0301，e\u0301") == "é，é"  # NFKC on each side of a kept character
    assert clean("，：；！？（）", normalization="nfkc") == ",:;!?()"


def test_control_characters_and_ansi_escapes_are_removed():
    assert clean("\x1b[31m红色\x1b[0m文字\x00\x07\u200b\ufeff完") == "红色文字完"
    assert clean("a\x1b[1;32mb", strip_control=False, normalize_whitespace=False) == "a\x1b[1;32mb"


def test_whitespace_is_normalised_but_paragraphs_are_kept():
    text = "  第一段\t\t有  空格  \r\n\r\n\r\n\n第二段\u3000结束 \n"
    assert clean(text) == "第一段 有 空格\n\n第二段 结束"


def test_traditional_to_simplified_is_optional():
    assert clean("漢語的資訊") == "漢語的資訊"
    assert clean("漢語的資訊", traditional_to_simplified=True) == "汉语的资讯"


@pytest.mark.parametrize("flags", [("zh", True, True), ("nfkc", True, True), ("zh", False, True),
                                   ("none", True, False), ("nfkc", True, False), ("none", False, True)])
def test_vectorised_batch_cleaning_equals_the_regular_expression_rules(flags):
    policy, control, whitespace = flags
    cleaner = Cleaner(CleaningConfig(normalization=policy, strip_control=control, normalize_whitespace=whitespace))
    rng = random.Random(str(flags))
    # Characters the tables handle, and ones that send a document to the exact slow path.
    simple = list("中文，。（）：；！？、…～＂［］｛｝％．＋｡｢､〶〸ＡＢ１２"
                  " \t\n\r\u3000\xa0\x0b\x0c\x1c\x85\u2028\u2029\u200b\ufeff\x00\x07\x7f"
                  "\x9f①\ue001abc…℃Ⅱ⑵㎏¼‥㍻") + ["\r\n", "\n\n\n", "  ", " \n \n "]
    tricky = list("e\u0301\u1100\u1161가ﬁ㈱😀𝐀\u302a\u3099")

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


@pytest.mark.parametrize("policy", ["zh", "nfkc"])
def test_every_bmp_character_cleans_alike_in_batch_and_alone_between_neighbours(policy):
    cleaner = Cleaner(CleaningConfig(normalization=policy))
    docs = [f"中{chr(cp)}a{chr(cp)}{chr(cp)}，1" for cp in range(0x10000) if not 0xD800 <= cp < 0xE000]
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


@pytest.mark.skipif(native.compiled is None, reason="the C kernels were not built here")
@pytest.mark.parametrize("policy", ["zh", "nfkc"])
def test_compiled_folding_equals_numpy_under_each_policy_on_every_bmp_character_and_beyond(policy):
    codes = np.concatenate([np.arange(0x10000, dtype=np.uint32), np.array([0x1F600, 0x10FFFF, 0xFF0C], np.uint32)])
    codes = np.concatenate([codes, np.random.default_rng(1).permutation(codes)])
    folded, unsafe = native.compiled.nfkc_fold(codes, *cleaning._nfkc_tables(policy))
    expected, expected_unsafe = cleaning.nfkc_fold_numpy(codes, policy)
    assert np.frombuffer(folded, np.uint32).tolist() == expected.tolist()
    assert np.frombuffer(unsafe, np.int64).tolist() == expected_unsafe.tolist()
    punctuation = np.array([ord(ch) for ch in "，（…"], np.uint32)
    kept = np.frombuffer(native.compiled.nfkc_fold(punctuation, *cleaning._nfkc_tables(policy))[0], np.uint32)
    assert kept.tolist() == (punctuation.tolist() if policy == "zh" else [ord(ch) for ch in ",(..."])


@pytest.mark.parametrize("policy", ["zh", "nfkc"])
def test_normalisation_is_idempotent_on_the_corpus_and_on_every_bmp_character(policy):
    texts = people_daily_docs()[:500] + [f"中{chr(cp)}，{chr(cp)}a" for cp in range(0x10000)
                                         if not 0xD800 <= cp < 0xE000]
    once = [cleaning.normalize(text, policy) for text in texts]
    assert [cleaning.normalize(text, policy) for text in once] == once
