"""Training worker: one process per device, started by Paddle's launcher.

    # 1 process
    python -m paddle.distributed.launch --nproc_per_node 1 worker.py --run run.json
    # N processes on one machine
    python -m paddle.distributed.launch --nproc_per_node N worker.py --run run.json
    # N nodes: the same command on every node, with its own --rank (0 .. N-1)
    python -m paddle.distributed.launch --nnodes N --master HOST:PORT --rank R --nproc_per_node G \
        worker.py --run run.json

``run.json`` is the :class:`~train_deploy.training.spec.RunSpec` the training node writes
(``train_deploy.training.launch``): the validated training configuration and its resolved layout (deserialised
here, not validated again), the token files, the checkpoint and log folders. Rank 0 writes its metrics to
``metrics.jsonl`` and its log; the training node sends them to MLflow, so no worker needs its credentials.
:func:`main` reads top to bottom: set-up, model, optimizer, parallelize, resume, then the loop: steps of gradient
accumulation, clipping and AdamW, with metrics, evaluation and checkpoints. Only rank 0 logs and writes; every
rank joins the collectives.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.config import ConfigError
from train_deploy.handoffs import CheckpointState, TrainingResult, read_json, to_json, write_json
from train_deploy.progress import eta_text
from train_deploy.training.checkpoint import (
    latest_intact_checkpoint,
    restore_training_state,
    step_dir,
    training_state,
    write_checkpoint,
)
from train_deploy.training.config import Layout, TrainingConfig, resolve_layout
from train_deploy.training.data import TokenWindows
from train_deploy.training.elastic import record_formation
from train_deploy.training.evaluation import mean_token_loss, next_token_loss, perplexity, validation_windows
from train_deploy.training.metrics import (
    MetricsLog,
    Throughput,
    blas_threads,
    calibrated_peak_flops,
    grad_norm,
    memory_mb,
)
from train_deploy.training.model import build_model, flops_per_token
from train_deploy.training.monitoring import VISUALDL_DIR, VisualDLLog
from train_deploy.training.parallelize import data_rank, parallelize
from train_deploy.training.spec import RunSpec

logger = logging.getLogger("train_deploy.training.worker")


def main(argv: list[str] | None = None) -> None:
    """Train the run ``--run`` describes (a ``RunSpec``), continuing from its latest checkpoint."""
    spec = read_json(RunSpec, Path(_parse(argv).run))
    job = set_up(spec)
    config = job.config

    # model, optimizer, parallelism: each step wraps what the one before built
    model = build_model(config, spec.data.vocab_size, spec.data.eos_id)
    warm_start(model, spec)
    size = ModelSize.of(model)
    optimizer, lr = build_optimizer(model, config)
    model, optimizer, mesh = parallelize(model, optimizer, layout=job.layout, device=config.device.type,
                                         single=config.parallel.single_process)
    model, scaler = apply_precision(model, config, distributed=mesh is not None)
    trainer = Trainer(model=model, optimizer=optimizer, lr=lr, scaler=scaler, mesh=mesh, job=job)

    # resume, data, metrics
    progress = resume(trainer)
    train = TokenWindows(Path(spec.data.train_prefix), config.batch.seq_length, config.schedule.seed,
                         spec.data.dtype)
    valid = validation_set(job)
    metrics = MetricsLog(spec.metrics_path, enabled=job.is_master)
    board = VisualDLLog(Path(spec.logs) / VISUALDL_DIR, enabled=job.is_master and config.monitoring.visualdl)
    throughput = _throughput(job, size)
    logger.info("Model: %s, %.2f M parameters, %.1f MFLOP/token; layout dp=%d mp=%d pp=%d sharding=%d, "
                "%d accumulation step(s), peak lr %.3g", config.model.preset, size.parameters / 1e6,
                throughput.flops_per_token / 1e6, job.layout.dp, job.layout.mp, job.layout.pp,
                job.layout.sharding_stage, job.layout.accumulation_steps, lr.base_lr)
    if config.launch.elastic is not None and job.is_master:  # every formation after the first is a re-form
        if reform := record_formation(Path(spec.logs), job.world, progress.step):
            metrics.log(progress.step, reform)

    # loop
    train_loop(trainer, progress, train, valid, metrics, throughput, size, board)
    board.close()
    if job.is_master:
        write_json(spec.result_path, _result(job, progress, size, valid))
    finish(job)


# --- set-up ----------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Job:
    """This process's place in the run, fixed at start-up."""

    spec: RunSpec
    config: TrainingConfig
    layout: Layout
    world: int
    rank: int
    is_master: bool
    dp_rank: int
    """Index along the data-parallel axis: which share of each global batch this rank reads."""


def set_up(spec: RunSpec) -> Job:
    """Join the process group with the configuration and layout the training node validated and resolved, pick
    the device and seed."""
    import paddle
    import paddle.distributed as dist

    config, layout = spec.training, spec.layout
    world, rank = dist.get_world_size(), dist.get_rank()
    if config.launch.elastic is not None:  # the nodes of this formation; the launch checked every size it may have
        layout = resolve_layout(config, world, config.model.shape().get("vocab_size", spec.data.vocab_size))
    if world != layout.world_size:
        raise ConfigError(f"training.launch: the launcher started {world} worker(s), the run's layout "
                          f"(dp × mp × pp = {layout.world_size}) was resolved for launch.nproc_per_node × "
                          "launch.nnodes; start every node with the same run.json")
    is_master = rank == 0
    logging.basicConfig(level=logging.INFO if is_master else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s", stream=sys.stdout)
    if world > 1:
        select_backend(config.device.type)
        dist.init_parallel_env()
    paddle.set_device("gpu" if config.device.type == "gpu" else "cpu")
    paddle.seed(config.schedule.seed)
    return Job(spec=spec, config=config, layout=layout, world=world, rank=rank, is_master=is_master,
               dp_rank=data_rank(rank, layout))


def select_backend(device: str) -> str:
    """The collective backend of ``device``, set where ``init_parallel_env`` reads it: gloo for cpu whatever wheel
    is installed (with the GPU wheel Paddle's default is NCCL, which cannot reduce CPU tensors); Paddle's own
    choice (NCCL) for gpu."""
    backend = "gloo" if device == "cpu" else os.environ.get("PADDLE_DISTRI_BACKEND", "auto")
    os.environ["PADDLE_DISTRI_BACKEND"] = backend
    return backend


def finish(job: Job) -> None:
    if job.world > 1:
        import paddle.distributed as dist

        # Leave together: a rank that exits while a peer still holds open connections makes gloo abort the
        # peer at shutdown ("Connection reset by peer"), failing a finished job.
        dist.barrier()
        dist.destroy_process_group()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="train_deploy training worker")
    parser.add_argument("--run", required=True, help="run.json written by the training node")
    return parser.parse_args(argv)


# --- model and optimizer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSize:
    parameters: int
    embedding: int

    @classmethod
    def of(cls, model) -> ModelSize:
        return cls(parameters=sum(int(np.prod(p.shape)) for p in model.parameters()),
                   embedding=int(np.prod(model.llama.embed_tokens.weight.shape)))


def build_optimizer(model, config: TrainingConfig):
    """AdamW with the peak rate scaled to the global batch, warm-up then cosine decay; norms not decayed."""
    import paddle

    o, s = config.optimizer, config.schedule
    peak_lr = o.scaled_learning_rate(config.batch.global_batch_size)
    lr = paddle.optimizer.lr.LambdaDecay(peak_lr, _lr_lambda(o.warmup_steps, s.max_steps, o.min_lr_ratio))
    optimizer = paddle.optimizer.AdamW(
        learning_rate=lr, parameters=model.parameters(), beta1=o.beta1, beta2=o.beta2, epsilon=o.epsilon,
        weight_decay=o.weight_decay, apply_decay_param_fun=DecayRule(model),
        grad_clip=paddle.nn.ClipGradByGlobalNorm(o.grad_clip) if o.grad_clip > 0 else None,
        # AMP O2: float32 master copies of the low-precision weights, updated by every step (PaddleNLP's Trainer)
        multi_precision=config.precision.amp and config.precision.level == "O2",
    )
    return optimizer, lr


def warm_start(model, spec: RunSpec) -> None:
    """Load the weights of the run's init source (``training.init_from``) into the model every rank built, before
    it is parallelised; weights only: the optimizer and schedule start afresh. Resuming replaces them later."""
    if spec.init is None or not spec.init.path:
        return
    from train_deploy.training.pretrained import load_pretrained_weights

    load_pretrained_weights(model, Path(spec.init.path))
    logger.info("Weights from %s (%s, content hash %s); optimizer and schedule from scratch", spec.init.path,
                spec.init.started_from, spec.init.hash[:12])


class DecayRule:
    """AdamW's ``apply_decay_param_fun``: decay every parameter but the 1-D ones (norms), whatever Paddle names
    them. Auto-parallel renames the parameters after the optimizer is built (``linear_0.w_0`` becomes
    ``linear_0.w_0.dist``), so the names are read from ``model`` when one is first asked for."""

    def __init__(self, model) -> None:
        self._model = model
        self._decayed: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        if name not in self._decayed:
            self._decayed = {p.name: p.ndim > 1 for p in self._model.parameters()}
        return self._decayed[name]


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to the peak, then cosine decay to ``min_ratio`` of it at ``total`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def apply_precision(model, config: TrainingConfig, distributed: bool):
    """Mixed precision on the parallelised model, as PaddleNLP's AutoTrainer orders it (parallelize, then
    decorate): O2 casts the weights to the low-precision type in place, the optimizer keeps float32 masters
    (``multi_precision``). float16 needs a dynamic loss scale to keep small gradients representable; across
    ranks ``dist.shard_scaler`` makes an overflow on one rank skip the step on all. Return the model and the
    scaler (None without float16)."""
    import paddle
    import paddle.distributed as dist

    amp = config.precision
    if amp.amp and amp.level == "O2":
        model = paddle.amp.decorate(models=model, level="O2", dtype=amp.dtype, master_grad=amp.master_grad)
    if not (amp.amp and amp.dtype == "float16"):
        return model, None
    scaler = paddle.amp.GradScaler(init_loss_scaling=2.0**15)
    return model, dist.shard_scaler(scaler) if distributed else scaler


@dataclass(kw_only=True, slots=True)
class Trainer:
    """The parallelised model and what updates it."""

    model: Any
    optimizer: Any
    lr: Any
    """The learning-rate schedule (``paddle.optimizer.lr.LambdaDecay``); its position is the step."""
    scaler: Any | None
    """float16's loss scale, else None."""
    mesh: Any | None
    """The process mesh; None when the model is trained plain (one process, ``parallel.single_process: plain``)."""
    job: Job

    def loss(self, windows: np.ndarray):
        """Mean next-token loss of the global batch whose data-parallel share on this rank is ``windows``."""
        import paddle

        amp = self.job.config.precision
        with paddle.amp.auto_cast(enable=amp.amp, level=amp.level, dtype=amp.dtype):
            logits = self.model(input_ids=self._sharded(windows[:, :-1]))
        return next_token_loss(logits, self._sharded(windows[:, 1:]))

    def batch_loss(self, batch: np.ndarray) -> tuple[float, int]:
        """``evaluation.BatchLoss`` of ``micro_batch_size × dp`` windows: each rank forwards its own share."""
        micro, share = self.job.config.batch.micro_batch_size, self.job.dp_rank
        tokens = int(batch[:, 1:].size)
        return float(self.loss(batch[share * micro : (share + 1) * micro])) * tokens, tokens

    def update(self, measure_norm: bool) -> float | None:
        """Apply the accumulated gradients (unscaled, clipped); return their norm if ``measure_norm``."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient norm
        norm = grad_norm(self.model) if measure_norm else None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.clear_grad()
        return norm

    def _sharded(self, array: np.ndarray):
        """``array`` (this rank's rows) as the global tensor whose rows are split over the dp axis (the plain
        tensor when the model is not parallelised)."""
        import paddle
        import paddle.distributed as dist

        if self.mesh is None:
            return paddle.to_tensor(array)
        placements = [dist.Shard(0)] + [dist.Replicate()] * (len(self.mesh.shape) - 1)  # mesh [dp, mp]
        return dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(array), self.mesh, placements)


# --- resume ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Progress:
    """Where the loop is: what a checkpoint records and a resumed run continues from."""

    step: int = 0
    consumed_samples: int = 0
    """Global sample index of the next batch (``TokenWindows`` order)."""
    val_loss: float | None = None
    """The last evaluation's."""


def resume(trainer: Trainer) -> Progress:
    """Continue from the run's latest intact checkpoint (``schedule.resume: auto``), else from step 0."""
    job = trainer.job
    latest = resume_point(job) if job.config.schedule.resume == "auto" else None
    if latest is None:
        return Progress()
    state = restore_training_state(trainer.model, trainer.optimizer, latest)
    progress = Progress(step=state.step, consumed_samples=state.consumed_samples or 0)
    trainer.lr.last_epoch = progress.step
    trainer.lr.last_lr = trainer.lr.get_lr()
    logger.info("Resumed from %s: step %d, %d samples consumed (saved with dp=%d mp=%d, now dp=%d mp=%d)",
                latest, progress.step, progress.consumed_samples, state.layout["dp"], state.layout["mp"],
                job.layout.dp, job.layout.mp)
    return progress


def resume_point(job: Job) -> Path | None:
    """The checkpoint every rank resumes from: rank 0 verifies them, newest first, and moves damaged ones
    aside (:func:`latest_intact_checkpoint`); its choice is broadcast, so no rank sees a folder half-moved."""
    folder = Path(job.spec.checkpoints)
    chosen = latest_intact_checkpoint(folder) if job.is_master else None
    if job.world > 1:
        import paddle
        import paddle.distributed as dist

        step = paddle.to_tensor([-1 if chosen is None else int(chosen.name.removeprefix("step_"))], dtype="int64")
        dist.broadcast(step, src=0)
        chosen = None if int(step.item()) < 0 else step_dir(folder, int(step.item()))
    return chosen


def validation_set(job: Job) -> np.ndarray | None:
    """The windows every evaluation uses: the split's first ``eval_batches × global_batch_size``, in whole
    evaluation batches of ``micro_batch_size × dp``; None (with a warning) when there is not one batch."""
    b, data = job.config.batch, job.spec.data
    rows = b.micro_batch_size * job.layout.dp
    try:
        windows = validation_windows(data.valid_prefix, data.dtype, b.seq_length,
                                     job.config.schedule.eval_batches * b.global_batch_size)
    except (ValueError, FileNotFoundError) as exc:
        logger.warning("No validation: %s", exc)
        return None
    if len(windows) < rows:
        logger.warning("No validation: the validation split holds %d windows of %d tokens, fewer than one "
                       "evaluation batch (micro_batch_size × dp = %d); raise corpus.encoding.validation_fraction",
                       len(windows), b.seq_length, rows)
        return None
    return windows[: len(windows) // rows * rows]


# --- loop ------------------------------------------------------------------------------------------


def train_loop(trainer: Trainer, progress: Progress, train: TokenWindows, valid: np.ndarray | None,
               metrics: MetricsLog, throughput: Throughput, size: ModelSize, board: VisualDLLog | None = None) -> None:
    """Step until ``max_steps`` (or ``stop_after``): evaluate, report and checkpoint on their schedules."""
    s, b = trainer.job.config.schedule, trainer.job.config.batch
    stop = min(s.max_steps, s.stop_after or s.max_steps)
    started, first = time.monotonic(), progress.step  # the time left goes at this process's own rate
    trainer.model.train()
    while progress.step < stop:
        loss, lr, norm = train_step(trainer, train, progress, measure_norm=(progress.step + 1) % s.log_every == 0)
        throughput.add(b.global_batch_size * b.seq_length)
        evaluated = progress.step % s.eval_every == 0 or progress.step == s.max_steps
        if evaluated:
            progress.val_loss = evaluate(trainer, valid)
        if norm is not None or evaluated or progress.step == stop:  # every validation loss reaches the logs
            report = {"loss": loss, "lr": lr, **throughput.report(),
                      "memory_mb": memory_mb(trainer.job.config.device.type)}
            if norm is not None:
                report["grad_norm"] = norm
            if evaluated and progress.val_loss is not None:
                report.update(val_loss=progress.val_loss, val_perplexity=perplexity(progress.val_loss))
            metrics.log(progress.step, report)
            if board is not None:
                board.log(progress.step, report)
            if trainer.job.is_master:
                logger.info("%s", eta_text(progress.step, stop, time.monotonic() - started, start=first))
        if progress.step % s.checkpoint_every == 0 or progress.step == stop:
            save(trainer, progress, size)


def train_step(trainer: Trainer, train: TokenWindows, progress: Progress,
               measure_norm: bool) -> tuple[float, float, float | None]:
    """One optimizer step over the global batch at ``progress``; return its loss, learning rate and grad norm."""
    job = trainer.job
    b, layout = job.config.batch, job.layout
    loss_sum = 0.0
    for k in range(layout.accumulation_steps):  # this rank's micro-batch k of the global batch
        first = micro_batch_start(progress.consumed_samples, k, job.dp_rank, layout, b.micro_batch_size)
        loss = trainer.loss(train.batch(first, b.micro_batch_size)) / layout.accumulation_steps
        (trainer.scaler.scale(loss) if trainer.scaler else loss).backward()
        loss_sum += float(loss)
    norm = trainer.update(measure_norm)
    lr = trainer.lr.get_lr()
    trainer.lr.step()
    progress.step += 1
    progress.consumed_samples += b.global_batch_size
    if not math.isfinite(loss_sum):
        raise FloatingPointError(f"loss is {loss_sum} at step {progress.step}; lower training.optimizer.learning_rate")
    return loss_sum, lr, norm


def micro_batch_start(consumed_samples: int, k: int, dp_rank: int, layout: Layout, micro_batch_size: int) -> int:
    """The first sample (``TokenWindows`` order) of micro-batch ``k`` of data-parallel rank ``dp_rank`` in the global
    batch that starts at ``consumed_samples``: micro-batches are cut k-major, rank-minor, so a global batch holds the
    same samples whatever the data-parallel degree and accumulation that split it (an elastic re-form)."""
    return consumed_samples + (k * layout.dp + dp_rank) * micro_batch_size


def evaluate(trainer: Trainer, valid: np.ndarray | None) -> float | None:
    """Validation loss on ``valid`` (every rank forwards its share of each batch), or None without it."""
    if valid is None:
        return None
    trainer.model.eval()
    try:
        rows = trainer.job.config.batch.micro_batch_size * trainer.job.layout.dp
        return mean_token_loss(valid, trainer.batch_loss, batch_size=rows)
    finally:
        trainer.model.train()


def save(trainer: Trainer, progress: Progress, size: ModelSize) -> None:
    """Checkpoint the whole model and optimizer state: every rank gathers its shards, rank 0 writes."""
    import paddle.distributed as dist

    job, layout = trainer.job, trainer.job.layout
    weights, moments = training_state(trainer.model, trainer.optimizer)
    if job.is_master:
        state = CheckpointState(
            step=progress.step, consumed_samples=progress.consumed_samples, val_loss=progress.val_loss,
            lr=trainer.lr.get_lr(),
            layout={"dp": layout.dp, "mp": layout.mp, "pp": layout.pp, "sharding_stage": layout.sharding_stage},
            model_config=trainer.model.config.to_dict(), training=to_json(job.spec.training),
            data=to_json(job.spec.data), parameters=size.parameters)
        path = write_checkpoint(Path(job.spec.checkpoints), progress.step, weights, moments, state,
                                job.config.schedule.keep_last)
        logger.info("Checkpoint %s", path)
    if job.world > 1:
        dist.barrier()


def _result(job: Job, progress: Progress, size: ModelSize, valid: np.ndarray | None) -> TrainingResult:
    return TrainingResult(
        run_name=job.spec.run_name, step=progress.step, consumed_samples=progress.consumed_samples,
        finished=progress.step >= job.config.schedule.max_steps, checkpoints=job.spec.checkpoints,
        checkpoint=str(step_dir(Path(job.spec.checkpoints), progress.step)), val_loss=progress.val_loss,
        seq_length=job.config.batch.seq_length, eval_windows=0 if valid is None else len(valid),
        parameters=size.parameters,
        layout={"dp": job.layout.dp, "mp": job.layout.mp, "pp": job.layout.pp},
        **(job.spec.init.result_fields() if job.spec.init else {}))


def _throughput(job: Job, size: ModelSize) -> Throughput:
    config = job.config
    flops = flops_per_token(config.model.shape(), size.parameters, size.embedding, config.batch.seq_length)
    if config.device.peak_tflops:
        peak, source = config.device.peak_tflops * 1e12, "training.device.peak_tflops"
    else:  # measured here: this worker's BLAS kernels and threads
        threads = blas_threads()
        peak = calibrated_peak_flops(config.device.type, threads)
        source = f"float32 matmul calibrated in the worker, {threads} thread(s)" + (
            f", MKL_DEBUG_CPU_TYPE={os.environ['MKL_DEBUG_CPU_TYPE']}" if "MKL_DEBUG_CPU_TYPE" in os.environ else "")
    logger.info("MFU against a peak of %.1f GFLOP/s per worker (%s)", peak / 1e9, source)
    return Throughput(flops_per_token=flops, peak_flops=peak * job.world)


if __name__ == "__main__":
    from train_deploy.run_control.processes import exit_now

    os.environ.setdefault("GLOG_minloglevel", "2")
    main()  # an error or a signal ends the process as before: traceback and status 1, or the signal's death
    exit_now(0)  # a finished worker skips Paddle's seconds-long interpreter teardown (processes.exit_now)
