"""Unified checkpoints: full tensors in safetensors, independent of the parallel layout.

A checkpoint is a folder ``step_00000042/`` holding ``model.safetensors`` (float32 parameters by their
structured names: under AMP O2 the optimizer's master copies, not their rounded bfloat16/float16 twins),
``optimizer.safetensors`` (AdamW moments as ``<parameter>/<state>``),
``rng_state.json`` (Paddle's generator states) and ``state.json`` (step, consumed samples,
learning-rate position, resolved configuration, metrics, and the size and xxh3-128 hash of every other
file). It is written under a temporary name and renamed when complete, so a folder named ``step_*`` is
always whole when written; :func:`verify_checkpoint` tells whether it still is. Only the last
``keep_last`` are kept; a damaged one that resuming skipped is moved aside (``step_*.damaged-<UTC time>``),
never deleted.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from train_deploy.atomic import atomic_folder, fsync_dir
from train_deploy.handoffs import STATE_FILE, CheckpointState, DescriptionError, FileRecord, from_json
from train_deploy.hashing import file_record

logger = logging.getLogger(__name__)

MODEL_FILE, OPTIMIZER_FILE, RNG_FILE = "model.safetensors", "optimizer.safetensors", "rng_state.json"
LEGACY_RNG_FILE = "rng_state.pdstates"
"""Paddle's own serialisation of the generator states, written by checkpoints before ``rng_state.json``;
no longer read (a run resumed from one continues with freshly seeded generators)."""
FILES_KEY = "files"
"""``state.json``'s record of the checkpoint's other files: name → ``{"bytes": …, "xxh3_128": …}``."""
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


def latest_intact_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint that passes :func:`verify_checkpoint`; newer damaged ones are moved aside.

    Each damaged one is renamed ``step_*.damaged-<UTC time>`` (kept for inspection, no longer a checkpoint)
    with a warning naming it and what is wrong. Only one process of a run may call this (rank 0).
    """
    for folder in reversed(complete_checkpoints(output_dir)):
        try:
            verify_checkpoint(folder)
            return folder
        except CheckpointError as exc:
            moved = _set_aside(folder)
            logger.warning("Checkpoint %s is damaged (%s); %s, trying the previous one", folder, exc, moved)
    return None


def _set_aside(folder: Path) -> str:
    """Rename a damaged checkpoint out of the ``step_*`` pattern; say where it went."""
    aside = folder.with_name(f"{folder.name}.damaged-{dt.datetime.now(dt.UTC):%Y-%m-%dT%H.%M.%S.%fZ}")
    try:
        os.replace(folder, aside)
        fsync_dir(folder.parent)
    except OSError as exc:  # still skipped: the choice does not depend on the rename
        return f"could not move it aside ({exc})"
    return f"moved aside to {aside.name}"


def write_checkpoint(output_dir: Path, step: int, model: dict[str, Any], optimizer: dict[str, Any],
                     state: CheckpointState | dict[str, Any], keep_last: int) -> Path:
    """Write a checkpoint atomically (paddle Tensors; its files recorded in ``state.json``); prune old ones.
    ``state`` may also be a mapping of :class:`CheckpointState`'s keys (tests write small ones)."""
    import paddle
    from safetensors.paddle import save_file

    if not isinstance(state, CheckpointState):
        state = from_json(CheckpointState, dict(state), STATE_FILE)
    output_dir = Path(output_dir)
    final = step_dir(output_dir, step)
    with atomic_folder(final) as tmp:  # a rerun of the same step replaces it whole
        for name, tensors in ((MODEL_FILE, model), (OPTIMIZER_FILE, optimizer)):
            save_file(tensors, str(tmp / name), metadata={"format": "pt", "step": str(step)})
            sort_header_metadata(tmp / name)
        (tmp / RNG_FILE).write_text(json.dumps(rng_state(paddle.get_rng_state())), encoding="utf-8")
        # state.json last: it records what the other files must be, for verify_checkpoint
        files = {name: FileRecord(**file_record(tmp / name)) for name in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE)}
        dataclasses.replace(state, files=files).write(tmp)
    for old in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def sort_header_metadata(path: Path) -> None:
    """Put the ``__metadata__`` keys of the safetensors file ``path`` in sorted order, in place.

    safetensors writes them from a Rust ``HashMap``, in an order that changes from process to process, so two
    runs that computed the same tensors wrote different bytes (and ``state.json`` different hashes). The header
    keeps its length (the same keys and values, compact JSON, padded with spaces as safetensors pads it)."""
    with Path(path).open("r+b") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        if "__metadata__" not in header:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        encoded = json.dumps(header, separators=(",", ":")).encode()
        if len(encoded) > size:  # never: the same content; leave the file as safetensors wrote it
            return
        file.seek(8)
        file.write(encoded.ljust(size, b" "))


def checkpoint_state(folder: Path) -> CheckpointState:
    """``folder``'s ``state.json``, typed (:meth:`CheckpointState.read`); a bad one raises :class:`CheckpointError`."""
    try:
        return CheckpointState.read(folder)
    except DescriptionError as exc:
        raise CheckpointError(str(exc)) from None


def read_state(folder: Path) -> dict[str, Any]:
    """``folder``'s ``state.json`` in its JSON form (:func:`checkpoint_state`'s record), for the callers that index
    it (export, evaluation)."""
    return checkpoint_state(folder).record()


def verify_checkpoint(folder: Path, files: Iterable[str] | None = None, *, contents: bool = True) -> dict[str, Any]:
    """Return ``folder``'s state if it is intact, else raise :class:`CheckpointError` naming the damaged file.

    ``state.json`` must parse, and each file it records (or only ``files``) must exist with its recorded size
    and, unless ``contents`` is false (the caller hashes while reading: :func:`check_digest`), its recorded
    xxh3-128 hash. A checkpoint that records no files (written before they were recorded) passes when its
    safetensors files (``files``, else model and optimizer) have a header that describes their size.
    """
    folder = Path(folder)
    state = checkpoint_state(folder)
    if state.files is None:
        for name in files if files is not None else (MODEL_FILE, OPTIMIZER_FILE):
            safetensors_header(folder / name)
        return state.record()
    for name in files if files is not None else state.files:
        record = state.files.get(name)
        if record is None:
            raise CheckpointError(f"{folder / STATE_FILE}: no record of {name}")
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != record.bytes:
            raise CheckpointError(f"{path}: {size} bytes, {STATE_FILE} records {record.bytes} (truncated or "
                                  "overwritten)")
        if contents:
            check_digest(path, state.record(), file_record(path)["xxh3_128"])
    return state.record()


def check_digest(path: Path, state: dict[str, Any], digest: str) -> None:
    """Raise unless ``digest`` (xxh3-128 of ``path``'s bytes) is the one its checkpoint's ``state`` records."""
    expected = (state.get(FILES_KEY) or {}).get(Path(path).name, {}).get("xxh3_128")
    if expected is not None and digest != expected:
        raise CheckpointError(f"{path}: content changed since it was written (xxh3-128 {digest}, "
                              f"{STATE_FILE} records {expected})")


def check_trained_on(state: dict[str, Any], corpus_fingerprint: str, checkpoint: Path) -> None:
    """Raise unless the checkpoint (its ``state``) was trained on the corpus ``corpus_fingerprint`` names.

    A checkpoint that records no corpus fingerprint passes with a warning: it cannot be checked.
    """
    recorded = (state.get("data") or {}).get("corpus_fingerprint")
    if recorded is None:
        logger.warning("%s records no corpus fingerprint: cannot check that it was trained on the token files of "
                       "corpus %s", checkpoint, corpus_fingerprint)
    elif recorded != corpus_fingerprint:
        raise CheckpointError(f"{checkpoint} was trained on corpus {recorded} but the token files are corpus "
                              f"{corpus_fingerprint}; use the token files it was trained on")


def safetensors_header(path: Path) -> dict[str, Any]:
    """The safetensors header of ``path`` (tensor name → dtype, shape, offsets), checked against the file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise CheckpointError(f"{path}: truncated (header of {length} bytes in a {size}-byte file)")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = 8 + length + max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (struct.error, ValueError, UnicodeDecodeError, AttributeError, LookupError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc!r})") from None
    if size < end:
        raise CheckpointError(f"{path}: truncated ({size} bytes, the header describes {end})")
    return header


def read_tensors(path: Path) -> dict[str, Any]:
    """All tensors of a safetensors file as paddle Tensors."""
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
    """Set ``model``'s parameters from ``folder``'s model file (safetensors), cast to its dtypes."""
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


_MASTER_INFIX = re.compile(r"^fp32_master_\d+_")
"""What Paddle puts between a parameter's name and its state's when the state belongs to the parameter's float32
master copy (``<param>_fp32_master_0_moment1_0``); left out of checkpoint keys, so a checkpoint resumes with or
without master weights."""


def optimizer_keys(optimizer, params: dict[str, Any]) -> dict[str, str]:
    """Paddle's key of every tensor of ``optimizer``'s state → its checkpoint key ``<structured name>/<state>``.

    ``params`` maps structured names to parameters. Keys owned by no parameter are left out.
    """
    import paddle

    owners = {p.name: n for n, p in params.items()}
    keys = {}
    for key, value in optimizer.state_dict().items():
        if not isinstance(value, paddle.Tensor):
            continue
        owner = max((name for name in owners if key.startswith(name + "_")), key=len, default=None)
        if owner is not None:
            keys[key] = f"{owners[owner]}/{_MASTER_INFIX.sub('', key[len(owner) + 1:])}"
    return keys


def master_weights(optimizer) -> dict[str, Any]:
    """The float32 master copy of each low-precision parameter (by Paddle name): AMP O2's trained weights."""
    return dict(optimizer.state_dict().get("master_weights") or {})


def training_state(model, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole float32 weights and AdamW state, keyed by structured names: a collective, every rank calls it.

    The weights are the master copies where the optimizer keeps them (AMP O2: the parameters themselves are
    rounded to bfloat16/float16 copies of these), else the parameters in float32. Optimizer tensors are keyed
    ``<structured parameter name>/<state>``, independent of Paddle's generated names, of the parallel layout
    and of whether the state belongs to a master copy.
    """
    params = dict(model.named_parameters())
    masters = master_weights(optimizer)
    weights = {}
    for name, p in params.items():
        weights[name] = full_tensor(masters.get(p.name, p)).astype("float32")
    state = optimizer.state_dict()
    moments = {target: full_tensor(state[key]) for key, target in optimizer_keys(optimizer, params).items()}
    return weights, moments


def restore_training_state(model, optimizer, folder: Path) -> CheckpointState:
    """Load a checkpoint into the already parallelised ``model`` and ``optimizer``; return its ``state.json``.

    Each tensor is sharded as this run's layout and ZeRO stage want it, whatever layout saved it. Master
    copies (AMP O2) are set from the float32 weights, and the parameters are those rounded to their dtype, so
    the first step after a resume updates the trained weights. Paddle's generator state is restored too, so
    the run continues as if it had not stopped.
    """
    folder = Path(folder)
    state = checkpoint_state(folder)
    weights = read_tensors(folder / MODEL_FILE)
    params = dict(model.named_parameters())
    check_weights(weights, {name: p.shape for name, p in params.items()}, folder / MODEL_FILE)
    create_optimizer_state(optimizer, list(params.values()))
    _restore_optimizer(optimizer, params, folder / OPTIMIZER_FILE)
    masters = master_weights(optimizer)
    for name, param in params.items():
        assign(param, weights[name])
        if param.name in masters:
            assign(masters[param.name], weights[name])
    _restore_rng(folder)
    return state


def create_optimizer_state(optimizer, params: list) -> None:
    """Create ``optimizer``'s moments and master copies (sharded when it is), so a checkpoint can fill them.

    A distributed optimizer creates them as Paddle documents, by ``state_dict()`` (one step on zero gradients,
    which moves the weights: they are set after it); a plain one by ``_create_accumulators``, what its first step
    calls, which runs no kernel and moves nothing.
    """
    import paddle

    if hasattr(optimizer, "_inner_opt"):
        optimizer.state_dict()
    else:
        optimizer._create_accumulators(paddle.static.default_main_program().global_block(), params)


def assign(target, value) -> None:
    """Set ``target`` (a parameter or optimizer tensor, sharded or not) to the whole tensor ``value``, cast."""
    import paddle.distributed as dist

    value = value.astype(target.dtype)
    if target.is_dist():
        value = dist.shard_tensor(value, target.process_mesh, target.placements)
    target.set_value(value)


def _restore_optimizer(optimizer, params: dict[str, Any], path: Path) -> None:
    """Set ``optimizer``'s created state from the checkpoint file ``path``; every tensor must have its pair."""
    import paddle
    import paddle.distributed as dist

    current = optimizer.state_dict()
    keys = optimizer_keys(optimizer, params)  # Paddle's key -> checkpoint key
    saved = {f"{k.split('/', 1)[0]}/{_MASTER_INFIX.sub('', k.split('/', 1)[1])}": v
             for k, v in read_tensors(path).items()}
    extra = sorted(set(saved) - set(keys.values()))
    if extra:
        raise CheckpointError(f"{path}: {extra[0]} has no counterpart in this optimizer")
    restored = {k: v for k, v in current.items() if not isinstance(v, paddle.Tensor)}
    for key, target in keys.items():
        if target not in saved:
            raise CheckpointError(f"{path}: no {target} for this optimizer")
        like, param = current[key], params[target.split("/", 1)[0]]
        value = paddle.to_tensor(saved[target]).astype(like.dtype)
        if like.is_dist() or param.is_dist():  # sharded as this layout and ZeRO stage want it
            placements = like.placements if like.is_dist() else [dist.Replicate()] * len(param.placements)
            value = dist.shard_tensor(value, like.process_mesh if like.is_dist() else param.process_mesh, placements)
        restored[key] = value
    optimizer.set_state_dict(restored)


def _restore_rng(folder: Path) -> None:
    import paddle

    if (folder / RNG_FILE).is_file():
        try:
            states = restored_rng_state(json.loads((folder / RNG_FILE).read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{folder / RNG_FILE}: unreadable generator state ({exc!r})") from None
        paddle.set_rng_state(states)
    elif (folder / LEGACY_RNG_FILE).is_file():
        logger.warning("%s: generator state in Paddle's own format, no longer read; the random numbers of this "
                       "run continue from the seed, not from where the checkpointed run stopped",
                       folder / LEGACY_RNG_FILE)


# --- Paddle's generator states as JSON --------------------------------------------------------------


def rng_state(states) -> dict[str, Any]:
    """``paddle.get_rng_state()`` as JSON: per device generator its seed, offset and engine state (text)."""
    generators = []
    for state in states:
        device, seed, offset, engine = state.__getstate__()  # the generator's plain numbers
        generators.append({"device": device, "seed": seed, "offset": offset, "engine": bytes(engine).decode("latin-1")})
    return {"generators": generators}


def restored_rng_state(saved: dict[str, Any]) -> list:
    """The ``GeneratorState`` list that ``paddle.set_rng_state`` takes, from :func:`rng_state`'s JSON."""
    from paddle.base.core import GeneratorState

    states = []
    for generator in saved["generators"]:
        state = GeneratorState.__new__(GeneratorState)  # it has no constructor; its __setstate__ fills it
        state.__setstate__((int(generator["device"]), int(generator["seed"]), int(generator["offset"]),
                            list(generator["engine"].encode("latin-1"))))
        states.append(state)
    return states
