"""Validation loss: one definition for the workers and for a checkpoint in one process; the checkpoint loader."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from train_deploy.training.checkpoint import STATE_FILE, CheckpointError, write_checkpoint
from train_deploy.training.config import TrainingConfig
from train_deploy.training.evaluation import (
    PORTABLE_SETTINGS,
    load_model,
    mean_token_loss,
    model_batch_loss,
    perplexity,
    portable_model_config,
    validation_loss,
    validation_windows,
)

VOCAB = 64


def tiny_model(seed: int = 0):
    """The training model (``LlamaForCausalLMNet``) of the tiny preset, randomly initialised."""
    import paddle

    from train_deploy.training.model import build_model

    paddle.seed(seed)
    model = build_model(TrainingConfig.from_params({"model": {"preset": "tiny"}}), vocab_size=VOCAB, eos_id=2)
    model.eval()
    return model


def windows(rows: int, seq_length: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, seq_length + 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_validation_loss_is_the_mean_cross_entropy_of_every_next_token():
    import paddle

    model, batch = tiny_model(), windows(5)
    with paddle.no_grad():
        logits = model(input_ids=paddle.to_tensor(batch[:, :-1])).numpy().astype(np.float64)
    log_probs = np.take_along_axis(log_softmax(logits), batch[:, 1:, None], axis=-1)
    expected = -log_probs.mean()  # 5 × 12 tokens, each weighted equally
    assert validation_loss(model, batch, batch_size=2) == pytest.approx(expected, rel=1e-5)  # batches 2, 2, 1


def test_a_data_parallel_split_of_each_batch_gives_the_same_loss():
    model, batch = tiny_model(), windows(8)
    whole = model_batch_loss(model)

    def two_ranks(rows: np.ndarray) -> tuple[float, int]:
        """What the workers' batch loss spans: each dp rank's half, summed over the ranks."""
        shares = [whole(half) for half in np.split(rows, 2)]
        return sum(s for s, _ in shares), sum(n for _, n in shares)

    single = validation_loss(model, batch, batch_size=8)
    assert mean_token_loss(batch, two_ranks, batch_size=4) == pytest.approx(single, rel=1e-6)


def test_perplexity_is_the_exponential_of_the_loss_capped_for_diverged_runs():
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e4) == math.exp(50.0)


def test_a_loaded_checkpoint_computes_the_saved_models_logits(tmp_path):
    import paddle

    from train_deploy.export.graph import eager_logits

    trained = tiny_model(seed=3)
    write_checkpoint(tmp_path, 1, dict(trained.named_parameters()), {},
                     {"step": 1, "model_config": trained.config.to_dict()}, keep_last=1)
    loaded = load_model(tmp_path / "step_00000001")
    assert not loaded.training and loaded.config.dtype == "float32"
    assert all(p.dtype == paddle.float32 for p in loaded.parameters())
    ids = windows(3)[:, :-1]
    np.testing.assert_allclose(eager_logits(loaded, ids), eager_logits(trained, ids), rtol=0, atol=1e-5)


def test_a_checkpoint_trained_with_flash_attention_and_fused_kernels_loads_portable(tmp_path):
    """A GPU run records use_flash_attention and use_fused_rope (neither runs in float32 on GPU): the model
    rebuilt from its checkpoint uses portable attention and RoPE, and computes the same logits."""
    from train_deploy.export.graph import eager_logits

    trained = tiny_model(seed=4)
    gpu_flags = {"use_flash_attention": True, "use_fused_rope": True, "use_fused_rms_norm": True,
                 "sequence_parallel": False, "recompute": True, "dtype": "bfloat16"}
    write_checkpoint(tmp_path, 1, dict(trained.named_parameters()), {},
                     {"step": 1, "model_config": {**trained.config.to_dict(), **gpu_flags}}, keep_last=1)
    loaded = load_model(tmp_path / "step_00000001")
    config = loaded.config
    assert not config.use_flash_attention and not config.use_fused_rope and not config.use_fused_rms_norm
    assert not config.recompute and config.dtype == "float32"
    assert all(not layer.self_attn.use_fused_rope for layer in loaded.llama.layers)
    ids = windows(2)[:, :-1]
    np.testing.assert_allclose(eager_logits(loaded, ids), eager_logits(trained, ids), rtol=0, atol=1e-5)


def test_portable_model_config_keeps_what_the_model_computes():
    recorded = {"hidden_size": 64, "fuse_attention_qkv": True, "use_flash_attention": True, "use_fused_rope": True,
                "tensor_parallel_degree": 4}
    portable = portable_model_config(recorded)
    assert portable["hidden_size"] == 64 and portable["fuse_attention_qkv"]  # the weights' layout stays
    assert portable == {**recorded, **PORTABLE_SETTINGS} and portable["tensor_parallel_degree"] == 1
    assert portable_model_config({**recorded, "use_flash_attention": False}) == portable


def test_a_checkpoint_of_another_shape_is_named(tmp_path):
    trained = tiny_model()
    config = {**trained.config.to_dict(), "vocab_size": 96}
    write_checkpoint(tmp_path, 1, dict(trained.named_parameters()), {}, {"step": 1, "model_config": config},
                     keep_last=1)
    with pytest.raises(CheckpointError, match=r"model.safetensors: 'llama.embed_tokens.weight' has shape \[64, 64\], "
                                              r"the model configuration needs \[96, 64\]"):
        load_model(tmp_path / "step_00000001")


@pytest.mark.slow
def test_the_workers_validation_loss_is_the_checkpoints_in_one_process(tiny_checkpoint, tiny_tokens):
    """The training run evaluated its last step on the same windows with the sharded model."""
    state = json.loads((tiny_checkpoint / STATE_FILE).read_text())
    config = TrainingConfig.from_params(state["training"])
    count = config.schedule.eval_batches * config.batch.global_batch_size
    valid = validation_windows(tiny_tokens.valid_prefix, tiny_tokens.dtype, config.batch.seq_length, count)
    assert len(valid) == count
    assert validation_loss(load_model(tiny_checkpoint), valid) == pytest.approx(state["val_loss"], rel=1e-5)
