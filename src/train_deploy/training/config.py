"""Typed configuration of the training stage (``conf/base/parameters_training.yml``, block ``training``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from train_deploy.config import ConfigError, check, check_range, from_mapping, to_dict

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


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "small"
    """One of tiny (tests), small (CPU demo), 350m, 1.3b (GPU)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Any LlamaConfig field over the preset, e.g. {num_hidden_layers: 8}."""

    def shape(self) -> dict[str, Any]:
        check(self.preset in PRESETS, "training.model.preset", f"{self.preset!r} is not one of {', '.join(PRESETS)}")
        return {**PRESETS[self.preset], **self.overrides}


PIPELINE_UNSUPPORTED = (
    "pipeline parallelism is not supported, set pp: 1 and use dp, mp and sharding_stage: in Paddle 3.3's "
    "dynamic-graph auto-parallel the loss exists only on the last stage, there is no micro-batch schedule (PaddleNLP "
    "runs pp only through dist.to_static), and the gradient norm and checkpoints would have to cross stages; on CPU, "
    "gloo also has no point-to-point send/recv")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    dp: int = -1
    """Data-parallel degree; -1 = world size / (mp × pp)."""
    mp: int = 1
    """Tensor-parallel degree (heads, hidden and vocabulary split over mp ranks)."""
    pp: int = 1
    """Pipeline-parallel degree; only 1 is accepted (:data:`PIPELINE_UNSUPPORTED` says why). The layout planner and
    the mesh still place pp stages, for the day the stage runs a pipeline schedule."""
    sharding_stage: int = 0
    """ZeRO stage over the data-parallel group: 0 none, 1 optimizer states, 2 + gradients, 3 + weights."""
    single_process: Literal["auto_parallel", "plain"] = "auto_parallel"
    """World size 1: auto_parallel wraps the model as at any other size (a mesh of one: on CPU 1.25× the tokens/s
    of the plain model, docs/benchmarks.md); plain trains it as it is, no distributed tensors.
    benchmarks/gpu_check.sh measures both on a GPU."""


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    micro_batch_size: int = 8
    """Sequences per data-parallel rank per forward/backward."""
    global_batch_size: int = 8
    """Sequences per optimizer step: micro_batch_size × dp × gradient-accumulation steps."""
    seq_length: int = 128
    """Tokens per training window (at least 2, at most the model's max_position_embeddings)."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    learning_rate: float = 3.5e-3
    """Peak learning rate at reference_batch_size; scaled to the global batch by lr_scaling."""
    reference_batch_size: int = 8
    """Global batch size (sequences) at which learning_rate applies unscaled."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """linear: twice the global batch, twice the rate (the usual rule of thumb); sqrt: √ of the ratio."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at this fraction of the peak rate, in [0, 1]."""
    warmup_steps: int = 30
    """Optimizer steps of linear warm-up to the peak rate, before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay; not applied to 1-D parameters (norms)."""
    beta1: float = 0.9
    """AdamW decay rate of the first-moment (mean gradient) estimate, in [0, 1)."""
    beta2: float = 0.95
    """AdamW decay rate of the second-moment (squared gradient) estimate, in [0, 1)."""
    epsilon: float = 1e-8
    """AdamW term added to the denominator for numerical stability."""
    grad_clip: float = 1.0
    """Clip gradients by global norm (0 = off)."""

    def scaled_learning_rate(self, global_batch_size: int) -> float:
        ratio = global_batch_size / self.reference_batch_size
        return self.learning_rate * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_scaling]


@dataclass(kw_only=True, slots=True)
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


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    max_steps: int = 1400
    """Optimizer steps of the whole schedule (the cosine decay ends here)."""
    log_every: int = 25
    """Log loss, learning rate, gradient norm, throughput and MFU every this many steps."""
    eval_every: int = 200
    """Compute the validation loss every this many steps, and at the last step."""
    eval_batches: int = 8
    """Validation batches of global_batch_size windows per evaluation (the first windows of the split)."""
    checkpoint_every: int = 200
    """Write a checkpoint every this many steps, and at the last step."""
    keep_last: int = 4
    """Complete checkpoints kept on disk (the newest); 0 keeps all."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest complete checkpoint of this run (catalog entry ``checkpoints``)."""
    seed: int = 1234
    """Seed of parameter initialisation and of the order of training windows (0 to 2**64 - 1)."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this step without finishing the schedule: tests and time-boxed jobs. A rerun
    without it (or with a later one) resumes in the same checkpoint folder."""


@dataclass(kw_only=True, slots=True)
class DeviceConfig:
    type: Literal["cpu", "gpu"] = "cpu"
    """Device of every worker process; gpu needs the paddlepaddle-gpu wheel."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device in the training dtype, for MFU; null = a short matmul calibration."""


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    nproc_per_node: int = 1
    """Worker processes per node (one per GPU on gpu); the world size is nproc_per_node × nnodes."""
    cpu_threads: int = 1
    """OpenMP/MKL threads of each CPU worker (OMP/MKL/OPENBLAS_NUM_THREADS unless the environment sets them); 0 =
    the node's cores ÷ nproc_per_node. The CPU demo's one worker runs faster with one thread than with two."""
    nnodes: int = 1
    """Machines in the job; more than 1 needs master."""
    master: str | None = None
    """host:port of node 0; needed when nnodes > 1."""
    node_rank: int = 0
    """This machine's rank, 0 .. nnodes - 1; node 0 runs the pipeline, the others join with train-deploy-join."""
    max_restart: int = 0
    """Failed workers are relaunched this many times and resume from the last complete checkpoint (Paddle's
    launcher does it itself in elastic mode, with an etcd:// master; otherwise the training node does)."""
    job_id: str = "train_deploy"
    """Paddle launcher job name; nodes of one job must share it."""
    stall_timeout: int | float = 1800
    """Seconds rank 0 may report no step (nor checkpoint) before the job is stopped as hung and fails naming
    it; longer than log_every steps, an evaluation and a checkpoint take. Until its first step (start-up, the
    other nodes joining, building the model, resuming) it may be silent twice as long, at least 10 minutes."""

    metrics_timeout: int | float = 30
    """Seconds the training node keeps trying, after training ends, to send MLflow the metrics it could not send
    while the tracking server was down; past it, it warns (every metric stays in metrics.jsonl)."""
    environment: list[str] = field(default_factory=list)
    """Further environment variables the workers get, as names or shell patterns (``MY_DATA_*``): by default
    they get only what Python, Paddle and the CPU/GPU libraries read (``training/launch.py``,
    ``WORKER_VARIABLES``), since the launcher writes every variable it gets into its log folder. A variable
    that holds a credential is never passed, listed or not."""

    def __post_init__(self) -> None:
        check_range("training.launch.cpu_threads", self.cpu_threads, 0, 1024, note="0 = cores ÷ nproc_per_node")
        check(self.stall_timeout > 0, "training.launch.stall_timeout",
              f"must be a positive number of seconds (got {self.stall_timeout!r})")
        check(self.metrics_timeout >= 0, "training.launch.metrics_timeout",
              f"must be a number of seconds, at least 0 (got {self.metrics_timeout!r})")
        for i, pattern in enumerate(self.environment):
            check(isinstance(pattern, str) and re.fullmatch(r"[A-Za-z0-9_*?]+", pattern) is not None,
                  f"training.launch.environment[{i}]", f"must be a variable name or a shell pattern such as "
                  f"MY_DATA_* (got {str(pattern)[:40]!r})")


@dataclass(kw_only=True, slots=True)
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

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> TrainingConfig:
        config = from_mapping(cls, params, "training")
        _check_block(config)
        return config

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


def _check_block(config: TrainingConfig) -> None:
    """Every key of the block within its range, naming the key; the layout against the world size and the
    tokenizer is :func:`resolve_layout`'s."""
    shape = config.model.shape()
    for key in PRESETS["tiny"].keys() & config.model.overrides.keys():
        check(type(shape[key]) is int and shape[key] >= 1, f"training.model.overrides.{key}",
              f"must be a positive integer (got {shape[key]!r})")
    p, b, o, s, la = config.parallel, config.batch, config.optimizer, config.schedule, config.launch
    inferred = None
    for key in ("dp", "mp", "pp"):
        value = getattr(p, key)
        check(value >= 1 or value == -1, f"training.parallel.{key}",
              f"{value} is not a degree (use a positive number or -1)")
        check(value != -1 or inferred is None, f"training.parallel.{key}",
              f"only one of dp, mp, pp may be -1 (inferred from the world size); {inferred} is -1 already")
        inferred = key if value == -1 else inferred
    check(bool(str(config.init_from).strip()), "training.init_from", "must be scratch, champion or a model folder")
    check(p.sharding_stage in (0, 1, 2, 3), "training.parallel.sharding_stage", "must be 0, 1, 2 or 3")
    check(p.pp == 1, "training.parallel.pp", PIPELINE_UNSUPPORTED)
    check_range("training.batch.micro_batch_size", b.micro_batch_size, 1)
    check_range("training.batch.global_batch_size", b.global_batch_size, 1)
    check_range("training.batch.seq_length", b.seq_length, 2)
    check_range("training.optimizer.learning_rate", o.learning_rate, 0, open_low=True)
    check_range("training.optimizer.reference_batch_size", o.reference_batch_size, 1)
    check_range("training.optimizer.min_lr_ratio", o.min_lr_ratio, 0, 1)
    check_range("training.optimizer.warmup_steps", o.warmup_steps, 0)
    check_range("training.optimizer.weight_decay", o.weight_decay, 0)
    check_range("training.optimizer.beta1", o.beta1, 0, 1, open_high=True)
    check_range("training.optimizer.beta2", o.beta2, 0, 1, open_high=True)
    check_range("training.optimizer.epsilon", o.epsilon, 0, open_low=True)
    check_range("training.optimizer.grad_clip", o.grad_clip, 0, note="0 = off")
    for key in ("max_steps", "log_every", "eval_every", "eval_batches", "checkpoint_every"):
        check_range(f"training.schedule.{key}", getattr(s, key), 1)
    check_range("training.schedule.keep_last", s.keep_last, 0, note="0 keeps all")
    check_range("training.schedule.seed", s.seed, 0, 2**64 - 1, note="Paddle's seed range")
    check_range("training.schedule.stop_after", s.stop_after, 1, note="null = the whole schedule")
    check_range("training.device.peak_tflops", config.device.peak_tflops, 0, open_low=True,
                note="null = a short matmul calibration")
    check_range("training.launch.nproc_per_node", la.nproc_per_node, 1)
    check_range("training.launch.nnodes", la.nnodes, 1)
    check(0 <= la.node_rank < la.nnodes, "training.launch.node_rank",
          f"must be 0 .. launch.nnodes - 1 = {la.nnodes - 1} (got {la.node_rank})")
    check_range("training.launch.max_restart", la.max_restart, 0)
    check(la.nnodes == 1 or bool(la.master), "training.launch.master",
          "a multi-node job needs host:port of node 0 (the same on every node)")


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
