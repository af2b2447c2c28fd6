"""Streaming weight averaging of unified safetensors checkpoints.

Every selected checkpoint is checked before any tensor is read: its model file has the size its
``state.json`` records, and its header (keys, shapes, dtypes, size) fits the others'. Then, tensor by
tensor, each checkpoint's tensor is read into one of a few reused buffers, added in float32 to one
accumulator and written out: memory holds a few tensors, whatever K is. The hash each checkpoint records
of its model file is compared with the bytes as they were read (no second read), and the average records
its own size and hash the same way. Integer and boolean tensors are copied from the newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.averaging.config import AveragingConfig
from train_deploy.averaging.streaming import DirectSink, ReadAhead
from train_deploy.handoffs import (
    AveragedSource,
    Averaging,
    CheckpointRef,
    CheckpointState,
    CurveDiagnosis,
    FileRecord,
)
from train_deploy.hashing import digest
from train_deploy.training.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    check_digest,
    checkpoint_state,
    complete_checkpoints,
    safetensors_header,
    verify_checkpoint,
)
from train_deploy.training.evaluation import portable_model_config

logger = logging.getLogger(__name__)

_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True, slots=True)
class Selection:
    """The checkpoints to average, oldest first, and why those."""

    paths: list[Path]
    reason: str


def select_checkpoints(folder: str | Path, config: AveragingConfig,
                       diagnosis: CurveDiagnosis | None = None) -> Selection:
    """The checkpoints in ``folder`` to average and why; a damaged one (wrong size) stops it.

    ``last_k`` takes the K newest, unless ``diagnosis`` (the run's curves) says overfitting: then the K kept
    checkpoints nearest the step where validation loss was lowest (:func:`_around`), since the newest are the
    ones that learnt the training text by heart. The other selections are the user's and are kept.
    """
    found = complete_checkpoints(Path(folder))
    by_step = {checkpoint_state(p).step: p for p in found}
    wanted = len(config.steps) if config.select == "steps" else config.k
    if config.select == "steps":
        missing = [s for s in config.steps if s not in by_step]
        if missing:
            raise CheckpointError(f"{folder}: no complete checkpoint for step {missing[0]} (averaging.steps); "
                                  f"available: {sorted(by_step)}")
        chosen, why = [by_step[s] for s in sorted(set(config.steps))], "averaging.select: steps"
    elif config.select == "best_k":
        scored = [(checkpoint_state(p).val_loss, p) for p in found]
        scored = [(loss, p) for loss, p in scored if loss is not None]
        chosen = sorted(p for _, p in sorted(scored, key=lambda item: item[0])[: config.k])
        why = f"the {config.k} with the lowest validation loss (averaging.select: best_k)"
    elif config.select == "last_k" and diagnosis is not None and diagnosis.kind == "overfitting":
        chosen, why = _around(by_step, diagnosis.best_step, config.k), _around_reason(by_step, diagnosis, config.k)
    else:
        eligible = [p for s, p in sorted(by_step.items()) if config.max_step is None or s <= config.max_step]
        chosen = eligible[-config.k :]
        why = (f"the {config.k} newest (averaging.select: last_k)" if config.select == "last_k" else
               f"the {config.k} newest at or below step {config.max_step} (averaging.select: up_to_step)")
    if len(chosen) < wanted:
        message = f"{folder}: {len(chosen)} checkpoint(s) fit averaging.select={config.select}, fewer than k={wanted}"
        if config.too_few == "raise" or not chosen:
            raise CheckpointError(message + " (set averaging.too_few: warn to average what exists)")
        logger.warning("%s; averaging those", message)
    for path in chosen:
        verify_checkpoint(path, [MODEL_FILE], contents=False)  # the hash is checked while averaging reads it
    return Selection(paths=chosen, reason=f"steps {', '.join(str(checkpoint_state(p).step) for p in chosen)}: {why}")


def _around(by_step: dict[int, Path], best: int | None, k: int) -> list[Path]:
    """The ``k`` consecutive kept checkpoints centred on the one nearest step ``best`` (the earlier one on a tie;
    the window moved inwards at either end), oldest first."""
    steps = sorted(by_step)
    if best is None or not steps:
        return [by_step[s] for s in steps[-k:]]
    centre = min(range(len(steps)), key=lambda i: (abs(steps[i] - best), steps[i]))
    first = max(0, min(centre - (k - 1) // 2, len(steps) - k))
    return [by_step[s] for s in steps[first:first + k]]


def _around_reason(by_step: dict[int, Path], diagnosis: CurveDiagnosis, k: int) -> str:
    """Why :func:`_around` chose, naming the lowest point and whether its checkpoint was still kept."""
    best = diagnosis.best_step
    kept = "" if best in by_step else (f"; step {best}'s checkpoint was not kept (training.schedule.keep_last), "
                                       "so the nearest kept ones")
    return (f"the {k} around step {best}, where validation loss was lowest ({diagnosis.best_val_loss:.4f}; "
            f"{diagnosis.last_val_loss:.4f} at the end), not the {k} newest: the training curves show overfitting "
            f"(averaging.select: last_k){kept}")


def averaging_weights(count: int, config: AveragingConfig) -> np.ndarray:
    """Weights of the checkpoints, oldest first, summing to 1."""
    if config.method == "uniform":
        raw = np.ones(count)
    else:
        raw = config.decay ** np.arange(count - 1, -1, -1, dtype=np.float64)  # newest weighs 1
    return raw / raw.sum()


def check_compatible(paths: list[Path]) -> dict[str, Any]:
    """Same tensor names, shapes and dtypes, and the same model, in every checkpoint.

    Model configurations are compared without the training run's execution settings (flash attention, fused
    kernels, parallel layout: ``evaluation.PORTABLE_SETTINGS``), which every consumer replaces, so that a run
    resumed on another device still averages.
    """
    first = paths[0]
    reference = safetensors_header(first / MODEL_FILE)
    reference_config = _model(checkpoint_state(first))
    for other in paths[1:]:
        header = safetensors_header(other / MODEL_FILE)
        for key in sorted(set(reference) | set(header)):
            if key not in header or key not in reference:
                holder, lacking = (first, other) if key in reference else (other, first)
                raise CheckpointError(f"tensor {key!r} is in {holder / MODEL_FILE} but not in {lacking / MODEL_FILE}")
            for field in ("shape", "dtype"):
                if header[key][field] != reference[key][field]:
                    raise CheckpointError(f"tensor {key!r}: {field} {reference[key][field]} in {first / MODEL_FILE} "
                                          f"but {header[key][field]} in {other / MODEL_FILE}")
        if _model(checkpoint_state(other)) != reference_config:
            raise CheckpointError(f"model configuration differs between {first / STATE_FILE} and {other / STATE_FILE}")
    return reference


def _model(state: CheckpointState) -> dict[str, Any] | None:
    return None if state.model_config is None else portable_model_config(state.model_config)


def averaging_fingerprint(paths: list[Path], config: AveragingConfig) -> str:
    """Equal when the same checkpoint files would be averaged the same way (files by path, size and mtime)."""
    sources = []
    for path in paths:
        stat = (Path(path) / MODEL_FILE).stat()
        sources.append([str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns,
                        (Path(path) / STATE_FILE).read_text(encoding="utf-8")])
    payload = {"sources": sources, "method": config.method, "decay": config.decay}
    return digest(payload)


def average_checkpoints(paths: list[Path], config: AveragingConfig, folder: Path) -> CheckpointRef:
    """Average ``paths`` (oldest first) into the empty ``folder``; return the new checkpoint.

    A source whose model file is not the one its ``state.json`` records (size before reading, hash after)
    stops it with :class:`CheckpointError` naming the file; ``folder`` is then incomplete.
    """
    states = [verify_checkpoint(p, [MODEL_FILE], contents=False) for p in paths]
    header = check_compatible(paths)
    weights = averaging_weights(len(paths), config)
    copied, hashes, written = _write_average([p / MODEL_FILE for p in paths], weights, header,
                                             Path(folder) / MODEL_FILE,
                                             metadata={"format": "pt", "method": config.method})
    for path, state, file_hash in zip(paths, states, hashes, strict=True):
        check_digest(path / MODEL_FILE, state, file_hash)
    newest = checkpoint_state(paths[-1])
    state = CheckpointState(
        step=newest.step, model_config=newest.model_config, data=newest.data, training=newest.training,
        parameters=newest.parameters, val_loss=None,
        averaged=Averaging(
            fingerprint=averaging_fingerprint(paths, config),
            method=config.method, decay=config.decay if config.method == "ema" else None,
            weights=[float(w) for w in weights],
            sources=[AveragedSource(path=str(p), step=st["step"], xxh3_128=h)
                     for p, st, h in zip(paths, states, hashes, strict=True)],
            copied_from_newest=copied,
            note="integer and boolean tensors are not averaged: they are taken from the newest checkpoint",
        ),
        files={MODEL_FILE: FileRecord(**written)},
    )
    state.write(folder)
    logger.info("Averaged %d checkpoints (%s): steps %s", len(paths), config.method,
                [source.step for source in state.averaged.sources])
    return CheckpointRef.read_folder(folder)


# safetensors dtype names → numpy (bfloat16 through ml_dtypes, which Paddle depends on)
def _numpy_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype({"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                     "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                     "BOOL": np.bool_}[name])


def _write_average(files: list[Path], weights: np.ndarray, header: dict[str, Any], out: Path,
                   metadata: dict[str, str]) -> tuple[list[str], list[str], dict[str, Any]]:
    """Stream the weighted average into a safetensors file, one tensor in memory at a time.

    A reader thread reads every input byte once, in file order, up to three tensors ahead of the hashing
    (xxh3-128), the float32 sums (split over a small pool) and the output writes (a writer thread, direct
    to disk), across tensor boundaries, so the disk is never idle while the caller sums. Inputs are read
    with positioned reads, not memory maps: mapped pages of K multi-GB inputs would count as this
    process's resident memory. Returns the names copied from the newest file, the inputs' hashes and the
    output's size and hash (``state.json``'s record of it, hashed as it is written).
    """
    import xxhash

    keys = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    layout, offset = {}, 0
    for key in keys:
        size = header[key]["data_offsets"][1] - header[key]["data_offsets"][0]
        layout[key] = {"dtype": header[key]["dtype"], "shape": header[key]["shape"],
                       "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps({"__metadata__": metadata, **layout}, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    copied = []
    uniform = bool(np.allclose(weights, weights[0]))
    floating = [k for k in keys if header[k]["dtype"] in _FLOATING]
    elements = max(((header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
                    // _numpy_dtype(header[k]["dtype"]).itemsize for k in floating), default=0)
    sums = np.empty(elements, dtype=np.float32)  # reused for every tensor
    written, size = xxhash.xxh3_128(), 0

    def emit(data) -> None:
        nonlocal size
        written.update(data)
        size += memoryview(data).nbytes
        sink.write(data)

    with ExitStack() as stack:
        compute = stack.enter_context(ThreadPoolExecutor(max_workers=_COMPUTE_THREADS))
        reads = stack.enter_context(ReadAhead(files, header, keys))
        sink = stack.enter_context(DirectSink(out))
        emit(struct.pack("<Q", len(encoded)) + encoded)
        for key in keys:
            info = header[key]
            if info["dtype"] not in _FLOATING:
                for _ in files:
                    data = reads.next()
                emit(data)  # the newest file's
                copied.append(key)
                continue
            dtype = _numpy_dtype(info["dtype"])
            total = sums[: (info["data_offsets"][1] - info["data_offsets"][0]) // dtype.itemsize]
            for i, weight in enumerate(weights):
                # Uniform: sum, then scale once. Weighted: scale each input as it is added.
                _accumulate(compute, total, reads.next().view(dtype), None if uniform else np.float32(weight),
                            first=i == 0)
            if uniform:
                _split(compute, lambda t: np.multiply(t, np.float32(weights[0]), out=t), total)
            emit((total if dtype == np.float32 else total.astype(dtype)).view(np.uint8))
        hashes = reads.finish()
    return copied, hashes, {"bytes": size, "xxh3_128": written.hexdigest()}


_COMPUTE_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))  # a core is left to the reader thread
_SPLIT_ELEMENTS = 1 << 20  # smaller tensors are not worth a thread hand-off


def _split(pool: ThreadPoolExecutor, operation, *arrays: np.ndarray) -> None:
    """Apply an in-place elementwise ``operation`` to slices of flat views in parallel (numpy releases the GIL)."""
    flats = [a.reshape(-1) for a in arrays]
    size = flats[0].size
    if size < _SPLIT_ELEMENTS or _COMPUTE_THREADS == 1:
        operation(*flats)
        return
    bounds = np.linspace(0, size, _COMPUTE_THREADS + 1, dtype=np.int64)
    slices = zip(bounds[:-1], bounds[1:], strict=True)
    futures = [pool.submit(operation, *(f[lo:hi] for f in flats)) for lo, hi in slices]
    for future in futures:
        future.result()


def _accumulate(pool: ThreadPoolExecutor, total: np.ndarray, tensor: np.ndarray, weight, first: bool) -> None:
    """total (=|+=) tensor (× weight), in float32, without temporaries."""
    if first:
        if weight is None:
            _split(pool, lambda t, x: np.copyto(t, x, casting="unsafe"), total, tensor)
        else:
            _split(pool, lambda t, x: np.multiply(x, weight, out=t, casting="unsafe"), total, tensor)
    elif weight is None:
        _split(pool, lambda t, x: np.add(t, x, out=t, casting="unsafe"), total, tensor)
    else:
        def fused(t, x):
            t += x.astype(np.float32) * weight  # one slice-sized temporary per thread

        _split(pool, fused, total, tensor)
