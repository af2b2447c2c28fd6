"""Export configuration: validated once, with the key named."""

from __future__ import annotations

import re

import pytest

from train_deploy.config import ConfigError
from train_deploy.export.config import ExportConfig


def test_defaults_match_the_documented_targets():
    config = ExportConfig.from_params({})
    assert config.edge.opset == 17 and config.edge.int8
    assert config.parity.max_logit_diff == 1e-4 and config.parity.max_int8_perplexity_increase == 0.03
    assert config.parity.max_fp16_perplexity_increase == 0.01 and config.server.form_precision == "fp32"
    assert config.latency.batch_sizes == [1, 8] and config.latency.seq_length == 128


@pytest.mark.parametrize(("server", "precision"), [
    ({}, "fp32"), ({"device": "gpu"}, "fp32"), ({"device": "gpu", "precision": "fp16"}, "fp16"),
    ({"device": "gpu", "tensorrt": True}, "tensorrt_fp16"),
    ({"device": "gpu", "tensorrt": True, "tensorrt_precision": "fp32", "precision": "fp16"}, "tensorrt_fp32"),
])
def test_the_server_form_s_precision_decides_its_parity_rule(server, precision):
    assert ExportConfig.from_params({"server": server}).server.form_precision == precision


@pytest.mark.parametrize(("params", "message"), [
    ({"edge": {"opset": 12}}, "export.edge.opset: must be in [13, 21] (got 12)"),
    ({"server": {"device": "tpu"}}, "export.server.device: 'tpu' is not one of 'cpu', 'gpu'"),
    ({"too_long": "cut"}, "export.too_long: 'cut' is not one of 'raise', 'truncate'"),
    ({"latency": {"batch_sizes": []}}, "export.latency.batch_sizes: must hold at least 1 (got [])"),
    ({"parity": {"samples": 0}}, "export.parity.samples: must be at least 1"),
    ({"latency": {"rounds": 0}}, "export.latency.rounds: must be at least 1"),
    ({"server": {"gc_batch_mb": -1}}, "export.server.gc_batch_mb: must not be negative"),
    ({"parity": {"tolerance": 1}}, "export.parity.tolerance: unknown key"),
    ({"server": {"precision": "fp16"}}, "export.server.precision: fp16 needs device: gpu"),
    ({"server": {"tensorrt": True}}, "export.server.tensorrt: true needs device: gpu"),
    ({"server": {"precision": "bf16", "device": "gpu"}},
     "export.server.precision: 'bf16' is not one of 'fp32', 'fp16'"),
    ({"parity": {"max_fp16_logit_diff": 0}}, "export.parity.max_fp16_logit_diff: must be"),
])
def test_bad_values_name_the_key(params, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ExportConfig.from_params(params)
