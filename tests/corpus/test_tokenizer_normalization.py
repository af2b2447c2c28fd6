"""The tokenizer carries the corpus's normalisation policy: raw text encodes like its cleaned form, everywhere."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.corpus import CLEANED, RAW, drop_record
from tests.helpers.project import corpus_params, publish
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.tokenizer import SP_MODEL_FILE, TokenEncoder, normalization_rules, recorded_normalization
from train_deploy.handoffs import TokenizerInfo


def test_the_default_cleaning_keeps_full_width_punctuation_and_the_tokenizer_records_zh(tiny_tokenizer):
    assert Cleaner(CleaningConfig())(RAW) == CLEANED
    encoder = TokenEncoder(tiny_tokenizer)
    assert encoder.normalization == "zh" == recorded_normalization(Path(tiny_tokenizer.path) / SP_MODEL_FILE)
    vocabulary = {encoder._sp.id_to_piece(i) for i in range(encoder._sp.get_piece_size())}
    assert {"，", "（", "）", "：", "。"} <= vocabulary and not {",", "(", ")"} & vocabulary


def test_raw_and_cleaned_text_give_the_same_ids_through_the_encoder_and_the_saved_paddlenlp_tokenizer(tiny_tokenizer):
    from paddlenlp.transformers import AutoTokenizer

    encoder = TokenEncoder(tiny_tokenizer)
    raw_ids, cleaned_ids = encoder.encode([RAW, CLEANED])
    assert raw_ids == cleaned_ids and encoder.decode(raw_ids) == CLEANED
    saved = AutoTokenizer.from_pretrained(tiny_tokenizer.path)
    assert saved(RAW, add_special_tokens=False)["input_ids"] == cleaned_ids
    assert saved.decode(saved(RAW, add_special_tokens=False)["input_ids"]) == CLEANED


def test_decoding_the_encoded_cleaned_corpus_gives_it_back_with_its_full_width_punctuation(tiny_tokenizer,
                                                                                           tiny_token_files):
    from train_deploy.corpus.people_daily import strip_pos_tags
    from train_deploy.corpus.readers import people_daily_path

    lines = people_daily_path().read_text(encoding="utf-8").splitlines()[:400]
    docs = [doc for doc in Cleaner(CleaningConfig()).clean_batch(strip_pos_tags(lines)) if doc]
    encoder = TokenEncoder(tiny_tokenizer)
    assert sum(doc.count("，") for doc in docs) > 100
    assert [encoder.decode(ids) for ids in encoder.encode(docs)] == docs
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset

    written = MMapIndexedDataset(str(tiny_token_files.prefix("train")))  # what the stage wrote for training
    decoded = "".join(encoder.decode(written[i].tolist()[:-1]) for i in range(50))
    assert decoded.count("，") > 20 and "," not in decoded


def test_each_policy_gives_its_rules_and_none_gives_no_rules():
    zh, nfkc = dict(normalization_rules("zh")), dict(normalization_rules("nfkc"))
    assert [zh.get(char) for char in "Ａ１\u3000，（…｡"] == ["A", "1", " ", None, None, None, "。"]
    assert [nfkc.get(char) for char in "Ａ，（…"] == ["A", ",", "(", "..."]
    assert zh["e\u0301"] == "é"  # a canonical pair composes as NFKC composes it


def test_an_nfkc_tokenizer_records_nfkc_and_folds_full_width_punctuation(tmp_path):
    from train_deploy.pipelines.corpus.nodes import plan_inputs, prepare_tokenizer

    params = corpus_params(cleaning={"normalization": "nfkc"})
    info = publish(prepare_tokenizer(*plan_inputs(params)), tmp_path / "tokenizer", TokenizerInfo)
    encoder = TokenEncoder(info)
    assert encoder.normalization == "nfkc"
    assert encoder.encode([RAW]) == encoder.encode(["1998年,中国经济(GDP)增长。"])


def test_a_tokenizer_saved_before_the_record_has_no_policy_and_tokenizes_text_as_given(tiny_tokenizer, tmp_path):
    old = shutil.copytree(tiny_tokenizer.path, tmp_path / "old")
    drop_record(old)
    encoder = TokenEncoder(TokenizerInfo.read_folder(old))
    assert encoder.normalization is None
    raw_ids, cleaned_ids = encoder.encode([RAW, CLEANED])
    assert raw_ids != cleaned_ids and encoder.decode(raw_ids) == RAW
    assert cleaned_ids == TokenEncoder(tiny_tokenizer).encode([CLEANED])[0]  # same vocabulary, same merges
