"""Averaging: numerics against numpy, selection, and every mismatch by its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers.averaging import MODEL_CONFIG, average_into, make_checkpoint
from train_deploy.averaging.average import (
    average_checkpoints,
    averaging_weights,
    check_compatible,
    select_checkpoints,
)
from train_deploy.averaging.config import AveragingConfig
from train_deploy.handoffs import CurveDiagnosis
from train_deploy.training.checkpoint import (
    FILES_KEY,
    MODEL_FILE,
    CheckpointError,
    file_record,
    verify_checkpoint,
    write_checkpoint,
)


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "checkpoints"
    for i, loss in zip(range(1, 6), [5.0, 4.0, 3.5, 3.6, 3.55], strict=True):
        make_checkpoint(folder, step=10 * i, seed=i, val_loss=loss)
    return folder


def test_uniform_average_equals_the_numpy_mean_tensor_by_tensor(run, tmp_path):
    config = AveragingConfig(k=3)
    chosen = select_checkpoints(run, config).paths
    assert [p.name for p in chosen] == ["step_00000030", "step_00000040", "step_00000050"]
    out = average_into(chosen, config, tmp_path / "out")
    averaged = load_file(str(out / "model.safetensors"))
    sources = [load_file(str(p / "model.safetensors")) for p in chosen]
    for key in ("a.weight", "b.bias"):
        np.testing.assert_allclose(averaged[key], np.mean([s[key] for s in sources], axis=0), rtol=1e-6, atol=1e-7)
        assert averaged[key].dtype == np.float32
    assert (averaged["counter"] == sources[-1]["counter"]).all()  # integers: from the newest
    state = json.loads((out / "state.json").read_text())
    assert state["step"] == 50 and state["averaged"]["copied_from_newest"] == ["counter"]
    assert [s["step"] for s in state["averaged"]["sources"]] == [30, 40, 50]
    assert all(len(s["xxh3_128"]) == 32 for s in state["averaged"]["sources"])


def test_exponential_average_follows_its_formula(run, tmp_path):
    config = AveragingConfig(k=3, method="ema", decay=0.5)
    weights = averaging_weights(3, config)
    np.testing.assert_allclose(weights, np.array([0.25, 0.5, 1.0]) / 1.75)
    chosen = select_checkpoints(run, config).paths
    averaged = load_file(str(average_into(chosen, config, tmp_path / "out") / "model.safetensors"))
    sources = [load_file(str(p / "model.safetensors"))["a.weight"] for p in chosen]
    np.testing.assert_allclose(averaged["a.weight"], sum(w * s for w, s in zip(weights, sources, strict=True)),
                               rtol=1e-6, atol=1e-7)


def test_one_checkpoint_is_the_identity(run, tmp_path):
    config = AveragingConfig(k=1)
    (chosen,) = select_checkpoints(run, config).paths
    averaged = load_file(str(average_into([chosen], config, tmp_path / "out") / "model.safetensors"))
    original = load_file(str(chosen / "model.safetensors"))
    assert all((averaged[k] == original[k]).all() for k in original)


def test_selection_by_steps_range_and_best_validation_loss(run):
    names = lambda paths: [p.name[-2:] for p in paths]  # noqa: E731
    assert names(select_checkpoints(run, AveragingConfig(select="steps", steps=[20, 40])).paths) == ["20", "40"]
    assert names(select_checkpoints(run, AveragingConfig(select="up_to_step", max_step=35, k=2)).paths) == ["20", "30"]
    assert names(select_checkpoints(run, AveragingConfig(select="best_k", k=3)).paths) == ["30", "40", "50"]
    assert names(select_checkpoints(run, AveragingConfig(select="best_k", k=2)).paths) == ["30", "50"]


def test_too_few_checkpoints_is_an_error_or_a_warning(run, caplog):
    with pytest.raises(CheckpointError, match=r"5 checkpoint\(s\) fit averaging.select=last_k, fewer than k=8"):
        select_checkpoints(run, AveragingConfig(k=8, too_few="raise"))
    assert len(select_checkpoints(run, AveragingConfig(k=8, too_few="warn")).paths) == 5
    assert "fewer than k=8" in caplog.text
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 35"):
        select_checkpoints(run, AveragingConfig(select="steps", steps=[30, 35]))


def test_mismatched_keys_shapes_dtypes_and_configs_name_the_key_and_both_files(tmp_path):
    base = make_checkpoint(tmp_path / "x", 1, seed=1)
    cases = [
        (dict(drop=["b.bias"]), r"tensor 'b.bias' is in .*step_00000001/model.safetensors but not in "
                                r".*step_00000002/model.safetensors"),
        (dict(tensors={"a.weight": np.zeros((4, 9), np.float32)}),
         r"tensor 'a.weight': shape \[4, 8\] in .*step_00000001.* but \[4, 9\] in .*step_00000002"),
        (dict(tensors={"b.bias": np.zeros(8, np.float16)}), r"tensor 'b.bias': dtype F32 in .* but F16 in"),
        (dict(model_config={"hidden_size": 16}), r"model configuration differs between .*step_00000001/state.json and"),
    ]
    for i, (changes, message) in enumerate(cases):
        other = make_checkpoint(tmp_path / f"y{i}", 2, seed=2, **changes)
        with pytest.raises(CheckpointError, match=message):
            check_compatible([base, other])


def test_truncated_or_corrupt_file_is_named(run, tmp_path):
    chosen = select_checkpoints(run, AveragingConfig(k=2)).paths
    model = chosen[-1] / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{model}: truncated \(\d+ bytes, the header describes \d+\)"):
        average_into(chosen, AveragingConfig(k=2), tmp_path / "out")
    model.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=rf"{model}: (truncated|not a safetensors file)"):
        check_compatible(chosen)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def recorded_run(folder: Path, steps=(10, 20, 30)) -> Path:
    """Checkpoints as training writes them: every file's size and hash in ``state.json``."""
    import paddle

    for step in steps:
        paddle.seed(step)
        write_checkpoint(folder, step, {"a.weight": paddle.randn([64, 32]), "b.bias": paddle.randn([32])}, {},
                         {"step": step, "model_config": MODEL_CONFIG}, keep_last=10)
    return folder


def test_the_average_records_its_size_and_hash_and_verifies(tmp_path):
    config = AveragingConfig(k=3)
    out = average_into(select_checkpoints(recorded_run(tmp_path / "ck"), config).paths, config, tmp_path / "out")
    state = json.loads((out / "state.json").read_text())
    assert state[FILES_KEY] == {MODEL_FILE: file_record(out / MODEL_FILE)}
    assert verify_checkpoint(out, [MODEL_FILE])["step"] == 30


def test_a_damaged_source_stops_averaging_naming_the_file(tmp_path):
    config = AveragingConfig(k=3)
    run = recorded_run(tmp_path / "ck")
    model = run / "step_00000020" / MODEL_FILE
    original = model.read_bytes()
    model.write_bytes(original[:-64])  # truncated: refused before anything is read
    with pytest.raises(CheckpointError, match=rf"^{model}: {len(original) - 64} bytes, state.json records "
                                              rf"{len(original)} \(truncated or overwritten\)$"):
        select_checkpoints(run, config)
    with pytest.raises(CheckpointError, match=rf"^{model}: {len(original) - 64} bytes"):
        average_checkpoints([run / "step_00000010", run / "step_00000020"], config, tmp_path / "staging")
    model.unlink()
    with pytest.raises(CheckpointError, match=rf"^{model}: missing$"):
        select_checkpoints(run, config)
    # Tensor bytes zeroed, size and header intact: found by the hash taken while averaging reads them.
    model.write_bytes(original[: len(original) // 2] + bytes(len(original) - len(original) // 2))
    chosen = select_checkpoints(run, config).paths
    with pytest.raises(CheckpointError, match=rf"^{model}: content changed since it was written \(xxh3-128 \w+, "
                                              r"state.json records \w+\)$"):
        average_into(chosen, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bfloat16_checkpoints_average_in_float32_and_stay_bfloat16(tmp_path):
    import paddle
    from safetensors.paddle import load_file as load_paddle
    from safetensors.paddle import save_file as save_paddle

    folders = []
    for step, value in ((1, 1.0), (2, 2.0), (3, 4.0)):
        folder = tmp_path / "ck" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        save_paddle({"w": paddle.full([3, 5], value, dtype="bfloat16")}, str(folder / "model.safetensors"))
        (folder / "state.json").write_text(json.dumps({"step": step, "model_config": MODEL_CONFIG}))
        folders.append(folder)
    out = average_into(folders, AveragingConfig(k=3), tmp_path / "out")
    averaged = load_paddle(str(out / "model.safetensors"))["w"]
    assert averaged.dtype == paddle.bfloat16
    np.testing.assert_allclose(averaged.astype("float32").numpy(), np.full((3, 5), 7 / 3), rtol=1e-2)


def test_averaged_checkpoint_loads_into_the_model_and_evaluates(tmp_path):
    import paddle

    from train_deploy.training.checkpoint import write_checkpoint
    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.evaluation import load_model, validation_loss
    from train_deploy.training.model import build_model

    config = TrainingConfig.from_params({"model": {"preset": "tiny"}})
    for step in (1, 2):
        paddle.seed(step)
        model = build_model(config, vocab_size=64, eos_id=2)
        write_checkpoint(tmp_path / "ck", step, dict(model.named_parameters()), {},
                         {"step": step, "model_config": model.config.to_dict()}, keep_last=5)
    chosen = select_checkpoints(tmp_path / "ck", AveragingConfig(k=2)).paths
    out = average_into(chosen, AveragingConfig(k=2), tmp_path / "out")
    windows = np.random.RandomState(0).randint(0, 64, size=(4, 17))
    loss = validation_loss(load_model(out), windows)
    assert 2.0 < loss < 6.0  # an untrained 64-word model: about ln(64) = 4.16


def test_checkpoints_trained_with_flash_attention_average_and_evaluate_on_cpu(tmp_path):
    """GPU training records use_flash_attention and use_fused_rope; a run resumed elsewhere records them off.
    Both average (the flags are not the model), and the average evaluates on CPU in float32."""
    import paddle

    from train_deploy.training.config import TrainingConfig
    from train_deploy.training.evaluation import load_model, validation_loss
    from train_deploy.training.model import build_model

    config = TrainingConfig.from_params({"model": {"preset": "tiny"}})
    for step, flash in ((1, True), (2, True), (3, False)):
        paddle.seed(step)
        model = build_model(config, vocab_size=64, eos_id=2)
        flags = {"use_flash_attention": flash, "use_fused_rope": flash}
        write_checkpoint(tmp_path / "ck", step, dict(model.named_parameters()), {},
                         {"step": step, "model_config": {**model.config.to_dict(), **flags}}, keep_last=5)
    chosen = select_checkpoints(tmp_path / "ck", AveragingConfig(k=3)).paths
    out = average_into(chosen, AveragingConfig(k=3), tmp_path / "out")
    averaged = load_model(out)
    assert not averaged.config.use_flash_attention and not averaged.config.use_fused_rope
    windows = np.random.RandomState(0).randint(0, 64, size=(4, 17))
    assert 2.0 < validation_loss(averaged, windows) < 6.0
    flash = make_checkpoint(tmp_path / "x", 1, seed=1, model_config={**MODEL_CONFIG, "use_flash_attention": True})
    assert check_compatible([flash, make_checkpoint(tmp_path / "y", 2, seed=2)])
    wider = make_checkpoint(tmp_path / "z", 3, seed=3, model_config={**MODEL_CONFIG, "hidden_size": 16})
    with pytest.raises(CheckpointError, match=r"model configuration differs between .*x/step_00000001/state.json"):
        check_compatible([flash, wider])  # what the model computes still has to match


@pytest.mark.parametrize("method", ["uniform", "ema"])
def test_large_tensors_split_across_threads_average_the_same(tmp_path, method):
    big = {"big.weight": None}
    folders = []
    for step in (1, 2, 3):
        big["big.weight"] = np.random.RandomState(step).randn(1024, 2100).astype(np.float32)  # > 2M elements
        folders.append(make_checkpoint(tmp_path / "ck", step, seed=step, tensors=dict(big)))
    config = AveragingConfig(k=3, method=method, decay=0.5)
    out = load_file(str(average_into(folders, config, tmp_path / "out") / "model.safetensors"))
    sources = [load_file(str(f / "model.safetensors"))["big.weight"] for f in folders]
    expected = sum(w * s for w, s in zip(averaging_weights(3, config), sources, strict=True))
    np.testing.assert_allclose(out["big.weight"], expected, rtol=1e-5, atol=1e-6)


# --- selection by the training curves' diagnosis -----------------------------------------------------------

OVERFIT_CURVE = [5.0, 4.0, 3.5, 3.6, 3.8, 4.0, 4.3]
"""Validation loss of checkpoints at steps 10 … 70: lowest at step 30, then rising."""


def diagnosed(kind: str, best_step: int = 30) -> CurveDiagnosis:
    return CurveDiagnosis(kind=kind, summary=f"{kind}: test", advice="test", best_step=best_step,
                          best_val_loss=3.5, last_val_loss=4.3)


@pytest.fixture
def overfit_run(tmp_path) -> Path:
    folder = tmp_path / "checkpoints"
    for i, loss in enumerate(OVERFIT_CURVE, start=1):
        make_checkpoint(folder, step=10 * i, seed=i, val_loss=loss)
    return folder


def steps_of(selection) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in selection.paths]


def test_an_overfitting_curve_averages_the_checkpoints_around_the_lowest_validation_loss(overfit_run):
    selection = select_checkpoints(overfit_run, AveragingConfig(k=3), diagnosed("overfitting"))
    assert selection.reason == (
        "steps 20, 30, 40: the 3 around step 30, where validation loss was lowest (3.5000; 4.3000 at the end), not "
        "the 3 newest: the training curves show overfitting (averaging.select: last_k)")
    assert steps_of(select_checkpoints(overfit_run, AveragingConfig(k=1), diagnosed("overfitting"))) == [30]
    assert steps_of(select_checkpoints(overfit_run, AveragingConfig(k=2), diagnosed("overfitting"))) == [30, 40]
    assert steps_of(select_checkpoints(overfit_run, AveragingConfig(k=3), diagnosed("overfitting", 10))) == [10, 20, 30]
    assert steps_of(select_checkpoints(overfit_run, AveragingConfig(k=3), diagnosed("overfitting", 68))) == [50, 60, 70]


def test_when_the_lowest_checkpoint_was_not_kept_the_nearest_kept_ones_are_averaged(overfit_run):
    for step in (10, 20, 30):
        shutil.rmtree(overfit_run / f"step_{step:08d}")  # schedule.keep_last: 4
    selection = select_checkpoints(overfit_run, AveragingConfig(k=3), diagnosed("overfitting"))
    assert selection.reason == (
        "steps 40, 50, 60: the 3 around step 30, where validation loss was lowest (3.5000; 4.3000 at the end), not "
        "the 3 newest: the training curves show overfitting (averaging.select: last_k); step 30's checkpoint was "
        "not kept (training.schedule.keep_last), so the nearest kept ones")


@pytest.mark.parametrize("kind", ["underfitting", "converged", "unknown", None])
def test_other_curves_average_the_newest_as_before_byte_for_byte(overfit_run, tmp_path, kind):
    config = AveragingConfig(k=3)
    selection = select_checkpoints(overfit_run, config, None if kind is None else diagnosed(kind))
    assert selection.reason == "steps 50, 60, 70: the 3 newest (averaging.select: last_k)"
    averaged = average_into(selection.paths, config, tmp_path / "out")
    before = average_into([overfit_run / f"step_{s:08d}" for s in (50, 60, 70)], config, tmp_path / "before")
    assert (averaged / MODEL_FILE).read_bytes() == (before / MODEL_FILE).read_bytes()


def test_an_explicit_selection_is_kept_whatever_the_curves_say(overfit_run):
    overfit = diagnosed("overfitting")
    assert steps_of(select_checkpoints(overfit_run, AveragingConfig(select="steps", steps=[60, 70]), overfit)) == \
        [60, 70]
    by_loss = select_checkpoints(overfit_run, AveragingConfig(select="best_k", k=3), overfit)
    assert by_loss.reason == "steps 30, 40, 50: the 3 with the lowest validation loss (averaging.select: best_k)"
    assert select_checkpoints(overfit_run, AveragingConfig(select="up_to_step", max_step=45, k=2), overfit).reason \
        == "steps 30, 40: the 2 newest at or below step 45 (averaging.select: up_to_step)"
