"""The int8 graphs in ONNX Runtime's mobile format: shipped, hashed, proven to generate what the int8 graphs do."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from train_deploy.export.backends import OnnxRuntimeBackend
from train_deploy.export.mobile import convert_to_ort, greedy_ids, mobile_report
from train_deploy.hashing import file_record

pytestmark = pytest.mark.slow


def test_the_bundle_ships_the_int8_graphs_as_ort_files_hashed_and_generating_the_int8_tokens(tiny_bundle):
    meta = json.loads((tiny_bundle / "bundle.json").read_text(encoding="utf-8"))
    for name in ("edge/model.int8.ort", "edge/decode.int8.ort", "edge/required_operators.config", "mobile.json"):
        assert meta["files"][name] == file_record(tiny_bundle / name)
    report = json.loads((tiny_bundle / "mobile.json").read_text(encoding="utf-8"))
    assert report["passed"] and report["failures"] == [] and report["max_abs_logit_diff"] == 0.0
    assert (report["prompts"], report["prompt_tokens"], report["new_tokens"]) == (4, 8, 16)
    assert report["sizes"]["model.int8.ort"] == meta["files"]["edge/model.int8.ort"]["bytes"]
    # loaded by the onnxruntime package from the .ort file itself, its greedy tokens are the int8 graph's
    windows = np.asarray(report["greedy_tokens"])
    assert windows.shape == (4, 16)
    mobile = OnnxRuntimeBackend(tiny_bundle / "edge" / "model.int8.ort", 1)
    assert mobile._full[0]._model_path.endswith("model.int8.ort")
    prompts = [[2, *row[:8]] for row in windows.tolist()]
    int8 = OnnxRuntimeBackend(tiny_bundle / "edge" / "model.int8.onnx", 1)
    assert greedy_ids(mobile, prompts, 16, 128, 2) == greedy_ids(int8, prompts, 16, 128, 2)
    operators = (tiny_bundle / "edge" / "required_operators.config").read_text(encoding="utf-8")
    assert "com.microsoft;1;" in operators and "MatMulNBits" in operators and "/" not in operators
    assert "# - decode.int8.ort\n# - model.int8.ort\n" in operators
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "## On Android and iOS (ONNX Runtime Mobile)" in card
    assert "`edge/model.int8.ort` (0.5 MiB; the int8 ONNX graph it is converted from: 0.4 MiB)" in card
    assert "--include_ops_by_config edge/required_operators.config" in card


def test_an_ort_file_that_generates_other_tokens_fails_with_the_prompt_and_both_token_lists(tmp_path, tiny_bundle):
    edge = tmp_path / "edge"
    edge.mkdir()
    for name in ("model.int8.onnx", "decode.int8.onnx"):
        shutil.copy(tiny_bundle / "edge" / name, edge / name)
    original = (edge / "model.int8.onnx").read_bytes()
    model = onnx.load(str(edge / "model.int8.onnx"))
    for tensor in model.graph.initializer:  # the last projection's scales negated: every logit changes sign
        if tensor.name.endswith("_int8_scales"):
            last = tensor
    last.CopyFrom(onnx.numpy_helper.from_array(-onnx.numpy_helper.to_array(last), last.name))
    onnx.save(model, str(edge / "model.int8.onnx"))
    convert_to_ort(edge)
    (edge / "model.int8.onnx").write_bytes(original)
    windows = np.arange(3, 3 + 4 * 33).reshape(4, 33)
    report = mobile_report(edge, windows, 1, 128, 2)
    assert not report["passed"] and report["max_abs_logit_diff"] > 1
    assert report["failures"][0].startswith("model.int8.ort: greedy tokens differ from model.int8.onnx for prompt 0: [")
