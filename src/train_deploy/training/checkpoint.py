"""Unified checkpoints: full tensors in safetensors, independent of the parallel layout.

A checkpoint is a folder ``step_00000042/`` holding ``model.safetensors`` (parameters by their
structured names), ``optimizer.safetensors`` (AdamW moments as ``<parameter>/<state>``),
``rng_state.pdstates`` (Paddle's generator state) and ``state.json`` (step, consumed samples,
learning-rate position, resolved configuration, metrics). It is written under a temporary name and
renamed when complete, so a folder named ``step_*`` is always whole; only the last ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from train_deploy.atomic import atomic_folder
from train_deploy.handoffs import STATE_FILE

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"
RNG_FILE = "rng_state.pdstates"  # Paddle generator state: pickled, written and read only by this project
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit the model; the message names the file."""


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f"step_{step:08d}"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def write_checkpoint(output_dir: Path, step: int, model: dict[str, Any], optimizer: dict[str, Any],
                     state: dict[str, Any], keep_last: int) -> Path:
    """Write a checkpoint atomically (tensors are paddle Tensors or numpy arrays) and prune old ones."""
    import paddle
    from safetensors.paddle import save_file

    output_dir = Path(output_dir)
    final = step_dir(output_dir, step)
    with atomic_folder(final) as tmp:  # a rerun of the same step replaces it whole
        save_file(model, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
        save_file(optimizer, str(tmp / OPTIMIZER_FILE), metadata={"format": "pt", "step": str(step)})
        paddle.save(paddle.get_rng_state(), str(tmp / RNG_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
    for old in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / STATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint state ({exc})") from None


def read_tensors(path: Path) -> dict[str, Any]:
    """All tensors of a safetensors file as paddle Tensors (no pickle)."""
    from safetensors import SafetensorError
    from safetensors.paddle import load_file

    if not Path(path).is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from None


def check_weights(weights: dict[str, Any], shapes: dict[str, list[int]], path: Path) -> None:
    """Raise unless ``weights`` (read from ``path``) has a tensor of the right shape for every model tensor.

    ``shapes`` maps the model's structured names to its shapes; the message names the file and the first
    tensor that is missing or of another shape.
    """
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise CheckpointError(f"{path}: no tensor {missing[0]!r} for this model")
    for name, shape in shapes.items():
        if list(weights[name].shape) != list(shape):
            raise CheckpointError(f"{path}: {name!r} has shape {list(weights[name].shape)}, "
                                  f"the model configuration needs {list(shape)}")


def load_weights(model, folder: Path) -> None:
    """Set ``model``'s parameters from ``folder``'s model file (safetensors, no pickle), cast to its dtypes."""
    path = Path(folder) / MODEL_FILE
    weights = read_tensors(path)
    expected = dict(model.state_dict())
    check_weights(weights, {name: target.shape for name, target in expected.items()}, path)
    model.set_state_dict({name: weights[name].astype(target.dtype) for name, target in expected.items()})


# --- the training state of a (parallelised) model and optimizer ------------------------------------


def full_tensor(tensor):
    """The whole tensor on every rank (a collective when it is sharded)."""
    import paddle.distributed as dist

    if tensor.is_dist():
        tensor = dist.reshard(tensor, tensor.process_mesh, [dist.Replicate()] * len(tensor.placements))
        return tensor._local_value()
    return tensor


def training_state(model, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole weights and AdamW state, keyed by structured names: a collective, every rank calls it.

    Optimizer tensors are keyed ``<structured parameter name>/<state>``, independent of Paddle's generated
    parameter names and of the parallel layout.
    """
    import paddle

    weights = {name: full_tensor(p) for name, p in model.named_parameters()}
    owners = {p.name: n for n, p in model.named_parameters()}
    moments = {}
    for key, value in optimizer.state_dict().items():
        if not isinstance(value, paddle.Tensor):
            continue
        owner = max((name for name in owners if key.startswith(name + "_")), key=len, default=None)
        if owner is not None:
            moments[f"{owners[owner]}/{key[len(owner) + 1:]}"] = full_tensor(value)
    return weights, moments


def restore_training_state(model, optimizer, folder: Path) -> dict[str, Any]:
    """Load a checkpoint into the already parallelised ``model`` and ``optimizer``; return its ``state.json``.

    Each tensor is sharded as this run's layout and ZeRO stage want it, whatever layout saved it; Paddle's
    generator state is restored too, so the run continues as if it had not stopped.
    """
    import paddle.distributed as dist

    folder = Path(folder)
    state = read_state(folder)
    weights = read_tensors(folder / MODEL_FILE)
    params = dict(model.named_parameters())
    check_weights(weights, {name: p.shape for name, p in params.items()}, folder / MODEL_FILE)
    # Creating the sharded optimizer state runs one fake step that moves the weights: weights after it.
    optimizer.state_dict()
    for name, param in params.items():
        param.set_value(dist.shard_tensor(weights[name].astype(param.dtype), param.process_mesh, param.placements))
    _restore_optimizer(optimizer, params, folder / OPTIMIZER_FILE)
    _restore_rng(folder / RNG_FILE)
    return state


def _restore_optimizer(optimizer, params: dict[str, Any], path: Path) -> None:
    import paddle
    import paddle.distributed as dist

    current = optimizer.state_dict()
    restored = {k: v for k, v in current.items() if not isinstance(v, paddle.Tensor)}
    for key, value in read_tensors(path).items():
        structured, suffix = key.split("/", 1)
        target = f"{params[structured].name}_{suffix}" if structured in params else key
        if target not in current:
            raise CheckpointError(f"{path}: {key} has no counterpart in this optimizer")
        like = current[target]  # sharded as this layout and ZeRO stage want it
        placements = like.placements if like.is_dist() else [dist.Replicate()] * len(params[structured].placements)
        mesh = like.process_mesh if like.is_dist() else params[structured].process_mesh
        restored[target] = dist.shard_tensor(paddle.to_tensor(value).astype(like.dtype), mesh, placements)
    optimizer.set_state_dict(restored)


def _restore_rng(path: Path) -> None:
    import paddle

    if path.is_file():  # written by this project's own run (write_checkpoint), so unpickling it is safe
        paddle.set_rng_state(paddle.load(str(path)))
