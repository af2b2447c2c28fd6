"""``training.layout: auto`` (``train_deploy.training.layout``): the field's rules at 100 M, 3 B and 30 B parameters,
and the memory estimate against the peak a real training step on the CPU presets reaches."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from tests.helpers.project import REPO
from train_deploy.config import ConfigError
from train_deploy.training.config import PRESETS, TrainingConfig
from train_deploy.training.layout import (
    Devices,
    LayoutChoice,
    Workload,
    choose_layout,
    describe,
    memory_estimate,
    parameter_count,
)

GIB = 2**30
H100_NODE = Devices(kind="gpu", world=8, per_node=8, memory_bytes=80 * GIB)
FOUR_H100_NODES = Devices(kind="gpu", world=32, per_node=8, memory_bytes=80 * GIB)


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> dict[str, int]:
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": 2048}


M100 = Workload(_llama(768, 2048, 12, 12), 32000, global_batch_size=256, seq_length=2048, low_precision=True)
B3 = Workload(_llama(3200, 8640, 26, 32), 32000, global_batch_size=256, seq_length=2048, low_precision=True)
B30 = Workload(_llama(6144, 16384, 64, 48), 32000, global_batch_size=256, seq_length=2048, low_precision=True)


def _degrees(choice: LayoutChoice) -> tuple[int, int, int, int, int, bool]:
    return (choice.dp, choice.mp, choice.sharding_stage, choice.micro_batch_size, choice.accumulation_steps,
            choice.recompute)


def test_parameter_count_is_the_models_own():
    assert parameter_count(PRESETS["tiny"], 2000) == 338_240  # sum of the numel of LlamaForCausalLMNet's parameters
    assert parameter_count(PRESETS["small"], 8000) == 2_851_968
    assert (M100.parameters, B3.parameters, B30.parameters) == (134_105_856, 3_426_473_600, 29_385_037_824)


def test_below_one_billion_parameters_is_data_parallel_only():
    choice = choose_layout(M100, H100_NODE)
    assert _degrees(choice) == (8, 1, 0, 16, 2, False)
    assert describe(choice, H100_NODE) == (
        "Layout auto: dp 8 x mp 1, sharding stage 0, micro-batch 16 x 2 accumulation steps, recompute off (below 1 B "
        "parameters: data parallel; 2 accumulation steps make up the global batch); estimate 40.94 GiB per GPU "
        "device of 80.00 GiB")


def test_one_to_ten_billion_adds_tensor_parallel_within_the_node():
    choice = choose_layout(B3, H100_NODE)
    assert _degrees(choice) == (4, 2, 0, 4, 16, False)
    assert choice.reason.startswith("1-10 B parameters: data plus tensor parallel, mp 2 within a node")


def test_beyond_ten_billion_shards_the_state_with_the_widest_tensor_parallel_of_a_node():
    choice = choose_layout(B30, FOUR_H100_NODES)
    assert _degrees(choice) == (4, 8, 3, 4, 16, False)
    assert choice.reason.startswith("over 10 B parameters: mp 8 within a node, state sharded over dp")


def test_a_slow_interconnect_recomputes_and_accumulates_before_it_shards():
    # 5 GiB devices: micro-batch 1 of 2048 tokens does not fit beside the whole state without either
    one_node = Devices(kind="gpu", world=8, per_node=8, memory_bytes=5 * GIB)
    assert _degrees(choose_layout(M100, one_node)) == (8, 1, 1, 1, 32, False)  # fast: shard the moments first
    two_nodes = Devices(kind="gpu", world=8, per_node=4, memory_bytes=5 * GIB)
    assert _degrees(choose_layout(M100, two_nodes)) == (8, 1, 0, 2, 16, True)


def test_a_model_that_fits_nowhere_is_refused_naming_the_memory():
    small_gpu = Devices(kind="gpu", world=1, per_node=1, memory_bytes=16 * GIB)
    with pytest.raises(ConfigError, match=r"^training\.layout: auto: 3\.43 B parameters need at least 5[0-9]\.\d GiB "
                                          r"per device .* but a device has 12\.8 GiB to spare; add devices"):
        choose_layout(B3, small_gpu)


def test_layout_takes_manual_or_auto_only():
    assert TrainingConfig.from_params({"layout": "auto"}).layout == "auto"
    assert TrainingConfig.from_params({}).layout == "manual"
    with pytest.raises(ConfigError, match=r"^training\.layout"):
        TrainingConfig.from_params({"layout": "fast"})


# A real step in a fresh process: Paddle's host allocator counts the bytes of every CPU tensor (weights, gradients,
# moments, activations), so its peak over two steps, less what was allocated before the model, is what the estimate
# stands for. The process's RSS growth is not: ~270 MB of it is Paddle's runtime, whatever the model.
_STEP = """
import json, sys
import numpy as np, paddle
from paddle.base import core
from train_deploy.training.config import TrainingConfig
from train_deploy.training.model import build_model
from train_deploy.training.worker import build_optimizer
params, vocab = json.loads(sys.argv[1]), int(sys.argv[2])
paddle.set_device("cpu")
base = core.host_memory_stat_current_value("Allocated", 0)
config = TrainingConfig.from_params(params)
model = build_model(config, vocab, 2)
optimizer, _ = build_optimizer(model, config)
b = config.batch
ids = paddle.to_tensor(np.random.default_rng(0).integers(0, vocab, (b.micro_batch_size, b.seq_length + 1)))
for _ in range(2):
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    (loss[0] if isinstance(loss, (tuple, list)) else loss).backward()
    optimizer.step()
    optimizer.clear_grad()
print(json.dumps({"peak": core.host_memory_stat_peak_value("Allocated", 0) - base}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "vocab"), [("tiny", 2000), ("small", 8000)])
def test_the_estimate_on_each_cpu_preset_is_within_25_percent_of_the_measured_peak(preset, vocab, caplog):
    config = TrainingConfig.from_params({"layout": "auto", "model": {"preset": preset}})
    work = Workload(config.model.shape(), vocab, config.batch.global_batch_size, config.batch.seq_length)
    cpu = Devices(kind="cpu", world=1, per_node=1, memory_bytes=8 * GIB)
    choice = choose_layout(work, cpu)
    assert _degrees(choice) == (1, 1, 0, 8, 1, False)
    params = {"model": {"preset": preset}, "batch": {"micro_batch_size": choice.micro_batch_size},
              "precision": {"recompute": choice.recompute}}
    done = subprocess.run([sys.executable, "-c", _STEP, json.dumps(params), str(vocab)], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=120)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    logging.getLogger(__name__).info("%s: estimate %d, measured %d", preset, choice.memory_bytes, peak)
    assert abs(choice.memory_bytes - peak) <= 0.25 * peak


@pytest.mark.slow
def test_recomputation_keeps_the_estimate_within_25_percent():
    params = {"model": {"preset": "small"}, "batch": {"seq_length": 256}, "precision": {"recompute": True}}
    done = subprocess.run([sys.executable, "-c", _STEP, json.dumps(params), "8000"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=120)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    work = Workload(PRESETS["small"], 8000, global_batch_size=8, seq_length=256)
    estimate = memory_estimate(work, dp=1, mp=1, sharding_stage=0, micro_batch_size=8, recompute=True)
    assert abs(estimate - peak) <= 0.25 * peak


def test_the_launch_applies_the_choice_and_logs_it_in_one_line(tmp_path, tiny_tokens, caplog):
    from tests.helpers.training import run_spec, training_params
    from train_deploy.training.launch import plan_layout

    params = {**training_params(2, parallel={"dp": 1, "mp": 2}), "layout": "auto"}
    with caplog.at_level(logging.INFO, logger="train_deploy.training.launch"):
        spec = plan_layout(run_spec(tmp_path, tiny_tokens, params))
    p = spec.training.parallel
    assert (p.dp, p.mp, p.sharding_stage, spec.training.batch.micro_batch_size) == (-1, 1, 0, 4)
    assert (spec.layout.dp, spec.layout.mp, spec.layout.accumulation_steps) == (2, 1, 1)
    assert spec.training.layout == "manual"  # planned once: the node plans, the launch does not plan again
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"Layout auto: dp 2 x mp 1, sharding stage 0, micro-batch 4 x 1 accumulation steps, "
                        r"recompute off \(below 1 B parameters: data parallel\); estimate 8\.6 MiB per CPU device "
                        r"of \d+\.\d\d GiB", line)
