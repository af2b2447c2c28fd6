"""The model builder: presets, recompute flag, and the export-friendly SwiGLU."""

from __future__ import annotations

import numpy as np
import paddle

from train_deploy.training.config import TrainingConfig
from train_deploy.training.model import build_model, flops_per_token, unfused_swiglu


def test_unfused_swiglu_gives_the_same_logits():
    from paddlenlp.transformers.llama import modeling_network

    config = TrainingConfig.from_params({"model": {"preset": "tiny"}})
    paddle.seed(0)
    model = build_model(config, vocab_size=300, eos_id=2)
    model.eval()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 300, size=(2, 24)))
    fused = model(input_ids=ids).numpy()
    original = modeling_network.swiglu
    try:
        unfused_swiglu()
        assert modeling_network.swiglu is not original
        unfused = model(input_ids=ids).numpy()
    finally:
        modeling_network.swiglu = original
    assert np.abs(fused - unfused).max() <= 1e-6


def test_preset_shapes_and_vocabulary_from_the_tokenizer():
    config = TrainingConfig.from_params({"model": {"preset": "tiny", "overrides": {"num_hidden_layers": 3}},
                                         "precision": {"recompute": True}})
    model = build_model(config, vocab_size=500, eos_id=2)
    assert model.config.vocab_size == 500 and model.config.num_hidden_layers == 3
    assert model.llama.enable_recompute
    shape = config.model.shape()
    assert flops_per_token(shape, 1_000_000, 100_000, 128) == 6 * 900_000 + 12 * 3 * 64 * 128
