"""Every configuration error of the training stage, asserted by its message."""

from __future__ import annotations

import pytest

from train_deploy.config import ConfigError
from train_deploy.training.config import (
    BatchConfig,
    DeviceConfig,
    Layout,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    check_vocabulary,
    resolve_layout,
)


def layout(world: int = 2, vocab: int = 2000, **blocks):
    params: dict = {"model": {"preset": "tiny"}, "batch": {"micro_batch_size": 2, "global_batch_size": 8,
                                                           "seq_length": 32}}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values}
    return resolve_layout(TrainingConfig.from_params(params), world, vocab)


def test_degrees_are_inferred_from_the_world_size():
    assert (layout(4).dp, layout(4).mp, layout(4).accumulation_steps) == (4, 1, 1)
    resolved = layout(4, parallel={"mp": 2})
    assert (resolved.dp, resolved.mp, resolved.accumulation_steps) == (2, 2, 2)


@pytest.mark.parametrize(
    "world,vocab,blocks,message",
    [
        (4, 2000, {"parallel": {"dp": 3, "mp": 1}}, "dp × mp × pp = 3 does not divide the world size 4"),
        (4, 2000, {"parallel": {"dp": 1, "mp": 2}}, "dp × mp × pp = 1 × 2 × 1 = 2 but the world size is 4"),
        (2, 2000, {"parallel": {"dp": -1, "mp": -1}}, "only one of dp, mp, pp may be -1"),
        (3, 2001, {"parallel": {"mp": 3, "dp": 1}}, "num_attention_heads = 4 is not divisible by mp = 3"),
        (2, 2001, {"parallel": {"mp": 2, "dp": 1}}, "the tokenizer's vocabulary (2001) is not divisible by mp = 2"),
        (4, 2000, {"model": {"overrides": {"hidden_size": 66}}, "parallel": {"mp": 4, "dp": 1}},
         "hidden_size = 66 is not divisible by mp = 4"),
        (1, 2000, {"parallel": {"sharding_stage": 1}}, "which has one rank here"),
        (2, 2000, {"parallel": {"sharding_stage": 2}}, "stage 2 needs GPUs: it reduce-scatters gradients"),
        (1, 2000, {"batch": {"seq_length": 512}}, "seq_length: 512 exceeds the model's max_position_embeddings (128)"),
        (2, 2000, {"batch": {"global_batch_size": 6}}, "6 is not a multiple of micro_batch_size × dp = 2 × 2 = 4"),
        (1, 2000, {"precision": {"amp": True}}, "mixed precision needs a GPU"),
    ],
)
def test_layout_errors_say_what_to_change(world, vocab, blocks, message):
    with pytest.raises(ConfigError) as exc:
        layout(world, vocab, **blocks)
    assert message in str(exc.value)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_pipeline_parallel_is_refused_on_every_device_with_why(device):
    with pytest.raises(ConfigError, match=r"training.parallel.pp: pipeline parallelism is not supported, set pp: 1 .*"
                                          r"the loss exists only on the last stage"):
        layout(4, parallel={"pp": 2, "dp": 2}, device={"type": device})


def planned(world: int, **parallel) -> Layout:
    """The planner's layout of a pipeline configuration, which ``from_params`` refuses."""
    config = TrainingConfig(model=ModelConfig(preset="tiny"), parallel=ParallelConfig(**parallel),
                            batch=BatchConfig(micro_batch_size=2, global_batch_size=8, seq_length=32),
                            device=DeviceConfig(type="gpu"))
    return resolve_layout(config, world, 2000)


def test_the_planner_still_places_pipeline_stages():
    resolved = planned(8, pp=2, mp=2)
    assert (resolved.pp, resolved.mp, resolved.dp) == (2, 2, 2)
    with pytest.raises(ConfigError, match="num_hidden_layers = 2 is not divisible by pp = 3"):
        planned(3, pp=3, dp=1)


def test_block_errors_name_the_key():
    with pytest.raises(ConfigError, match="training.model.preset: 'huge' is not one of 'tiny', 'small', '350m', "
                                          "'1.3b'"):
        TrainingConfig.from_params({"model": {"preset": "huge"}})
    with pytest.raises(ConfigError, match="training.launch.master: a multi-node job needs host:port"):
        TrainingConfig.from_params({"launch": {"nnodes": 2}})
    with pytest.raises(ConfigError, match="training.optimizer.lr_scaling: 'cubic' is not one of"):
        TrainingConfig.from_params({"optimizer": {"lr_scaling": "cubic"}})


def test_tokenizer_vocabulary_must_fit_the_model():
    with pytest.raises(ConfigError, match="the model has 1000 embeddings but the tokenizer produces 2000 ids"):
        check_vocabulary(2000, 1000)


@pytest.mark.parametrize("rule,expected", [("linear", 4e-4), ("sqrt", 2e-4 * 2**0.5), ("none", 2e-4)])
def test_learning_rate_scales_with_the_global_batch(rule, expected):
    config = TrainingConfig.from_params({"optimizer": {"learning_rate": 2e-4, "reference_batch_size": 16,
                                                       "lr_scaling": rule}})
    assert config.optimizer.scaled_learning_rate(32) == pytest.approx(expected)
