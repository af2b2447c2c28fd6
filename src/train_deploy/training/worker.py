"""Training worker: one process per device, started by Paddle's launcher.

    # 1 process
    python -m paddle.distributed.launch --nproc_per_node 1 worker.py --run run.json
    # N processes on one machine
    python -m paddle.distributed.launch --nproc_per_node N worker.py --run run.json
    # N nodes: the same command on every node, with its own --rank (0 .. N-1)
    python -m paddle.distributed.launch --nnodes N --master HOST:PORT --rank R --nproc_per_node G \
        worker.py --run run.json

``run.json`` is written by the Kedro node (``train_deploy.training.launch``): the ``training`` parameter
block, where the token files are, and the MLflow run to log into. The loop reads top to bottom:
set-up, model, optimizer, parallelize, resume, then steps of gradient accumulation, clipping, AdamW,
metrics, evaluation and checkpoints. Only rank 0 logs and writes; every rank joins collectives.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("train_deploy.training.worker")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    run = json.loads(Path(args.run).read_text(encoding="utf-8"))

    import paddle
    import paddle.distributed as dist

    from train_deploy.training import checkpoint as ckpt
    from train_deploy.training.config import TrainingConfig, resolve_layout
    from train_deploy.training.data import TokenWindows
    from train_deploy.training.model import build_model, flops_per_token
    from train_deploy.training.parallelize import data_rank, parallelize

    # --- set-up ------------------------------------------------------------------------------------
    config = TrainingConfig.from_params(run["training"])
    data = run["data"]
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = resolve_layout(config, world, data["vocab_size"])
    is_master = rank == 0
    logging.basicConfig(level=logging.INFO if is_master else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s", stream=sys.stdout)
    if world > 1:
        dist.init_parallel_env()
    paddle.set_device("gpu" if config.device.type == "gpu" else "cpu")
    paddle.seed(config.schedule.seed)
    b, s, o = config.batch, config.schedule, config.optimizer
    output_dir = Path(run["output_dir"])

    # --- model, optimizer, parallelism -------------------------------------------------------------
    model = build_model(config, data["vocab_size"], data["eos_id"])
    parameters = sum(int(np.prod(p.shape)) for p in model.parameters())
    embedding = int(np.prod(model.llama.embed_tokens.weight.shape))
    peak_lr = o.scaled_learning_rate(b.global_batch_size)
    schedule = paddle.optimizer.lr.LambdaDecay(peak_lr, _lr_lambda(o.warmup_steps, s.max_steps, o.min_lr_ratio))
    no_decay = {p.name for n, p in model.named_parameters() if p.ndim == 1}  # norms: no weight decay
    optimizer = paddle.optimizer.AdamW(
        learning_rate=schedule, parameters=model.parameters(), beta1=o.beta1, beta2=o.beta2, epsilon=o.epsilon,
        weight_decay=o.weight_decay, apply_decay_param_fun=lambda name: name not in no_decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(o.grad_clip) if o.grad_clip > 0 else None,
    )
    amp = config.precision
    if amp.amp and amp.level == "O2":  # low-precision weights with float32 master copies in the optimizer
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=amp.dtype,
                                               master_weight=True)
    # float16 needs a dynamic loss scale to keep small gradients representable; bfloat16 does not.
    scaler = paddle.amp.GradScaler(init_loss_scaling=2.0**15) if amp.amp and amp.dtype == "float16" else None
    model, optimizer, mesh = parallelize(model, optimizer, layout=layout, device=config.device.type)
    placements = [dist.Shard(0)] + [dist.Replicate()] * (len(mesh.shape) - 1)
    if layout.pp > 1:
        placements = [dist.Replicate(), dist.Shard(0), dist.Replicate()]

    # --- resume --------------------------------------------------------------------------------------
    step, consumed = 0, 0
    latest = ckpt.latest_checkpoint(output_dir) if s.resume == "auto" else None
    if latest is not None:
        state = _load_checkpoint(model, optimizer, latest)
        step, consumed = state["step"], state["consumed_samples"]
        schedule.last_epoch = step
        schedule.last_lr = schedule.get_lr()
        logger.info("Resumed from %s: step %d, %d samples consumed (saved with dp=%d mp=%d, now dp=%d mp=%d)",
                    latest, step, consumed, state["layout"]["dp"], state["layout"]["mp"], layout.dp, layout.mp)

    train = TokenWindows(Path(data["train_prefix"]), b.seq_length, s.seed, data["dtype"])
    valid = _validation_windows(data, b.seq_length, s.seed)
    if valid is not None and len(valid) < b.micro_batch_size * layout.dp:
        logger.warning("No validation: the validation split holds %d windows of %d tokens, fewer than one "
                       "evaluation batch (micro_batch_size × dp = %d); raise corpus.encoding.validation_fraction",
                       len(valid), b.seq_length, b.micro_batch_size * layout.dp)
        valid = None
    my_dp = data_rank(rank, layout)
    tokens_per_step = b.global_batch_size * b.seq_length
    flops = flops_per_token(config.model.shape(), parameters, embedding, b.seq_length)
    peak_flops = (config.device.peak_tflops * 1e12) if config.device.peak_tflops else _calibrate_peak_flops()
    metrics_log = _MetricsLog(run, is_master)
    logger.info("Model: %s, %.2f M parameters, %.1f MFLOP/token; layout dp=%d mp=%d pp=%d sharding=%d, "
                "%d accumulation step(s), peak lr %.3g", config.model.preset, parameters / 1e6, flops / 1e6,
                layout.dp, layout.mp, layout.pp, layout.sharding_stage, layout.accumulation_steps, peak_lr)

    def to_dist(array: np.ndarray):
        return dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(array), mesh, placements)

    def batch_loss(windows: np.ndarray):
        with paddle.amp.auto_cast(enable=amp.amp, level=amp.level, dtype=amp.dtype):
            logits = model(input_ids=to_dist(windows[:, :-1]))
        return paddle.nn.functional.cross_entropy(logits.astype("float32"), to_dist(windows[:, 1:]).unsqueeze(-1))

    def evaluate() -> float | None:
        if valid is None:
            return None
        model.eval()
        losses = []
        rows = b.micro_batch_size * layout.dp
        with paddle.no_grad():
            for first in range(0, len(valid), rows):
                block = valid[first : first + rows]
                if len(block) < rows:
                    break
                mine = block[my_dp * b.micro_batch_size : (my_dp + 1) * b.micro_batch_size]
                losses.append(float(batch_loss(mine)))
        model.train()
        return float(np.mean(losses)) if losses else None

    def save(val_loss: float | None) -> None:
        model_state = {name: _full(p) for name, p in model.named_parameters()}
        optimizer_state = _optimizer_state(model, optimizer)
        if is_master:
            state = {"step": step, "consumed_samples": consumed, "val_loss": val_loss, "lr": schedule.get_lr(),
                     "layout": {"dp": layout.dp, "mp": layout.mp, "pp": layout.pp,
                                "sharding_stage": layout.sharding_stage},
                     "model_config": model.config.to_dict(), "training": run["training"], "data": data,
                     "parameters": parameters}
            path = ckpt.write_checkpoint(output_dir, step, model_state, optimizer_state, state, s.keep_last)
            logger.info("Checkpoint %s", path)
        if world > 1:
            dist.barrier()

    # --- loop ----------------------------------------------------------------------------------------
    model.train()
    last_val = None
    window_start, window_tokens = time.perf_counter(), 0
    stop = min(s.max_steps, s.stop_after or s.max_steps)
    while step < stop:
        loss_sum = 0.0
        for k in range(layout.accumulation_steps):
            first = consumed + (k * layout.dp + my_dp) * b.micro_batch_size
            loss = batch_loss(train.batch(first, b.micro_batch_size)) / layout.accumulation_steps
            (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += float(loss)
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip and report the true gradient norm
        grad_norm = _grad_norm(model) if (step + 1) % s.log_every == 0 else None
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.clear_grad()
        lr = schedule.get_lr()
        schedule.step()
        step += 1
        consumed += b.global_batch_size
        window_tokens += tokens_per_step
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"loss is {loss_sum} at step {step}; lower training.optimizer.learning_rate")
        if step % s.eval_every == 0 or step == s.max_steps:
            last_val = evaluate()
        if grad_norm is not None or step == stop:
            elapsed = time.perf_counter() - window_start
            tokens_per_second = window_tokens / elapsed
            metrics = {"loss": loss_sum, "lr": lr, "tokens_per_second": tokens_per_second,
                       "mfu": tokens_per_second * flops / (peak_flops * world), "memory_mb": _memory_mb(config)}
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if last_val is not None and (step % s.eval_every == 0 or step == s.max_steps):
                metrics.update(val_loss=last_val, val_perplexity=math.exp(min(last_val, 50.0)))
            metrics_log.log(step, metrics)
            window_start, window_tokens = time.perf_counter(), 0
        if step % s.checkpoint_every == 0 or step == stop:
            save(last_val)
    if is_master:
        result = {"step": step, "consumed_samples": consumed, "finished": step >= s.max_steps,
                  "checkpoint": str(ckpt.step_dir(output_dir, step)), "val_loss": last_val,
                  "parameters": parameters, "layout": {"dp": layout.dp, "mp": layout.mp, "pp": layout.pp}}
        Path(run["result_path"]).write_text(json.dumps(result, indent=2), encoding="utf-8")
    if world > 1:
        # Leave together: a rank that exits while a peer still holds open connections makes gloo abort the
        # peer at shutdown ("Connection reset by peer"), failing a finished job.
        dist.barrier()
        dist.destroy_process_group()


# --- helpers ---------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="train_deploy training worker")
    parser.add_argument("--run", required=True, help="run.json written by the training node")
    return parser.parse_args(argv)


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to the peak, then cosine decay to ``min_ratio`` of it at ``total`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _full(tensor):
    """The whole tensor on every rank (a collective when it is sharded)."""
    import paddle.distributed as dist

    if tensor.is_dist():
        tensor = dist.reshard(tensor, tensor.process_mesh, [dist.Replicate()] * len(tensor.placements))
        return tensor._local_value()
    return tensor


def _optimizer_state(model, optimizer) -> dict[str, Any]:
    """AdamW state keyed ``<structured parameter name>/<state>``: independent of Paddle's generated names."""
    import paddle

    owners = {p.name: n for n, p in model.named_parameters()}
    out = {}
    for key, value in optimizer.state_dict().items():
        if not isinstance(value, paddle.Tensor):
            continue
        owner = max((name for name in owners if key.startswith(name + "_")), key=len, default=None)
        if owner is not None:
            out[f"{owners[owner]}/{key[len(owner) + 1:]}"] = _full(value)
    return out


def _load_checkpoint(model, optimizer, folder: Path) -> dict[str, Any]:
    """Load unified weights and optimizer state into the (already parallelised) model and optimizer."""
    import paddle
    import paddle.distributed as dist

    from train_deploy.training import checkpoint as ckpt

    state = ckpt.read_state(folder)
    weights = ckpt.read_tensors(folder / ckpt.MODEL_FILE)
    moments = ckpt.read_tensors(folder / ckpt.OPTIMIZER_FILE)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ckpt.CheckpointError(f"{folder / ckpt.MODEL_FILE}: no tensor {missing[0]!r} for this model")
    # Creating the sharded optimizer state runs one fake step that moves the weights: weights after it.
    optimizer.state_dict()
    for name, param in params.items():
        if list(weights[name].shape) != list(param.shape):
            raise ckpt.CheckpointError(f"{folder / ckpt.MODEL_FILE}: {name} has shape {list(weights[name].shape)}, "
                                       f"the model expects {list(param.shape)}")
        param.set_value(dist.shard_tensor(weights[name].astype(param.dtype), param.process_mesh, param.placements))
    current = optimizer.state_dict()
    restored = {k: v for k, v in current.items() if not isinstance(v, paddle.Tensor)}
    for key, value in moments.items():
        structured, suffix = key.split("/", 1)
        target = f"{params[structured].name}_{suffix}"
        if target not in current:
            raise ckpt.CheckpointError(f"{folder / ckpt.OPTIMIZER_FILE}: {key} has no counterpart in this optimizer")
        like = current[target]  # sharded as this layout and ZeRO stage want it
        placements = like.placements if like.is_dist() else [dist.Replicate()] * len(params[structured].placements)
        mesh = like.process_mesh if like.is_dist() else params[structured].process_mesh
        restored[target] = dist.shard_tensor(paddle.to_tensor(value).astype(like.dtype), mesh, placements)
    optimizer.set_state_dict(restored)
    if (folder / ckpt.RNG_FILE).is_file():  # written by this project's own run, so unpickling it is safe
        paddle.set_rng_state(paddle.load(str(folder / ckpt.RNG_FILE)))
    return state


def _grad_norm(model) -> float:
    import paddle

    total = None
    for p in model.parameters():
        if p.grad is None:
            continue
        square = paddle.sum(paddle.square(p.grad.astype("float32")))
        total = square if total is None else total + square
    return float(paddle.sqrt(total)) if total is not None else 0.0


def _validation_windows(data: dict[str, Any], seq_length: int, seed: int) -> np.ndarray | None:
    from train_deploy.training.data import TokenWindows

    try:
        windows = TokenWindows(Path(data["valid_prefix"]), seq_length, seed, data["dtype"])
    except (ValueError, FileNotFoundError) as exc:
        logger.warning("No validation: %s", exc)
        return None
    return windows.in_file_order(data.get("eval_samples", 64))


def _calibrate_peak_flops() -> float:
    """Measured float32 matmul FLOP/s of this process: the "peak" when none is configured."""
    import paddle

    n = 512
    a, b = paddle.randn([n, n]), paddle.randn([n, n])
    paddle.matmul(a, b)
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < 0.3:
        paddle.matmul(a, b).numpy()
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - started)


def _memory_mb(config) -> float:
    if config.device.type == "gpu":
        import paddle

        return paddle.device.cuda.max_memory_allocated() / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class _MetricsLog:
    """Rank 0 only: per-step metrics to ``metrics.jsonl``, the log, and the Kedro run's MLflow run."""

    def __init__(self, run: dict[str, Any], is_master: bool) -> None:
        self.enabled = is_master
        self.path = Path(run["metrics_path"])
        self.client = self.run_id = None
        mlflow = run.get("mlflow") or {}
        if is_master and mlflow.get("run_id"):
            from mlflow.tracking import MlflowClient

            self.client, self.run_id = MlflowClient(tracking_uri=mlflow["tracking_uri"]), mlflow["run_id"]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or not metrics:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        logger.info("step %d  %s", step, "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        if self.client is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(f"train.{k}", float(v), now, step)
                                                        for k, v in metrics.items()])


if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    main()
