"""The compact inference graph computes PaddleNLP's Llama logits; configurations it does not implement are refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.helpers.export import SHAPE, fused_here, reference_llama
from train_deploy.export.graph import compact_model, load_inference_model
from train_deploy.training.checkpoint import STATE_FILE, CheckpointError


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 2}, {"num_key_value_heads": 1},
                                       {"tie_word_embeddings": True}, {"rope_theta": 500000.0}],
                         ids=["mha", "gqa-2", "mqa", "tied", "rope-theta"])
@pytest.mark.parametrize("portable", [False, True], ids=["fused", "portable"])
def test_compact_graph_equals_paddlenlp_llama_with_padding(overrides, portable):
    import paddle

    if not portable and not fused_here():  # Paddle's CPU fused_rms_norm dies of SIGILL without AVX-512
        pytest.skip("this CPU cannot run Paddle's fused kernels (the kernel probe): the portable graph is tested")
    reference = reference_llama(len(overrides), **overrides)
    compact = compact_model(reference)
    compact.portable = portable  # Paddle's fused kernels (server/) or the operators ONNX is converted from
    ids = np.random.default_rng(1).integers(3, SHAPE["vocab_size"], size=(3, 20))
    mask = np.ones_like(ids)
    mask[1, :7] = 0  # left padding: positions count from the first token, as for the prompt alone
    mask[2, 15:] = 0  # right padding
    positions = (np.cumsum(mask, axis=1) - 1) * mask
    with paddle.no_grad():
        expected = reference(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
                             position_ids=paddle.to_tensor(positions), use_cache=False, return_dict=False)[0].numpy()
        alone = reference(input_ids=paddle.to_tensor(ids[1:2, 7:]), use_cache=False, return_dict=False)[0].numpy()
        got, *cache = (t.numpy() for t in compact(paddle.to_tensor(ids), paddle.to_tensor(mask)))
    assert got.shape == expected.shape == (3, 20, SHAPE["vocab_size"])
    kv_heads = overrides.get("num_key_value_heads", SHAPE["num_attention_heads"])
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    assert [c.shape for c in cache] == [(3, kv_heads, 20, head_dim)] * 4  # keys then values of both layers
    keep = mask.astype(bool)  # padded rows attend to nothing; their logits are never read
    np.testing.assert_allclose(got[keep], expected[keep], rtol=0, atol=2e-5)
    np.testing.assert_allclose(got[1, 7:], alone[0], rtol=0, atol=2e-5)


def test_configurations_the_graph_does_not_implement_are_named(tmp_path, tiny_checkpoint):
    checkpoint = tmp_path / tiny_checkpoint.name
    shutil.copytree(tiny_checkpoint, checkpoint)
    state = json.loads((checkpoint / STATE_FILE).read_text())
    state["model_config"]["rope_scaling_type"] = "linear"
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"state.json: model_config.rope_scaling_type = 'linear' is not "
                                              r"supported by the export graph \(only None\)"):
        load_inference_model(checkpoint)
