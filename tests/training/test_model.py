"""The model builder: presets and the recompute flag."""

from __future__ import annotations

from train_deploy.training.config import TrainingConfig
from train_deploy.training.model import build_model, flops_per_token


def test_preset_shapes_and_vocabulary_from_the_tokenizer():
    config = TrainingConfig.from_params({"model": {"preset": "tiny", "overrides": {"num_hidden_layers": 3}},
                                         "precision": {"recompute": True}})
    model = build_model(config, vocab_size=500, eos_id=2)
    assert model.config.vocab_size == 500 and model.config.num_hidden_layers == 3
    assert model.llama.enable_recompute
    shape = config.model.shape()
    assert flops_per_token(shape, 1_000_000, 100_000, 128) == 6 * 900_000 + 12 * 3 * 64 * 128
