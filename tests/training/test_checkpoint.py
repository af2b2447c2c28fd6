"""Checkpoint files: each recorded with its size and hash, verified before use, no pickle anywhere."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.project import REPO
from train_deploy.training.checkpoint import (
    FILES_KEY,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    check_trained_on,
    complete_checkpoints,
    file_record,
    latest_intact_checkpoint,
    restored_rng_state,
    verify_checkpoint,
    write_checkpoint,
)


def checkpoint(folder: Path, step: int, **state) -> Path:
    """A checkpoint as training writes it, with a small model and optimizer state."""
    import paddle

    weights = {"a.weight": paddle.rand([4, 8]), "b.bias": paddle.rand([8])}
    moments = {"a.weight/moment1_0": paddle.rand([4, 8])}
    return write_checkpoint(folder, step, weights, moments, {"step": step, **state}, keep_last=10)


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def test_every_file_is_recorded_with_its_size_and_hash_and_an_intact_checkpoint_verifies(tmp_path):
    folder = checkpoint(tmp_path, 3)
    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    assert set(state[FILES_KEY]) == {MODEL_FILE, OPTIMIZER_FILE, RNG_FILE}
    for name, record in state[FILES_KEY].items():
        assert record == file_record(folder / name) and record["bytes"] == (folder / name).stat().st_size
    assert verify_checkpoint(folder)["step"] == 3


@pytest.mark.parametrize("damage,name,message", [
    (truncate, MODEL_FILE, r"model.safetensors: \d+ bytes, state.json records \d+ \(truncated or overwritten\)"),
    (zero, OPTIMIZER_FILE, r"optimizer.safetensors: content changed since it was written \(xxh3-128 \w+, "
                           r"state.json records \w+\)"),
    (Path.unlink, RNG_FILE, r"rng_state.json: missing"),
    (zero, STATE_FILE, r"state.json: unreadable checkpoint state"),
], ids=["truncated", "zeroed", "missing", "zeroed-state"])
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path, damage, name, message):
    folder = checkpoint(tmp_path, 3)
    damage(folder / name)
    with pytest.raises(CheckpointError, match=rf"step_00000003/{message}"):
        verify_checkpoint(folder)


def test_only_the_files_asked_for_are_checked(tmp_path):
    folder = checkpoint(tmp_path, 3)
    zero(folder / OPTIMIZER_FILE)
    assert verify_checkpoint(folder, [MODEL_FILE])["step"] == 3
    truncate(folder / MODEL_FILE)
    with pytest.raises(CheckpointError, match="truncated or overwritten"):
        verify_checkpoint(folder, [MODEL_FILE], contents=False)


def test_a_checkpoint_from_before_files_were_recorded_is_checked_by_parsing(tmp_path):
    folder = checkpoint(tmp_path, 3)
    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    del state[FILES_KEY]
    (folder / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
    (folder / RNG_FILE).unlink()  # older checkpoints held rng_state.pdstates, which is not read
    assert verify_checkpoint(folder)["step"] == 3
    truncate(folder / OPTIMIZER_FILE)
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors: truncated"):
        verify_checkpoint(folder)
    zero(folder / MODEL_FILE)
    with pytest.raises(CheckpointError, match=r"model.safetensors: (truncated|not a safetensors file)"):
        verify_checkpoint(folder, [MODEL_FILE])


def test_damaged_newer_checkpoints_are_moved_aside_with_a_warning_and_the_previous_one_is_chosen(tmp_path, caplog):
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    zero(tmp_path / "step_00000006" / MODEL_FILE)
    (tmp_path / "step_00000004" / OPTIMIZER_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_intact_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert complete_checkpoints(tmp_path) == [tmp_path / "step_00000002"]
    for step, file, reason in ((6, MODEL_FILE, "content changed"), (4, OPTIMIZER_FILE, "missing")):
        (aside,) = tmp_path.glob(f"step_{step:08d}.damaged-*")
        assert re.fullmatch(rf"step_{step:08d}\.damaged-\d{{4}}-\d\d-\d\dT\d\d\.\d\d\.\d\d\.\d{{6}}Z", aside.name)
        assert (aside / MODEL_FILE).is_file()  # kept, not deleted
        assert (f"Checkpoint {tmp_path / f'step_{step:08d}'} is damaged ({tmp_path / f'step_{step:08d}' / file}: "
                f"{reason}") in caplog.text
        assert f"moved aside to {aside.name}, trying the previous one" in caplog.text


def test_no_intact_checkpoint_means_none(tmp_path):
    checkpoint(tmp_path, 2)
    truncate(tmp_path / "step_00000002" / MODEL_FILE)
    assert latest_intact_checkpoint(tmp_path) is None
    assert latest_intact_checkpoint(tmp_path / "nothing") is None


def test_a_restored_generator_state_draws_the_same_random_numbers(tmp_path):
    import paddle

    paddle.seed(7)
    paddle.rand([11])  # the generator has moved past its seed
    folder = checkpoint(tmp_path, 1)
    expected = [paddle.rand([5]).numpy(), paddle.randn([3]).numpy(),
                paddle.nn.functional.dropout(paddle.ones([64]), 0.5).numpy()]
    paddle.seed(99)
    paddle.set_rng_state(restored_rng_state(json.loads((folder / RNG_FILE).read_text(encoding="utf-8"))))
    got = [paddle.rand([5]).numpy(), paddle.randn([3]).numpy(),
           paddle.nn.functional.dropout(paddle.ones([64]), 0.5).numpy()]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_old_pickled_generator_state_is_not_read_but_named_in_a_warning(tmp_path, caplog):
    from train_deploy.training.checkpoint import LEGACY_RNG_FILE, _restore_rng

    (tmp_path / LEGACY_RNG_FILE).write_bytes(b"\x80\x04not read")
    with caplog.at_level(logging.WARNING):
        _restore_rng(tmp_path)
    assert (f"{tmp_path / LEGACY_RNG_FILE}: generator state in Paddle's own format, no longer read; the random "
            "numbers of this run continue from the seed") in caplog.text
    (tmp_path / RNG_FILE).write_text('{"generators": [{"seed": 1}]}', encoding="utf-8")
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / RNG_FILE}: unreadable generator state \(KeyError"):
        _restore_rng(tmp_path)


def test_nothing_in_the_library_is_saved_or_loaded_with_pickle():
    # Every way Python code reads or writes a pickle file: Paddle's own formats, pickle's loaders, pandas and
    # numpy's pickle paths and the pickling libraries. ``pickle.dumps`` (serialising to memory: the corpus stage
    # checks that a helper's exception can cross the pipe) loads nothing; words in messages refusing a pickle
    # (training/pretrained.py) are no use of one.
    pattern = re.compile(r"paddle\.(save|load)\b|pickle\.(load|loads|dump)\b|Unpickler|read_pickle|to_pickle"
                         r"|allow_pickle\s*=\s*True|\b(cloudpickle|dill|joblib)\b")
    sources = sorted((REPO / "src" / "train_deploy").rglob("*.py"))  # the code (not a build's PKG-INFO)
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in sources
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line)]
    assert not found, "\n".join(found)


def test_a_checkpoint_of_another_corpus_names_both_fingerprints(tmp_path, caplog):
    state = {"data": {"corpus_fingerprint": "aaaa"}}
    with pytest.raises(CheckpointError, match=rf"^{tmp_path} was trained on corpus aaaa but the token files are "
                                              r"corpus bbbb; use the token files it was trained on$"):
        check_trained_on(state, "bbbb", tmp_path)
    check_trained_on(state, "aaaa", tmp_path)
    with caplog.at_level(logging.WARNING):
        check_trained_on({"step": 1}, "bbbb", tmp_path)
    assert f"{tmp_path} records no corpus fingerprint: cannot check that it was trained on the token files of " \
           "corpus bbbb" in caplog.text


# --- AMP O2: float32 master weights ---------------------------------------------------------------------------


def low_precision_model(seed: int):
    """A bfloat16 model and an AdamW keeping float32 master copies (AMP O2), its state created as its first step
    creates it. Paddle's CPU AdamW has no bfloat16 kernel, so no step runs here: ``benchmarks/gpu_check.sh`` runs
    the O2 stop-and-resume on a GPU."""
    import paddle

    from train_deploy.training.checkpoint import create_optimizer_state

    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.LayerNorm(16), paddle.nn.Linear(16, 4))
    model.to(dtype="bfloat16")
    lr = paddle.optimizer.lr.LambdaDecay(1e-3, lambda step: 1.0)
    optimizer = paddle.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), multi_precision=True)
    create_optimizer_state(optimizer, model.parameters())
    return model, optimizer


def trained_state(model, optimizer, seed: int) -> None:
    """Fill the state as training would: masters off the bfloat16 grid, parameters their rounding, moments."""
    import paddle

    rng = np.random.default_rng(seed)
    masters = optimizer.state_dict()["master_weights"]
    for param in model.parameters():
        master = masters[param.name]
        master.set_value(master + paddle.to_tensor(rng.normal(0, 1e-3, master.shape).astype("float32")))
        param.set_value(master.astype(param.dtype))
    for value in optimizer.state_dict().values():
        if isinstance(value, paddle.Tensor):
            value.set_value(paddle.to_tensor(rng.random(value.shape).astype("float32")).astype(value.dtype))


def test_master_weights_are_the_saved_weights_and_resume_exactly(tmp_path):
    import paddle

    from train_deploy.training.checkpoint import read_tensors, restore_training_state, training_state

    model, optimizer = low_precision_model(seed=1)
    trained_state(model, optimizer, seed=2)
    masters = {n: optimizer.state_dict()["master_weights"][p.name].numpy() for n, p in model.named_parameters()}
    weights, moments = training_state(model, optimizer)
    folder = write_checkpoint(tmp_path, 7, weights, moments, {"step": 7}, keep_last=1)

    saved = read_tensors(folder / MODEL_FILE)
    assert {str(t.dtype) for t in saved.values()} == {"paddle.float32"}
    for name, master in masters.items():  # the masters, not their bfloat16 rounding
        np.testing.assert_array_equal(saved[name].numpy(), master)
        assert not np.array_equal(master, saved[name].astype("bfloat16").astype("float32").numpy())
    assert not any("fp32_master" in key for key in read_tensors(folder / OPTIMIZER_FILE))

    fresh, fresh_optimizer = low_precision_model(seed=3)  # other initial weights and masters
    restore_training_state(fresh, fresh_optimizer, folder)
    restored = fresh_optimizer.state_dict()
    for (name, param), (_, before) in zip(fresh.named_parameters(), model.named_parameters(), strict=True):
        np.testing.assert_array_equal(restored["master_weights"][param.name].numpy(), masters[name])
        np.testing.assert_array_equal(param.astype("float32").numpy(), before.astype("float32").numpy())
    # Every tensor the next AdamW step reads (moments, powers of beta, masters) is the uninterrupted run's, so the
    # step computes the same update; key by structured name (fresh Paddle names differ by construction order).
    original = dict(zip(optimizer.state_dict(), restored, strict=True))
    for key, value in optimizer.state_dict().items():
        if isinstance(value, paddle.Tensor):
            np.testing.assert_array_equal(restored[original[key]].numpy(), value.numpy())


def test_a_float32_checkpoint_resumes_into_master_weights_and_back(tmp_path):
    import paddle

    from train_deploy.training.checkpoint import create_optimizer_state, restore_training_state, training_state

    model, optimizer = low_precision_model(seed=1)
    trained_state(model, optimizer, seed=2)
    folder = write_checkpoint(tmp_path, 2, *training_state(model, optimizer), {"step": 2}, keep_last=1)
    plain = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.LayerNorm(16), paddle.nn.Linear(16, 4))
    adamw = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=plain.parameters())
    create_optimizer_state(adamw, plain.parameters())
    restore_training_state(plain, adamw, folder)  # O2 → float32: the masters become the weights
    saved = read_tensors_of(folder)
    for name, p in plain.named_parameters():
        np.testing.assert_array_equal(p.numpy(), saved[name])
    again = write_checkpoint(tmp_path, 3, *training_state(plain, adamw), {"step": 3}, keep_last=2)
    o2, o2_optimizer = low_precision_model(seed=4)
    restore_training_state(o2, o2_optimizer, again)  # float32 → O2
    masters = o2_optimizer.state_dict()["master_weights"]
    for name, p in o2.named_parameters():
        np.testing.assert_array_equal(masters[p.name].numpy(), saved[name])


def read_tensors_of(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / MODEL_FILE))


_WRITE = """
import sys
import numpy as np, paddle
from train_deploy.training.checkpoint import write_checkpoint
weights = {"a.weight": paddle.to_tensor(np.arange(32, dtype=np.float32).reshape(4, 8)),
           "b.bias": paddle.to_tensor(np.ones(8, np.float32))}
moments = {"a.weight/moment1_0": paddle.to_tensor(np.zeros((4, 8), np.float32))}
paddle.seed(7)
write_checkpoint(sys.argv[1], 3, weights, moments, {"step": 3}, keep_last=1)
"""


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_the_same_tensors_written_by_different_processes_are_the_same_bytes(tmp_path):
    """safetensors writes its metadata in a per-process hash order; the checkpoint's files must not vary with it."""
    import subprocess
    import sys

    folders = [tmp_path / f"run{i}" for i in range(3)]
    for folder in folders:
        subprocess.run([sys.executable, "-c", _WRITE, str(folder)], check=True, capture_output=True, timeout=300)
    for name in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE):
        contents = {(folder / "step_00000003" / name).read_bytes() for folder in folders}
        assert len(contents) == 1, name
