"""Typed configuration of the training stage (``conf/base/parameters_training.yml``, block ``training``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from train_deploy.config import ConfigError, block, check, from_mapping, setting, to_dict
from train_deploy.training.elastic import ElasticConfig
from train_deploy.training.monitoring import MonitoringConfig

_Positive = Annotated[int, Field(ge=1)]
_Count = Annotated[int, Field(ge=0)]
_Seconds = Annotated[int, Field(gt=0)] | Annotated[float, Field(gt=0)]
_SecondsOrZero = Annotated[int, Field(ge=0)] | Annotated[float, Field(ge=0)]
_Degree = Annotated[int, Field(ge=-1)]
"""A parallel degree: positive, or -1 (inferred); 0 is refused by ParallelConfig."""

# Llama shapes; the vocabulary size always comes from the tokenizer.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "max_position_embeddings": 128},
    # small: the CPU demo `make run` trains in about 6.5 minutes on 2 cores (conf/base/parameters_training.yml says
    # why this shape); until issue 16 it was hidden 256 / intermediate 704, which learnt less in the same time.
    "small": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 256},
    "350m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "max_position_embeddings": 2048},
    "1.3b": {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 16, "max_position_embeddings": 2048},
}


@block
class ModelConfig:
    preset: Literal["tiny", "small", "350m", "1.3b"] = "small"
    """One of tiny (tests), small (CPU demo), 350m, 1.3b (GPU)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Any LlamaConfig field over the preset, e.g. {num_hidden_layers: 8}."""

    def __post_init__(self) -> None:  # overrides are any LlamaConfig field: only the preset's shape keys are known
        for key in PRESETS["tiny"].keys() & self.overrides.keys():
            value = self.overrides[key]
            check(type(value) is int and value >= 1, f"training.model.overrides.{key}",
                  f"must be a positive integer (got {str(value)[:40]!r})")

    def shape(self) -> dict[str, Any]:
        return {**PRESETS[self.preset], **self.overrides}


PIPELINE_UNSUPPORTED = (
    "pipeline parallelism is not supported, set pp: 1 and use dp, mp and sharding_stage: in Paddle 3.3's "
    "dynamic-graph auto-parallel the loss exists only on the last stage, there is no micro-batch schedule (PaddleNLP "
    "runs pp only through dist.to_static), and the gradient norm and checkpoints would have to cross stages; on CPU, "
    "gloo also has no point-to-point send/recv")


@block
class ParallelConfig:
    dp: _Degree = -1
    """Data-parallel degree; -1 = world size / (mp × pp)."""
    mp: _Degree = 1
    """Tensor-parallel degree (heads, hidden and vocabulary split over mp ranks)."""
    pp: _Degree = 1
    """Pipeline-parallel degree; only 1 is accepted (:data:`PIPELINE_UNSUPPORTED` says why). The layout planner and
    the mesh still place pp stages, for the day the stage runs a pipeline schedule."""
    sharding_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage over the data-parallel group: 0 none, 1 optimizer states, 2 + gradients, 3 + weights."""
    single_process: Literal["auto_parallel", "plain"] = "auto_parallel"
    """World size 1: auto_parallel wraps the model as at any other size (a mesh of one: on CPU 1.25× the tokens/s
    of the plain model, docs/benchmarks.md); plain trains it as it is, no distributed tensors.
    benchmarks/gpu_check.sh measures both on a GPU."""

    def __post_init__(self) -> None:  # rules across the degrees; each one's range is its field's
        inferred = None
        for key in ("dp", "mp", "pp"):
            value = getattr(self, key)
            check(value != 0, f"training.parallel.{key}", "0 is not a degree (use a positive number or -1)")
            check(value != -1 or inferred is None, f"training.parallel.{key}",
                  f"only one of dp, mp, pp may be -1 (inferred from the world size); {inferred} is -1 already")
            inferred = key if value == -1 else inferred


@block
class BatchConfig:
    micro_batch_size: _Positive = 8
    """Sequences per data-parallel rank per forward/backward."""
    global_batch_size: _Positive = 8
    """Sequences per optimizer step: micro_batch_size × dp × gradient-accumulation steps."""
    seq_length: int = Field(128, ge=2)
    """Tokens per training window (at least 2, at most the model's max_position_embeddings)."""


@block
class OptimizerConfig:
    learning_rate: float = Field(3.5e-3, gt=0)
    """Peak learning rate at reference_batch_size; scaled to the global batch by lr_scaling."""
    reference_batch_size: _Positive = 8
    """Global batch size (sequences) at which learning_rate applies unscaled."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """linear: twice the global batch, twice the rate (the usual rule of thumb); sqrt: √ of the ratio."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine decay ends at this fraction of the peak rate, in [0, 1]."""
    warmup_steps: _Count = 30
    """Optimizer steps of linear warm-up to the peak rate, before the cosine decay."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW decoupled weight decay; not applied to 1-D parameters (norms)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW decay rate of the first-moment (mean gradient) estimate, in [0, 1)."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW decay rate of the second-moment (squared gradient) estimate, in [0, 1)."""
    epsilon: float = Field(1e-8, gt=0)
    """AdamW term added to the denominator for numerical stability."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip gradients by global norm (0 = off)."""

    def scaled_learning_rate(self, global_batch_size: int) -> float:
        ratio = global_batch_size / self.reference_batch_size
        return self.learning_rate * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_scaling]


@block
class PrecisionConfig:
    amp: bool = False
    """Mixed precision; needs a GPU."""
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Low-precision type under amp; float16 adds a dynamic loss scale, bfloat16 needs none."""
    level: Literal["O1", "O2"] = "O1"
    """O1: float32 weights, white-listed ops in low precision; O2: low-precision weights with float32 master
    copies in the optimizer."""
    master_grad: bool = False
    """O2: keep weight gradients in float32 (Paddle's ``master_grad``), so micro-batches accumulate, clip and
    update in float32; one float32 gradient per weight more memory."""
    recompute: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""


@block
class ScheduleConfig:
    max_steps: _Positive = 1400
    """Optimizer steps of the whole schedule (the cosine decay ends here)."""
    log_every: _Positive = 25
    """Log loss, learning rate, gradient norm, throughput and MFU every this many steps."""
    eval_every: _Positive = 200
    """Compute the validation loss every this many steps, and at the last step."""
    eval_batches: _Positive = 8
    """Validation batches of global_batch_size windows per evaluation (the first windows of the split)."""
    checkpoint_every: _Positive = 200
    """Write a checkpoint every this many steps, and at the last step."""
    keep_last: _Count = 4
    """Complete checkpoints kept on disk (the newest); 0 keeps all."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint of this run (catalog entry ``checkpoints``)."""
    seed: int = Field(1234, ge=0, le=2**64 - 1)
    """Seed of parameter initialisation and of the order of training windows (0 to 2**64 - 1)."""
    stop_after: _Positive | None = setting(None, note="null = the whole schedule")
    """Stop (with a checkpoint) after this step without finishing the schedule: tests and time-boxed jobs. A rerun
    without it (or with a later one) resumes in the same checkpoint folder."""


@block
class DeviceConfig:
    type: Literal["cpu", "gpu"] = "cpu"
    """Device of every worker process; gpu needs the paddlepaddle-gpu wheel."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak dense TFLOP/s of one device in the training dtype, for MFU; null = a short matmul calibration."""


@block
class LaunchConfig:
    nproc_per_node: _Positive = 1
    """Worker processes per node (one per GPU on gpu); the world size is nproc_per_node × nnodes."""
    cpu_threads: int = setting(1, ge=0, le=1024, note="0 = cores ÷ nproc_per_node")
    """OpenMP/MKL threads of each CPU worker (OMP/MKL/OPENBLAS_NUM_THREADS unless the environment sets them); 0 =
    the node's cores ÷ nproc_per_node. The CPU demo's one worker runs faster with one thread than with two."""
    nnodes: _Positive = 1
    """Machines in the job; more than 1 needs master."""
    master: str | None = None
    """host:port of node 0; needed when nnodes > 1."""
    node_rank: _Count = 0
    """This machine's rank, 0 .. nnodes - 1; node 0 runs the pipeline, the others join with train-deploy-join."""
    max_restart: _Count = 0
    """Failed workers are relaunched this many times and resume from the last complete checkpoint (Paddle's
    launcher does it itself in elastic mode, with an etcd:// master; otherwise the training node does)."""
    job_id: str = "train_deploy"
    """Paddle launcher job name; nodes of one job must share it."""
    stall_timeout: _Seconds = setting(1800, unit="seconds")
    """Seconds rank 0 may report no step (nor checkpoint) before the job is stopped as hung and fails naming
    it; longer than log_every steps, an evaluation and a checkpoint take. Until its first step (start-up, the
    other nodes joining, building the model, resuming) it may be silent twice as long, at least 10 minutes."""

    metrics_timeout: _SecondsOrZero = setting(30, unit="seconds")
    """Seconds the training node keeps trying, after training ends, to send MLflow the metrics it could not send
    while the tracking server was down; past it, it warns (every metric stays in metrics.jsonl)."""
    environment: list[str] = field(default_factory=list)
    """Further environment variables the workers get, as names or shell patterns (``MY_DATA_*``): by default
    they get only what Python, Paddle and the CPU/GPU libraries read (``training/launch.py``,
    ``WORKER_VARIABLES``), since the launcher writes every variable it gets into its log folder. A variable
    that holds a credential is never passed, listed or not."""
    elastic: ElasticConfig | None = None
    """Elastic mode, ``{min_nodes, max_nodes, etcd, timeout_s}`` (``train_deploy.training.elastic``); null = off."""

    def __post_init__(self) -> None:  # rules across keys, and a pattern's error that shows what one looks like
        check(self.node_rank < self.nnodes, "training.launch.node_rank",
              f"must be 0 .. launch.nnodes - 1 = {self.nnodes - 1} (got {self.node_rank})")
        check(self.nnodes == 1 or bool(self.master), "training.launch.master",
              "a multi-node job needs host:port of node 0 (the same on every node)")
        for i, pattern in enumerate(self.environment):
            check(isinstance(pattern, str) and re.fullmatch(r"[A-Za-z0-9_*?]+", pattern) is not None,
                  f"training.launch.environment[{i}]", f"must be a variable name or a shell pattern such as "
                  f"MY_DATA_* (got {str(pattern)[:40]!r})")


@block
class TrainingConfig:
    """The whole ``training`` parameter block, in the file's order (its JSON form, :func:`to_dict`, is recorded in
    each checkpoint's ``state.json``)."""

    init_from: str = "scratch"
    """Where the weights start: `scratch` (random, seeded); `champion` (the registered champion's weights and
    tokenizer; scratch when there is none or the tokenizer configuration changed); or a local folder holding a
    PaddleNLP Llama-family causal LM saved by `save_pretrained(folder, safe_serialization=True)` with its
    tokenizer: the corpus stage encodes with that tokenizer and the shape comes from its config.json (`model` is
    ignored). Weights only: the optimizer and the schedule, warm-up included, start afresh
    (``train_deploy.training.pretrained``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape (`training.model`)."""
    layout: Literal["manual", "auto"] = "manual"
    """manual: `parallel`, `batch.micro_batch_size` and `precision.recompute` as set; auto: chosen at launch from
    the parameter count, the devices, their memory and the global batch, logged in one line with the reason and
    the memory estimate per device (``train_deploy.training.layout``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel degrees (`training.parallel`)."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batch sizes and sequence length (`training.batch`)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and its learning-rate schedule (`training.optimizer`)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision and recomputation (`training.precision`)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Steps, logging, evaluation and checkpoints (`training.schedule`)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Hardware (`training.device`)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Processes and nodes (`training.launch`)."""
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    """VisualDL logs and MLflow system metrics (`training.monitoring`, ``train_deploy.training.monitoring``)."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> TrainingConfig:
        """The block of a run; pp > 1 is refused here, not in ParallelConfig, so that the layout planner can still
        be given pipeline stages in code."""
        config = from_mapping(cls, params, "training")
        check(config.parallel.pp == 1, "training.parallel.pp", PIPELINE_UNSUPPORTED)
        return config

    def __post_init__(self) -> None:
        check(bool(str(self.init_from).strip()), "training.init_from", "must be scratch, champion or a model folder")

    @property
    def world_size(self) -> int:
        return self.launch.nproc_per_node * self.launch.nnodes

    def identity(self, start: str) -> dict[str, Any]:
        """What determines the trained weights besides the data: model shape, optimizer, global batch, sequence
        length, precision, seed and schedule length, with defaults filled in; and a warm start's source ``start``
        (``train_deploy.training.pretrained.init_identity`` of ``init_from``: ``scratch``, ``champion``, or a folder
        by its content hash, not its path, standing for the shape too).

        Cadences and housekeeping (logging, evaluation, checkpoints, ``stop_after``, ``resume``), recompute, the
        micro-batch, the parallel layout, the launch and the device are left out: a rerun that changes only them,
        such as a time-boxed job continued, resumes where it stopped, on any machine, and is not a change worth
        retraining for (``train_deploy.run_control.retrain``).
        """
        b, p, s = self.batch, self.precision, self.schedule
        return {
            # a folder's config.json gives the shape, and its content hash names it with the weights
            "model": {"init_from": start} if start.startswith("folder:") else self.model.shape(),
            "optimizer": to_dict(self.optimizer),
            "batch": {"global_batch_size": b.global_batch_size, "seq_length": b.seq_length},
            "precision": {"amp": p.amp, "dtype": p.dtype, "level": p.level} if p.amp else {"amp": False},
            "schedule": {"max_steps": s.max_steps, "seed": s.seed},
            **({} if start == "scratch" else {"init_from": start}),
        }


@dataclass(frozen=True, slots=True)
class Layout:
    """Resolved parallel degrees and batch split."""

    dp: int
    mp: int
    pp: int
    sharding_stage: int
    accumulation_steps: int

    @property
    def world_size(self) -> int:
        return self.dp * self.mp * self.pp


def resolve_layout(config: TrainingConfig, world_size: int, vocab_size: int) -> Layout:
    """Check every invariant of the parallel layout at start-up; each error says what to change.

    ``config`` comes from :meth:`TrainingConfig.from_params`, which has checked each degree on its own."""
    p, b, shape = config.parallel, config.batch, config.model.shape()
    known = math.prod(v for v in (p.dp, p.mp, p.pp) if v != -1)
    if world_size % known:
        raise ConfigError(f"training.parallel: dp × mp × pp = {known} does not divide the world size {world_size} "
                          "(launch.nproc_per_node × launch.nnodes)")
    dp, mp, pp = (world_size // known if v == -1 else v for v in (p.dp, p.mp, p.pp))
    if dp * mp * pp != world_size:
        raise ConfigError(f"training.parallel: dp × mp × pp = {dp} × {mp} × {pp} = {dp * mp * pp} but the world size "
                          f"is {world_size}; change the degrees or launch.nproc_per_node × launch.nnodes")
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("hidden_size", shape["hidden_size"]), ("intermediate_size", shape["intermediate_size"])):
        if value % mp:
            raise ConfigError(f"training.model: {key} = {value} is not divisible by mp = {mp}; choose mp among the "
                              f"divisors of {value}")
    if vocab_size % mp:
        raise ConfigError(f"training.parallel.mp: the tokenizer's vocabulary ({vocab_size}) is not divisible by "
                          f"mp = {mp}; retrain the tokenizer with a vocab_size that is")
    if shape["num_hidden_layers"] % pp:
        raise ConfigError(f"training.parallel.pp: num_hidden_layers = {shape['num_hidden_layers']} is not divisible "
                          f"by pp = {pp}")
    if config.parallel.sharding_stage >= 2 and config.device.type == "cpu":
        raise ConfigError(f"training.parallel.sharding_stage: stage {config.parallel.sharding_stage} needs GPUs: it "
                          "reduce-scatters gradients, which Paddle's CPU backend lacks; use sharding_stage 1 on CPU")
    if config.parallel.sharding_stage and dp == 1:
        raise ConfigError("training.parallel.sharding_stage: sharding splits state over the data-parallel group, "
                          "which has one rank here; set sharding_stage: 0 or dp > 1")
    if b.seq_length > shape["max_position_embeddings"]:
        raise ConfigError(f"training.batch.seq_length: {b.seq_length} exceeds the model's max_position_embeddings "
                          f"({shape['max_position_embeddings']}); shorten it or raise the model's")
    if config.precision.amp and config.device.type == "cpu":
        raise ConfigError("training.precision.amp: mixed precision needs a GPU (Paddle's CPU kernels do not cover "
                          "bfloat16/float16 training); set amp: false on CPU")
    per_step = b.micro_batch_size * dp
    if b.global_batch_size % per_step:
        raise ConfigError(f"training.batch.global_batch_size: {b.global_batch_size} is not a multiple of "
                          f"micro_batch_size × dp = {b.micro_batch_size} × {dp} = {per_step}")
    return Layout(dp=dp, mp=mp, pp=pp, sharding_stage=config.parallel.sharding_stage,
                  accumulation_steps=b.global_batch_size // per_step)


def check_vocabulary(tokenizer_vocab: int, model_vocab: int) -> None:
    """The model must have an embedding row for every id the tokenizer produces."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(f"training.model.overrides.vocab_size: the model has {model_vocab} embeddings but the "
                          f"tokenizer produces {tokenizer_vocab} ids; remove the override to use the tokenizer's")
