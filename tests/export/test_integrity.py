"""Verified bundles (issue 28 item 10): every file is checked against bundle.json's size and xxh3-128 record when
the bundle is loaded, the copy MLflow downloads too; a damaged file is a BundleError naming it (relative name
only), and weights that overflow in scoring are a BundleError, not an OverflowError."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest

from tests.helpers.export import fused_here
from train_deploy.export import LanguageModel
from train_deploy.export.errors import BundleError
from train_deploy.hashing import file_record

WEIGHTS = "server/model.pdiparams" if fused_here() else "server_portable/model.pdiparams"
"""The weights the default load runs here (the tiny bundle ships server/ only where the fused kernels run)."""


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path) -> Path:
    """A copy of the session's tiny bundle, to damage."""
    return Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))


def _refusal(folder: Path, backend: str | None = None) -> str:
    with pytest.raises(BundleError) as refused:
        LanguageModel.load(folder, backend)
    message = str(refused.value)
    assert "\n" not in message and str(folder) not in message and "/tmp" not in message  # no path reaches a client
    return message


def _flip_bits(path: Path, offset: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF  # the same size, other content
    path.write_bytes(bytes(data))


def test_weights_with_flipped_bits_at_the_same_size_are_refused_naming_the_file(bundle_copy):
    _flip_bits(bundle_copy / WEIGHTS)
    assert _refusal(bundle_copy).startswith(f"{WEIGHTS}: content differs from bundle.json's record (xxh3-128 ")


def test_a_truncated_file_is_refused_with_both_sizes(bundle_copy):
    path = bundle_copy / "edge" / "model.int8.onnx"  # not even the engine this load runs: every file is checked
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    assert _refusal(bundle_copy).startswith(f"edge/model.int8.onnx: {size // 2} bytes, bundle.json records {size} "
                                            "(truncated or overwritten)")


def test_a_missing_file_is_refused_naming_it(bundle_copy):
    (bundle_copy / "tokenizer" / "sentencepiece.bpe.model").unlink()
    assert _refusal(bundle_copy, "onnx") == ("tokenizer/sentencepiece.bpe.model: missing from the bundle "
                                             "(bundle.json records it); re-export the bundle, or copy it again "
                                             "from where it was published")


def test_the_copy_mlflow_logs_and_downloads_verifies_and_its_damage_is_refused(request, tmp_path, caplog):
    store, logged = request.getfixturevalue("model_store"), request.getfixturevalue("tiny_model")
    with store.active():
        downloaded = Path(mlflow.artifacts.download_artifacts(logged.model_uri, dst_path=str(tmp_path)))
    copy = downloaded / "artifacts" / "bundle"
    recorded = json.loads((copy / "bundle.json").read_text(encoding="utf-8"))["files"]
    with caplog.at_level(logging.DEBUG, logger="train_deploy.export.integrity"):
        mlflow.pyfunc.load_model(str(downloaded))  # the served model's load_context: LanguageModel.load
    assert f"{copy}: {len(recorded)} files verified against bundle.json" in caplog.messages
    _flip_bits(copy / WEIGHTS)
    with pytest.raises(BundleError, match=rf"^{WEIGHTS}: content differs from bundle.json's record"):
        mlflow.pyfunc.load_model(str(downloaded))


def test_a_damaged_bundle_never_becomes_a_registered_version(request, bundle_copy):
    store = request.getfixturevalue("model_store")
    _flip_bits(bundle_copy / WEIGHTS)
    with pytest.raises(BundleError, match=rf"^{WEIGHTS}: content differs from bundle.json's record"):
        store.log(bundle_copy, registered_model_name="integrity_damaged")  # log_bundle_model verifies first
    with store.active():
        assert not mlflow.MlflowClient().search_model_versions("name='integrity_damaged'")


def test_weights_that_overflow_in_scoring_are_a_bundle_error_not_an_overflow_error(bundle_copy):
    """Weights changed and re-recorded (the record proves the copy, not the export): the tail of the weights set to
    near the float32 maximum gives log-probabilities that are not finite."""
    model = LanguageModel.load(_rerecorded_tail(bundle_copy, 3e38), "paddle")
    with pytest.raises(BundleError, match=r"^text 0: the model's log-probabilities are (not finite|\S+ nats per "
                                          r"token).*its weights are damaged: re-export the bundle$"):
        model.score(["今天天气很好，我们去公园散步。"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_weights_that_give_nan_logits_in_generation_are_a_bundle_error(bundle_copy, temperature):
    """Greedy or sampled, the first token's logits are checked (``_sample``): not a token picked from NaN."""
    model = LanguageModel.load(_rerecorded_tail(bundle_copy, np.nan), "paddle")
    with pytest.raises(BundleError, match=r"^generation: \d+ of the model's \d+ next-token logits are not finite "
                                          r"\(inf or NaN\).*its weights are damaged: re-export the bundle$"):
        model.generate("今天", max_new_tokens=2, temperature=temperature, seed=0)


def _rerecorded_tail(bundle: Path, value: float) -> Path:
    """``bundle`` with the last 300 floats of its weights set to ``value`` and re-recorded in ``bundle.json`` (the
    record proves the copy, not the export)."""
    path = bundle / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-1200:] = np.full(300, value, np.float32).tobytes()
    path.write_bytes(bytes(data))
    meta = json.loads((bundle / "bundle.json").read_text(encoding="utf-8"))
    meta["files"][WEIGHTS] = file_record(path)
    (bundle / "bundle.json").write_text(json.dumps(meta), encoding="utf-8")
    return bundle
