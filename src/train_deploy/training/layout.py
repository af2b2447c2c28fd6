"""``training.layout: auto``: the parallel layout chosen for the user, as pure functions of numbers.

:func:`choose_layout` follows the rules the field uses (Megatron-LM, DeepSpeed ZeRO, PaddleNLP's recipes):

- below ~1 B parameters, data parallel only: every device holds the whole model;
- from 1 to 10 B, data plus tensor (model) parallel, ``mp`` kept within one node (it talks every layer);
- beyond 10 B, sharding of the optimizer state, gradients and weights over the data-parallel group (ZeRO); the
  other answer, pipeline parallel, this project does not run (``config.PIPELINE_UNSUPPORTED``);
- then the largest micro-batch that fits, gradient accumulation making up the global batch; when nothing fits,
  activation recomputation, and more sharding. A slow interconnect (CPU gloo over TCP, or several nodes) takes
  recomputation and accumulation before sharding, which adds communication to every micro-batch; a fast one
  shards first, which costs no compute.

:func:`memory_estimate` is the bytes per device: 16 per parameter (float32 weights and gradients and AdamW's two
float32 moments; bf16 O2 holds 2 + 4 master + 2 + 8), divided as sharding says, plus the activations one
micro-batch keeps for the backward pass. Per token and layer these are ``18 h + 2 I + a s`` values (``h`` hidden,
``I`` intermediate, ``a`` heads, ``s`` sequence) and the logits twice (``V`` values each, kept with their softmax
for the loss); with recomputation, only each layer's input plus one layer's full set. The coefficients are those
of the field's formula (Korthikanti et al. 2022, ``sbh(34 + 5as/h)`` bytes in 16 bits) as Paddle 3.3's CPU
kernels hold them, measured with the host allocator's peak (``tests/training/test_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train_deploy.config import ConfigError

GIB = 2**30
DATA_PARALLEL_LIMIT = 1e9
"""Parameters below which data parallel alone is chosen."""
MODEL_PARALLEL_LIMIT = 1e10
"""Parameters from which the state is sharded over the data-parallel group."""
STATE_BYTES_PER_PARAMETER = 16
HEADROOM = 0.8
"""Share of a device's memory the plan may fill: the allocator's fragmentation, kernels' workspaces, the runtime."""


@dataclass(frozen=True, slots=True)
class Devices:
    """What the job runs on: ``world`` devices (CPU processes or GPUs), ``per_node`` on each node."""

    kind: str
    world: int
    per_node: int
    memory_bytes: int
    """Memory one device may use: a GPU's, or a CPU node's available memory ÷ its processes."""

    @property
    def slow_interconnect(self) -> bool:
        return self.kind == "cpu" or self.world > self.per_node


@dataclass(frozen=True, slots=True)
class Workload:
    """The model and batch the layout is for; ``shape`` holds the preset's keys, ``vocab_size`` the tokenizer's."""

    shape: dict[str, Any]
    vocab_size: int
    global_batch_size: int
    seq_length: int
    low_precision: bool = False

    @property
    def parameters(self) -> int:
        return parameter_count(self.shape, self.vocab_size)


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """The degrees, micro-batch, accumulation and recomputation chosen, why, and the bytes per device."""

    dp: int
    mp: int
    sharding_stage: int
    micro_batch_size: int
    accumulation_steps: int
    recompute: bool
    reason: str
    memory_bytes: int


def parameter_count(shape: dict[str, Any], vocab_size: int) -> int:
    """Parameters of the Llama ``shape``: untied embedding and head, attention, SwiGLU MLP, two norms a layer."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return 2 * vocab_size * h + layers * per_layer + h


def memory_estimate(work: Workload, *, dp: int, mp: int, sharding_stage: int, micro_batch_size: int,
                    recompute: bool) -> int:
    """Bytes one device holds at its peak (:mod:`this module's docstring <train_deploy.training.layout>`)."""
    params = work.parameters / mp
    weights, grads, moments = (params * b for b in ((2, 2, 12) if work.low_precision else (4, 4, 8)))
    shard = dp if dp > 1 else 1
    moments /= shard if sharding_stage >= 1 else 1
    grads /= shard if sharding_stage >= 2 else 1
    weights /= shard if sharding_stage >= 3 else 1
    shape, s = work.shape, work.seq_length
    h, inter, heads, layers = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_hidden_layers"))
    tokens = micro_batch_size * s
    value = 2 if work.low_precision else 4
    layer = tokens * (18 * h + 2 * inter + heads * s) / mp * value
    kept = layers * tokens * h * value + layer if recompute else layers * layer
    logits = 2 * tokens * work.vocab_size / mp * 4  # the loss is taken in float32
    return int(weights + grads + moments + kept + logits)


def choose_layout(work: Workload, devices: Devices) -> LayoutChoice:
    """The layout for ``work`` on ``devices`` by the field's rules (module docstring); :class:`ConfigError` when
    nothing fits, naming the estimate and the device memory."""
    n = work.parameters
    mp = _model_parallel_degree(work, devices)
    dp = devices.world // mp
    if work.global_batch_size % dp:
        raise ConfigError(f"training.batch.global_batch_size: {work.global_batch_size} is not a multiple of the "
                          f"data-parallel degree {dp} that training.layout: auto chose for {devices.world} devices")
    regime = ("below 1 B parameters: data parallel" if n < DATA_PARALLEL_LIMIT else
              f"1-10 B parameters: data plus tensor parallel, mp {mp} within a node" if n < MODEL_PARALLEL_LIMIT
              else f"over 10 B parameters: mp {mp} within a node, state sharded over dp")
    budget = int(devices.memory_bytes * HEADROOM)
    for stage, recompute in _memory_options(n, dp, devices):
        for micro in _divisors_descending(work.global_batch_size // dp):
            need = memory_estimate(work, dp=dp, mp=mp, sharding_stage=stage, micro_batch_size=micro,
                                   recompute=recompute)
            if need <= budget:
                steps = work.global_batch_size // (dp * micro)
                why = _why(regime, devices, stage, recompute, steps)
                return LayoutChoice(dp=dp, mp=mp, sharding_stage=stage, micro_batch_size=micro,
                                    accumulation_steps=steps, recompute=recompute, reason=why, memory_bytes=need)
    least = memory_estimate(work, dp=dp, mp=mp, sharding_stage=_max_stage(devices, dp), micro_batch_size=1,
                            recompute=True)
    raise ConfigError(f"training.layout: auto: {n / 1e9:.2f} B parameters need at least {least / GIB:.1f} GiB per "
                      f"device (micro-batch 1, recomputation, most sharding) but a device has "
                      f"{budget / GIB:.1f} GiB to spare; add devices or set the layout by hand")


def describe(choice: LayoutChoice, devices: Devices) -> str:
    """The one log line: the choice, the reason and the memory estimate per device."""
    return (f"Layout auto: dp {choice.dp} x mp {choice.mp}, sharding stage {choice.sharding_stage}, micro-batch "
            f"{choice.micro_batch_size} x {choice.accumulation_steps} accumulation steps, recompute "
            f"{'on' if choice.recompute else 'off'} ({choice.reason}); estimate {_size(choice.memory_bytes)} per "
            f"{devices.kind.upper()} device of {_size(devices.memory_bytes)}")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _model_parallel_degree(work: Workload, devices: Devices) -> int:
    """1 below 1 B parameters; else the smallest degree within a node whose state fits (1-10 B) or the largest
    (beyond), among those dividing the heads, widths, vocabulary and world."""
    n = work.parameters
    if n < DATA_PARALLEL_LIMIT:
        return 1
    sizes = (work.shape["num_attention_heads"], work.shape["num_key_value_heads"], work.shape["hidden_size"],
             work.shape["intermediate_size"], work.vocab_size, devices.world)
    options = [m for m in (2, 4, 8, 16) if m <= devices.per_node and all(size % m == 0 for size in sizes)] or [1]
    if n >= MODEL_PARALLEL_LIMIT:
        return options[-1]
    budget = devices.memory_bytes * HEADROOM
    fits = [m for m in options if memory_estimate(work, dp=devices.world // m, mp=m, sharding_stage=0,
                                                  micro_batch_size=1, recompute=True) <= budget]
    return fits[0] if fits else options[-1]


def _max_stage(devices: Devices, dp: int) -> int:
    """Sharding needs dp > 1; Paddle's CPU backend runs only stage 1 (no reduce-scatter)."""
    return 0 if dp == 1 else 1 if devices.kind == "cpu" else 3


def _memory_options(parameters: int, dp: int, devices: Devices) -> list[tuple[int, bool]]:
    """(sharding stage, recompute) in the order tried: a slow interconnect recomputes before it shards more."""
    top = _max_stage(devices, dp)
    first = top if parameters >= MODEL_PARALLEL_LIMIT else 0
    stages = list(range(first, top + 1))
    if devices.slow_interconnect:
        return [(first, False), (first, True), *((stage, True) for stage in stages[1:])]
    return [*((stage, False) for stage in stages), *((stage, True) for stage in stages)]


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _why(regime: str, devices: Devices, stage: int, recompute: bool, steps: int) -> str:
    parts = [regime]
    if stage:
        parts.append(f"sharding stage {stage}")
    if recompute:
        parts.append("recomputation to fit")
    if steps > 1:
        parts.append(f"{steps} accumulation steps make up the global batch"
                     + (" over a slow interconnect" if devices.slow_interconnect else ""))
    return "; ".join(parts)
