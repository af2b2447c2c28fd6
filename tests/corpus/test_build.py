"""Encoding: determinism across worker counts, round trip, PaddleNLP compatibility, manifest, reuse."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from tests.corpus.test_dedup import split_texts
from tests.helpers.corpus import encode, output_bytes, random_chinese
from tests.helpers.project import corpus_params, publish
from train_deploy.corpus.build import sample_documents
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.filters import QualityFilter
from train_deploy.corpus.readers import ReadStats, iter_documents, plan_corpus
from train_deploy.corpus.tokenizer import TokenEncoder, tokenizer_hash
from train_deploy.handoffs import TokenManifest, to_json
from train_deploy.pipelines.corpus.nodes import configure_corpus_training, encode_tokens, plan_inputs


def test_a_multistream_wiki_dump_is_shared_by_the_workers_and_encodes_like_a_single_stream(tmp_path, tiny_tokenizer):
    import bz2

    from tests.helpers.corpus import multistream_dump, sample_pages, wiki_dump

    pages = sample_pages(400)
    (tmp_path / "multi.xml.bz2").write_bytes(multistream_dump(pages, 10))
    (tmp_path / "single.xml.bz2").write_bytes(bz2.compress(wiki_dump(pages)))
    outputs, manifests = [], []
    for name, workers in (("multi", 1), ("multi", 2), ("single", 1)):
        folder = tmp_path / f"{name}_{workers}"
        _, manifest = encode(folder, tiny_tokenizer, encoding={"workers": workers},
                             cleaning={"max_repeated_ngram_share": 1.0, "near_dedup": False},  # pages alike
                             reader={
            "source": "wiki_xml", "paths": [str(tmp_path / f"{name}.xml.bz2")], "max_bytes": None,
            "chunk_bytes": 4096})
        outputs.append(output_bytes(folder / "tokens"))
        manifests.append(manifest)
    assert manifests[0].input["chunks"] >= 4 and manifests[1].workers == 2
    assert manifests[2].input["chunks"] == 1
    assert outputs[0] == outputs[1] == outputs[2]
    assert manifests[0].documents.kept == 320


def test_paddlenlp_reads_the_token_files_and_they_decode_to_the_cleaned_documents(tmp_path, tiny_tokenizer):
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset, make_dataset

    config, manifest = encode(tmp_path, tiny_tokenizer, cleaning={"deduplicate": False, "near_dedup": False},
                              encoding={"validation_fraction": 0.0})
    dataset = MMapIndexedDataset(str(tmp_path / "tokens" / "train"))
    assert make_dataset(str(tmp_path / "tokens" / "train"), "mmap").sizes.sum() == manifest.tokens["total"]
    cleaner = Cleaner(config.cleaning)
    plan = plan_corpus(config.reader)
    quality = QualityFilter(config.cleaning)
    expected = [t for c in plan.chunks for raw in iter_documents(c, config.reader, ReadStats())
                if quality.reasons([t := cleaner(raw)]) == [None]]
    assert len(dataset) == len(expected) == manifest.splits["train"].documents
    assert list(dataset.doc_idx[:3]) == [0, 1, 2]
    encoder = TokenEncoder(tiny_tokenizer)
    eos = tiny_tokenizer.eos_id
    for i in random.Random(0).sample(range(len(expected)), 50):
        ids = dataset[i].tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        assert encoder.decode(ids[:-1]) == expected[i]


def test_round_trip_holds_for_unseen_characters_through_byte_fallback(tiny_tokenizer):
    encoder = TokenEncoder(tiny_tokenizer)
    for text in ["罕见字：龘靐齉爩，emoji 😀，English words, 1234567。\n第二段"]:
        assert encoder.decode(encoder.encode([text])[0]) == text


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_batch_encoding_in_this_thread_gives_the_ids_of_the_batch_api(tiny_tokenizer, monkeypatch, dtype):
    encoder = TokenEncoder(tiny_tokenizer)
    texts = ["中共中央总书记发表1998年新年讲话。", "", "罕见字：龘靐齉爩 😀 English", "同胞们、朋友们\n第二段"] * 3
    expected = encoder._sp.encode(texts, add_eos=True)  # SentencePiece's public batch call
    assert encoder._one is not None  # the pinned SentencePiece encodes one text in this thread
    monkeypatch.setattr(encoder._sp, "encode", lambda *a, **k: pytest.fail("batch API called: a thread per call"))
    assert encoder.encode(texts) == [ids[:-1] for ids in expected]
    assert encoder.encode_documents(texts) == expected
    tokens, sizes = encoder.encode_batch(texts, np.dtype(dtype))
    assert tokens.dtype == dtype and sizes.dtype == np.int32
    assert sizes.tolist() == [len(ids) for ids in expected]
    assert tokens.tolist() == [i for ids in expected for i in ids]
    assert all(ids[-1] == tiny_tokenizer.eos_id for ids in expected)
    monkeypatch.undo()
    encoder._one = None  # another SentencePiece build, or a PaddleNLP tokenizer: the list path
    fallback, fallback_sizes = encoder.encode_batch(texts, np.dtype(dtype))
    assert fallback.tolist() == tokens.tolist() and fallback_sizes.tolist() == sizes.tolist()


def test_saved_tokenizer_loads_in_paddlenlp_with_the_same_ids(tiny_tokenizer):
    from paddlenlp.transformers import AutoTokenizer, LlamaTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer.path)
    assert isinstance(tokenizer, LlamaTokenizer)
    text = "中共中央总书记发表1998年新年讲话。\n同胞们、朋友们"
    ids = TokenEncoder(tiny_tokenizer).encode([text])[0]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.eos_token_id == tiny_tokenizer.eos_id and len(tokenizer) == tiny_tokenizer.vocab_size
    assert tokenizer.convert_ids_to_tokens(ids[0]) != "▁"  # no dummy prefix wasted on Chinese


def test_duplicates_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    path = tmp_path / "dup.txt"
    docs = [f"第{i}号文档，内容各不相同。" for i in range(40)]
    path.write_text("\n\n".join(docs + docs[:10] + ["短"]) + "\n", encoding="utf-8")
    _, manifest = encode(tmp_path, tiny_tokenizer, reader={"source": "text", "paths": [str(path)], "chunk_bytes": 4096},
                         encoding={"validation_fraction": 0.2})
    assert manifest.documents.read == 51
    assert manifest.documents.dropped == {"too_short": 1, "duplicate": 10, "near_duplicate": 0}
    assert manifest.documents.kept == 40
    assert sum(s.documents for s in manifest.splits.values()) == 40
    assert 0 < manifest.splits["valid"].documents < 40


def test_training_documents_holding_an_evaluation_text_are_left_out_counted_and_the_set_is_fingerprinted(
        tmp_path, tiny_tokenizer):
    chapters = random_chinese(40, 600, seed=31)
    path = tmp_path / "manual.txt"
    path.write_text("\n\n".join(chapters) + "\n", encoding="utf-8")
    config, plan = plan_inputs(corpus_params(reader={"source": "text", "paths": [str(path)], "chunk_bytes": 8192,
                                                     "max_bytes": None}, encoding={"validation_fraction": 0.0}))
    eval_texts = [chapters[5][:40] + "的" + chapters[5][41:100],  # the opening of chapter 5, one character changed
                  chapters[30][300:400],  # the middle of chapter 30, as it is
                  chapters[12][:50] + random_chinese(1, 50, seed=32)[0],  # half of it: not held
                  "一段训练语料里没有的文字。"]
    plain = publish(encode_tokens(config, plan, tiny_tokenizer), tmp_path / "plain", TokenManifest)
    checked = publish(encode_tokens(config, plan, tiny_tokenizer, None, eval_texts), tmp_path / "checked",
                      TokenManifest)
    assert checked.documents.dropped["near_duplicate_of_eval_set"] == 2
    assert "near_duplicate_of_eval_set" not in plain.documents.dropped and "eval_set" not in plain.config
    assert (plain.documents.kept, checked.documents.kept, checked.splits["train"].documents) == (40, 38, 38)
    assert split_texts(checked, "train", tiny_tokenizer) == [c for i, c in enumerate(chapters) if i not in (5, 30)]
    assert checked.config["eval_set"]["texts"] == 4 and checked.fingerprint != plain.fingerprint
    again = publish(encode_tokens(config, plan, tiny_tokenizer, None, list(eval_texts)), tmp_path / "checked",
                    TokenManifest)
    assert again.reused and again.fingerprint == checked.fingerprint  # the same set next night: kept
    quality = json.loads((tmp_path / "checked" / "quality.json").read_text(encoding="utf-8"))
    assert quality["sample"]["examples"]["near_duplicate_of_eval_set"] == [chapters[5][:400], chapters[30][:400]]


def test_manifest_records_fingerprint_counts_and_throughput(tmp_path, tiny_tokenizer):
    _, manifest = encode(tmp_path, tiny_tokenizer)
    on_disk = json.loads((tmp_path / "tokens" / "manifest.json").read_text(encoding="utf-8"))
    assert on_disk == to_json(manifest) and manifest.path == str(tmp_path / "tokens")
    for key in ("fingerprint", "input", "tokenizer", "splits", "documents", "tokens", "throughput",
                "wall_time_seconds", "peak_rss_mb", "dtype"):
        assert key in on_disk
    assert 10 < manifest.peak_rss_mb["this_process"] < 10_000 and manifest.peak_rss_mb["helpers"] == []
    assert manifest.tokenizer.hash == tokenizer_hash(Path(tiny_tokenizer.path))
    assert manifest.throughput["tokens_per_second"] > 0
    assert manifest.splits["train"].bin_bytes == (tmp_path / "tokens/train.bin").stat().st_size
    assert manifest.tokens["total"] * 2 == sum(s.bin_bytes for s in manifest.splits.values())
    assert [p.name for p in tmp_path.iterdir()] == ["tokens"]  # no staging or shard folder left beside it


def test_unchanged_corpus_reuses_outputs_and_a_changed_one_is_rebuilt(tmp_path, tiny_tokenizer, caplog):
    source = tmp_path / "c.txt"
    source.write_text("\n\n".join(f"第{i}篇：春天来了，万物复苏。" for i in range(30)), encoding="utf-8")
    blocks = {"reader": {"source": "text", "paths": [str(source)]}}
    _, first = encode(tmp_path, tiny_tokenizer, **blocks)
    mtime = (tmp_path / "tokens/train.bin").stat().st_mtime_ns
    with caplog.at_level("INFO"):
        _, again = encode(tmp_path, tiny_tokenizer, **blocks)
    assert again.reused and again.fingerprint == first.fingerprint
    assert f"Kept the token files in {tmp_path / 'tokens'}: up to date" in caplog.text
    assert (tmp_path / "tokens/train.bin").stat().st_mtime_ns == mtime
    source.write_text(source.read_text(encoding="utf-8") + "\n\n新的一篇文章加入了语料。", encoding="utf-8")
    _, changed = encode(tmp_path, tiny_tokenizer, **blocks)
    assert not changed.reused and changed.fingerprint != first.fingerprint
    assert changed.documents.kept == first.documents.kept + 1


def test_tokenizer_sample_is_spread_over_all_chunks(tmp_path):
    config = CorpusConfig.from_params(corpus_params(tokenizer={"sample_bytes": 20_000}))
    plan = plan_corpus(config.reader)
    sample = list(sample_documents(config, plan))
    size = sum(len(d.encode()) for d in sample)
    assert 20_000 <= size < 20_000 + 4 * len(plan.chunks) * 2000
    assert len(plan.chunks) > 3


@pytest.mark.parametrize("vocab,dtype", [(8000, np.uint16), (70000, np.int32)])
def test_token_dtype_follows_paddlenlp(vocab, dtype):
    from train_deploy.corpus.indexed import token_dtype

    assert token_dtype(vocab) == np.dtype(dtype)


def test_token_files_that_cannot_fill_one_training_window_are_refused_built_or_kept(tmp_path, tiny_tokenizer,
                                                                                   caplog):
    from kedro.io import DatasetError

    def publish_checked(fraction: float, training: dict) -> TokenManifest:
        config, plan = plan_inputs(corpus_params(encoding={"validation_fraction": fraction}))
        return publish(encode_tokens(config, plan, tiny_tokenizer, configure_corpus_training(training)),
                       tmp_path / "tokens", TokenManifest,
                       by_fingerprint=True)

    with pytest.raises(DatasetError) as refused:  # built: 1 validation document of 87 tokens, not 129
        publish_checked(0.002, {})
    assert type(refused.value.__cause__).__name__ == "CorpusError"  # the one line the project's CLI prints
    assert str(refused.value).startswith("corpus.encoding.validation_fraction: 0.002 of the ")
    assert "fewer tokens than one evaluation window of training.batch.seq_length + 1 = 129; set it to " \
        in str(refused.value)
    assert not (tmp_path / "tokens").exists()  # nothing published
    with caplog.at_level(logging.WARNING, logger="train_deploy.corpus.build"):
        kept = publish_checked(0.005, {})  # 4 documents, 221 tokens: one window of 129, not a batch of 8
    assert kept.splits["valid"].tokens >= 129
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("corpus.encoding.validation_fraction: the validation split holds 1 window(s) of "
                              "training.batch.seq_length + 1 = 129 tokens, fewer than one evaluation batch "
                              "(training.batch.micro_batch_size = 8): training will not evaluate, averaging and "
                              "export score on these; set it to 0.")
    with pytest.raises(DatasetError, match=r"validation split, fewer tokens than one evaluation window of "
                                          r"training\.batch\.seq_length \+ 1 = 257; "):
        publish_checked(0.005, {"batch": {"seq_length": 256}})  # kept: the same files, a longer window
    assert TokenManifest.read_folder(tmp_path / "tokens").fingerprint == kept.fingerprint  # still published


def test_a_training_split_shorter_than_one_window_and_no_validation_asked_for(tiny_token_files):
    import dataclasses

    from train_deploy.corpus.build import check_splits
    from train_deploy.corpus.errors import CorpusError

    assert check_splits(tiny_token_files, 129, 0.05) is tiny_token_files
    empty = dataclasses.replace(tiny_token_files.splits["valid"], documents=0, tokens=0)
    assert check_splits(dataclasses.replace(tiny_token_files, splits={**tiny_token_files.splits, "valid": empty}),
                        129, 0.0)  # validation_fraction 0: none asked for (preflight refuses it with averaging)
    with pytest.raises(CorpusError) as refused:
        check_splits(tiny_token_files, tiny_token_files.splits["train"].tokens + 1, 0.05)
    assert str(refused.value) == (f"corpus: the training split holds {tiny_token_files.splits['train'].tokens} "
                                  f"tokens ({tiny_token_files.splits['train'].documents} documents), fewer than one "
                                  f"window of training.batch.seq_length + 1 = "
                                  f"{tiny_token_files.splits['train'].tokens + 1}; give more text or set a shorter "
                                  "training.batch.seq_length")
