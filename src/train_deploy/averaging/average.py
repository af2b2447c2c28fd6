"""Streaming weight averaging of unified safetensors checkpoints.

Every selected file is checked from its header alone (keys, shapes, dtypes, size) before any tensor
is read. Then, tensor by tensor, each checkpoint's tensor is read through safetensors' memory map and
added in float32 to one accumulator: memory holds the output model (in the checkpoints' dtype) plus
one tensor, whatever K is. Integer and boolean tensors are copied from the newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.atomic import fsync_dir, fsync_file
from train_deploy.averaging.config import AveragingConfig
from train_deploy.training.checkpoint import MODEL_FILE, STATE_FILE, CheckpointError, complete_checkpoints, read_state

logger = logging.getLogger(__name__)

_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def select_checkpoints(folder: Path, config: AveragingConfig) -> list[Path]:
    """The checkpoints to average, oldest first."""
    found = complete_checkpoints(folder)
    by_step = {read_state(p)["step"]: p for p in found}
    if config.select == "steps":
        missing = [s for s in config.steps if s not in by_step]
        if missing:
            raise CheckpointError(f"{folder}: no complete checkpoint for step {missing[0]} (averaging.steps); "
                                  f"available: {sorted(by_step)}")
        chosen = [by_step[s] for s in sorted(set(config.steps))]
    elif config.select == "best_k":
        scored = [(read_state(p).get("val_loss"), p) for p in found]
        scored = [(loss, p) for loss, p in scored if loss is not None]
        chosen = sorted(p for _, p in sorted(scored, key=lambda item: item[0])[: config.k])
    else:
        eligible = [p for s, p in sorted(by_step.items()) if config.max_step is None or s <= config.max_step]
        chosen = eligible[-config.k :]
    wanted = len(config.steps) if config.select == "steps" else config.k
    if len(chosen) < wanted:
        message = f"{folder}: {len(chosen)} checkpoint(s) fit averaging.select={config.select}, fewer than k={wanted}"
        if config.too_few == "raise" or not chosen:
            raise CheckpointError(message + " (set averaging.too_few: warn to average what exists)")
        logger.warning("%s; averaging those", message)
    return chosen


def averaging_weights(count: int, config: AveragingConfig) -> np.ndarray:
    """Weights of the checkpoints, oldest first, summing to 1."""
    if config.method == "uniform":
        raw = np.ones(count)
    else:
        raw = config.decay ** np.arange(count - 1, -1, -1, dtype=np.float64)  # newest weighs 1
    return raw / raw.sum()


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors header of ``path`` (tensor name → dtype, shape, offsets), checked against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise CheckpointError(f"{path}: truncated (header of {length} bytes in a {size}-byte file)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    end = 8 + length + max((t["data_offsets"][1] for t in header.values()), default=0)
    if size < end:
        raise CheckpointError(f"{path}: truncated ({size} bytes, the header describes {end})")
    return header


def check_compatible(paths: list[Path]) -> dict[str, Any]:
    """Same tensor names, shapes and dtypes, and the same model configuration, in every checkpoint."""
    first = paths[0]
    reference = read_header(first / MODEL_FILE)
    reference_config = read_state(first).get("model_config")
    for other in paths[1:]:
        header = read_header(other / MODEL_FILE)
        for key in sorted(set(reference) | set(header)):
            if key not in header or key not in reference:
                holder, lacking = (first, other) if key in reference else (other, first)
                raise CheckpointError(f"tensor {key!r} is in {holder / MODEL_FILE} but not in {lacking / MODEL_FILE}")
            for field in ("shape", "dtype"):
                if header[key][field] != reference[key][field]:
                    raise CheckpointError(f"tensor {key!r}: {field} {reference[key][field]} in {first / MODEL_FILE} "
                                          f"but {header[key][field]} in {other / MODEL_FILE}")
        if read_state(other).get("model_config") != reference_config:
            raise CheckpointError(f"model configuration differs between {first / STATE_FILE} and {other / STATE_FILE}")
    return reference


def average_checkpoints(paths: list[Path], config: AveragingConfig, output_dir: Path) -> Path:
    """Average ``paths`` (oldest first) into ``output_dir`` atomically; return the new checkpoint folder."""
    from safetensors import safe_open
    from safetensors.paddle import save_file

    header = check_compatible(paths)
    weights = averaging_weights(len(paths), config)
    averaged, copied = {}, []
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p / MODEL_FILE), framework="paddle")) for p in paths]
        for key in sorted(header):
            if header[key]["dtype"] not in _FLOATING:
                averaged[key] = handles[-1].get_tensor(key)
                copied.append(key)
                continue
            total, dtype = None, None
            for handle, weight in zip(handles, weights, strict=True):
                tensor = handle.get_tensor(key)
                dtype = tensor.dtype
                term = tensor.astype("float32") * float(weight)
                total = term if total is None else total + term
                del tensor, term
            averaged[key] = total.astype(dtype)  # accumulated in float32, stored as the checkpoints store it
    newest = read_state(paths[-1])
    state = {
        **{k: newest[k] for k in ("step", "model_config", "data", "training", "parameters") if k in newest},
        "val_loss": None,
        "averaged": {
            "method": config.method, "decay": config.decay if config.method == "ema" else None,
            "weights": [float(w) for w in weights],
            "sources": [{"path": str(p), "step": read_state(p)["step"], "blake2b": _file_hash(p / MODEL_FILE)}
                        for p in paths],
            "copied_from_newest": copied,
            "note": "integer and boolean tensors are not averaged: they are taken from the newest checkpoint",
        },
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"averaged_{paths[0].name}_{paths[-1].name}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=output_dir))
    try:
        save_file(averaged, str(tmp / MODEL_FILE), metadata={"format": "pt", "method": config.method})
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        for name in (MODEL_FILE, STATE_FILE):
            fsync_file(tmp / name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Averaged %d checkpoints (%s) → %s", len(paths), config.method, final)
    return final


def _file_hash(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()
