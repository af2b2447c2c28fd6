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

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"
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


def load_weights(model, folder: Path) -> None:
    """Set ``model``'s parameters from ``folder``'s model file (safetensors, no pickle), cast to its dtypes.

    The message names the file and the first tensor the model needs that is missing or of another shape.
    """
    path = Path(folder) / MODEL_FILE
    weights = read_tensors(path)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{path}: no tensor {missing[0]!r} for this model")
    for name, target in expected.items():
        if list(weights[name].shape) != list(target.shape):
            raise CheckpointError(f"{path}: {name!r} has shape {list(weights[name].shape)}, "
                                  f"the model configuration needs {list(target.shape)}")
    model.set_state_dict({name: weights[name].astype(target.dtype) for name, target in expected.items()})
