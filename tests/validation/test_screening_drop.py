"""``validation.screening: drop``: the champion scores every training document and those far outside the corpus are
left out of the token files training reads; ``report`` (the default) drops nothing.

The champion is the session's tiny bundle (6 steps: close to uniform, so it tells text apart by how many tokens a
character takes). The outliers are Hangul advertising, each document different (the corpus stage would drop copies
as near duplicates): characters the tiny tokenizer spells in bytes, 2.9x the champion's own nats per character,
where the good People's Daily documents of the night reach 1.8x at most (measured), so a factor 2 separates them."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from tests.helpers.corpus import encode
from tests.helpers.project import NO_SERVING_CHECK
from tests.helpers.registry import ModelStore
from tests.validation.conftest import people_daily
from train_deploy.corpus.indexed import document_sizes
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.export.runtime import LanguageModel
from train_deploy.handoffs import Bundle, TokenizerInfo, TokenManifest, WorkFolder
from train_deploy.pipelines.validation.nodes import validate_corpus
from train_deploy.validation.screening import REASON, ScreeningError, document_scores, drop_documents
from train_deploy.validation.statistics import corpus_statistics

FACTOR = 2.0
HANGUL = "광고"  # every outlier holds it; no People's Daily document does
REGISTRY = {"eval_set": {"documents": 8, "max_chars": 60}, **NO_SERVING_CHECK}
TRAINING = {"batch": {"seq_length": 64}}


def outliers(count: int) -> list[str]:
    """Hangul advertising, each document its own syllables (seeded)."""
    rng = random.Random(0)
    return [f"{HANGUL} " + " ".join("".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(4)) for _ in range(12))
            for _ in range(count)]


@pytest.fixture(scope="module")
def night(tmp_path_factory, tiny_tokenizer) -> TokenManifest:
    """People's Daily documents of at least 30 characters with 12 outliers mixed in, encoded by the corpus stage."""
    folder = tmp_path_factory.mktemp("night")
    good = [text for text in people_daily(200_000)[-200:] if len(text) >= 30]
    texts = good[:]
    for i, outlier in enumerate(outliers(12)):
        texts.insert(7 * i + 3, outlier)
    (folder / "corpus.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    _, manifest = encode(folder, tiny_tokenizer, reader={"source": "text", "paths": [str(folder / "corpus.txt")],
                                                         "max_bytes": None})
    return manifest


def documents(manifest: TokenManifest, tokenizer: TokenizerInfo, split: str = "train") -> list[str]:
    """The documents of a split, decoded as training would read them."""
    prefix = manifest.prefix(split)
    sizes = document_sizes(prefix.parent / f"{prefix.name}.idx").astype(np.int64)
    tokens = np.fromfile(prefix.parent / f"{prefix.name}.bin", dtype=np.dtype(manifest.dtype))
    assert len(tokens) == sizes.sum()
    decode, ends = TokenEncoder(tokenizer).decode, np.cumsum(sizes)
    return [decode([t for t in tokens[end - size : end].tolist() if t != tokenizer.eos_id])
            for size, end in zip(sizes.tolist(), ends.tolist(), strict=True)]


def test_drop_leaves_out_the_outliers_and_keeps_every_good_training_document(
        tmp_path, night, tiny_tokenizer, tiny_bundle, tiny_token_files):
    before = documents(night, tiny_tokenizer)
    bad = [i for i, text in enumerate(before) if HANGUL in text]
    assert len(bad) >= 8 and len(before) - len(bad) >= 60  # most outliers landed in the training split
    own = corpus_statistics(tiny_token_files, tiny_tokenizer, tiny_bundle).nats_per_char
    scores = document_scores(LanguageModel.load(tiny_bundle), night, tiny_tokenizer)
    assert len(scores) == len(before) and not np.isnan(scores).any()

    screened, dropped = drop_documents(night, scores, FACTOR * own, tmp_path / "screened", window=65)

    assert documents(screened, tiny_tokenizer) == [text for text in before if HANGUL not in text]
    assert (dropped.scored, dropped.dropped, dropped.share) == (len(before), len(bad), len(bad) / len(before))
    assert dropped.limit == FACTOR * own
    assert Path(screened.path).parent == tmp_path / "screened" and screened.fingerprint != night.fingerprint
    assert screened.documents.kept == night.documents.kept - len(bad)
    assert screened.documents.dropped == {**night.documents.dropped, REASON: len(bad)}
    assert screened.splits["valid"] == night.splits["valid"]  # the validation split is kept whole
    assert documents(screened, tiny_tokenizer, "valid") == documents(night, tiny_tokenizer, "valid")
    assert screened.tokens["total"] == night.tokens["total"] - (night.splits["train"].tokens
                                                                - screened.splits["train"].tokens)
    assert TokenManifest.read_folder(Path(screened.path)) == screened  # what training reads
    # the same documents dropped again: the published copy is kept, not rewritten
    written = (Path(screened.path) / "train.bin").stat().st_mtime_ns
    again, _ = drop_documents(night, scores, FACTOR * own, tmp_path / "screened", window=65)
    assert again == screened and (Path(screened.path) / "train.bin").stat().st_mtime_ns == written


def test_a_drop_that_leaves_the_training_split_shorter_than_a_window_is_refused(tmp_path, night):
    scores = np.ones(night.splits["train"].documents)
    scores[:3] = 0.0  # three documents left
    with pytest.raises(ScreeningError) as refused:
        drop_documents(night, scores, 0.5, tmp_path / "screened", window=4097)
    left = sum(document_sizes(night.prefix("train").parent / "train.idx")[:3].tolist())
    assert str(refused.value) == (
        f"validation.screening: drop would leave 3 training documents ({left} tokens), fewer than one window of "
        "training.batch.seq_length + 1 = 4097; set validation.screening: report or a larger "
        "validation.max_document_nats_factor")
    assert not (tmp_path / "screened").exists()


@pytest.mark.slow
def test_the_gate_drops_the_outliers_only_when_asked_and_records_the_shares_on_the_run(
        tmp_path, caplog, night, tiny_tokenizer, tiny_bundle, tiny_token_files, tiny_run):
    from train_deploy.pipelines.registry.nodes import register_bundle

    store, screened = ModelStore(tmp_path / "store"), WorkFolder(path=str(tmp_path / "screened"))
    validation = {"mode": "warn", "max_document_nats_factor": FACTOR}  # a smaller night than the champion's: warned
    with store.active():
        caplog.set_level(logging.INFO, logger="train_deploy")
        # no champion yet: nothing to score with, nothing dropped, and the log says so
        assert validate_corpus({**validation, "screening": "drop"}, {}, REGISTRY, night, tiny_tokenizer, TRAINING,
                               screened) is night
        assert "validation.screening: drop: nothing dropped: train_deploy_lm has no champion yet" in caplog.messages
        with mlflow.start_run():
            register_bundle(REGISTRY, Bundle.read_folder(tiny_bundle), {}, tiny_token_files, tiny_tokenizer, tiny_run)
        # report (the default): the night's own token files, nothing written
        assert validate_corpus(validation, {}, REGISTRY, night, tiny_tokenizer, TRAINING, screened) is night
        assert not Path(screened.path).exists()
        with mlflow.start_run() as run:
            kept = validate_corpus({**validation, "screening": "drop"}, {}, REGISTRY, night, tiny_tokenizer,
                                   TRAINING, screened)
        client = MlflowClient()
        metrics = client.get_run(run.info.run_id).data.metrics
        report = client.download_artifacts(run.info.run_id, "validation/report.json", str(tmp_path))
    before = documents(night, tiny_tokenizer)
    bad = sum(HANGUL in text for text in before)
    assert documents(kept, tiny_tokenizer) == [text for text in before if HANGUL not in text]
    assert Path(kept.path).parent == Path(screened.path)
    assert metrics["validation.screening.scored"] == len(before)
    assert metrics["validation.screening.dropped"] == bad
    assert metrics["validation.screening.dropped_share"] == pytest.approx(bad / len(before))
    import json

    recorded = json.loads(Path(report).read_text(encoding="utf-8"))["dropped"]
    assert (recorded["scored"], recorded["dropped"]) == (len(before), bad)
    assert any(m.startswith(f"screening: dropped {bad} of {len(before)} training documents") for m in caplog.messages)
    assert any(m.startswith(f"validation.screening: scored {len(before)} training documents with the champion in ")
               for m in caplog.messages)
