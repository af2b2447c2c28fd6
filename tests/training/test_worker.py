"""Real training processes started by Paddle's launcher, compared with a single-process reference."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.training import TINY_EVAL_WINDOWS, launch, losses, result, training_params, weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_run):
    """Six uninterrupted single-process steps (two accumulation steps of 4 sequences): the session's
    :func:`tests.conftest.tiny_run` (``training_params(1)``), whose folder these tests only read."""
    return Path(tiny_run.checkpoints).parent


LAYOUTS = {"plain-1": (1, {"dp": 1, "single_process": "plain"}), "dp2": (2, {"dp": 2}),
           "mp2": (2, {"mp": 2, "dp": 1}), "dp2xmp2": (4, {"dp": 2, "mp": 2}),
           "dp2-sharding1": (2, {"dp": 2, "sharding_stage": 1})}
"""Five layouts of the same six steps (``training_params(nproc, parallel=…)``) by name."""


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory, tiny_tokens, request):
    """``layout_run(name)``: the folder of the six-step run of :data:`LAYOUTS`' ``name``, launched once per module
    (the resume tests start from its step-3 checkpoint, as a run stopped there would have left it)."""
    folders: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in folders:
            if name == "dp2":  # the session's dp2 run (the two-node test's reference too)
                folders[name] = request.getfixturevalue("dp2_run")
            else:
                nproc, parallel = LAYOUTS[name]
                folders[name] = tmp_path_factory.mktemp(name)
                launch(folders[name], tiny_tokens, training_params(nproc, parallel=parallel))
        return folders[name]

    return run


def stopped_at_step_3(source: Path, folder: Path) -> None:
    """``folder`` as a run of ``source``'s layout stopped after step 3 leaves it: the step-3 checkpoint and the
    metrics of steps 1 to 3 (a six-step run's first three steps are the same: the schedule is that of max_steps)."""
    shutil.copytree(source / "checkpoints" / "step_00000003", folder / "checkpoints" / "step_00000003")
    (folder / "logs").mkdir()
    lines = (source / "logs" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (folder / "logs" / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 3))


def assert_losses_match(folder, reference, rtol=1e-5):
    got, expected = np.array(losses(folder)), np.array(losses(reference))
    assert len(got) == len(expected) == 6
    assert np.max(np.abs(got - expected) / expected) <= rtol, (got, expected)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layouts_match_the_single_process_loss(layout_run, reference, name):
    folder, (_, parallel) = layout_run(name), LAYOUTS[name]
    got = result(folder)
    assert got.finished and got.layout["dp"] == parallel["dp"]
    assert got.layout["mp"] == parallel.get("mp", 1)
    assert_losses_match(folder, reference)
    # Every rank evaluates its share of the same windows; the loss is over all of them.
    expected = result(reference)
    assert got.eval_windows == expected.eval_windows == TINY_EVAL_WINDOWS
    assert got.val_loss == pytest.approx(expected.val_loss, rel=1e-5)


def test_loss_falls_on_the_tiny_model(reference):
    values = losses(reference)
    assert values[-1] < values[0]


def test_resume_after_stop_reaches_the_same_weights(tmp_path, tiny_tokens, reference):
    first = launch(tmp_path, tiny_tokens, training_params(1, schedule={"stop_after": 3}))
    assert (first.step, first.finished) == (3, False)
    second = launch(tmp_path, tiny_tokens, training_params(1))
    assert (second.step, second.finished) == (6, True)
    resumed, uninterrupted = weights(tmp_path, 6), weights(reference, 6)
    assert max(float(np.abs(resumed[k] - uninterrupted[k]).max()) for k in uninterrupted) <= 1e-6
    assert "Resumed from" in (tmp_path / "logs" / "node0" / "workerlog.0").read_text()


def test_a_truncated_newest_checkpoint_is_moved_aside_and_every_rank_resumes_from_the_previous_one(
        tmp_path, tiny_tokens, reference):
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")  # steps 3 and 6, finished
    newest = tmp_path / "checkpoints" / "step_00000006"
    with open(newest / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    got = launch(tmp_path, tiny_tokens, training_params(2, parallel={"dp": 2}))
    assert (got.step, got.finished) == (6, True)
    (aside,) = (tmp_path / "checkpoints").glob("step_00000006.damaged-*")
    assert (aside / "model.safetensors").stat().st_size == (reference / "checkpoints" / "step_00000006" /
                                                            "model.safetensors").stat().st_size - 100
    log = (tmp_path / "logs" / "node0" / "workerlog.0").read_text()
    assert (f"Checkpoint {newest} is damaged ({newest / 'model.safetensors'}: ") in log
    assert f"(truncated or overwritten)); moved aside to {aside.name}, trying the previous one" in log
    assert f"Resumed from {newest.with_name('step_00000003')}: step 3" in log
    assert "damaged" not in (tmp_path / "logs" / "node0" / "workerlog.1").read_text()  # only rank 0 moves
    resumed, uninterrupted = weights(tmp_path, 6), weights(reference, 6)
    assert max(float(np.abs(resumed[k] - uninterrupted[k]).max()) for k in uninterrupted) <= 1e-4


def test_a_plain_single_process_checkpoint_resumes_wrapped_in_auto_parallel(tmp_path, tiny_tokens, reference,
                                                                           layout_run):
    stopped_at_step_3(layout_run("plain-1"), tmp_path)  # no distributed tensors
    assert launch(tmp_path, tiny_tokens, training_params(1)).finished  # wrapped, the default
    resumed, uninterrupted = weights(tmp_path, 6), weights(reference, 6)
    assert max(float(np.abs(resumed[k] - uninterrupted[k]).max()) for k in uninterrupted) <= 1e-6


def test_tensor_parallel_checkpoint_resumes_with_data_parallel(tmp_path, tiny_tokens, reference, layout_run):
    stopped_at_step_3(layout_run("mp2"), tmp_path)
    resumed = launch(tmp_path, tiny_tokens, training_params(2, parallel={"dp": 2}))
    assert resumed.finished and resumed.layout["dp"] == 2
    log = (tmp_path / "logs" / "node0" / "workerlog.0").read_text()
    assert "saved with dp=1 mp=2, now dp=2 mp=1" in log
    # Adam amplifies last-bit differences between layouts, so the weights are close, not identical.
    assert_losses_match(tmp_path, reference, rtol=1e-3)


def test_activation_recompute_gives_the_same_loss(tmp_path, tiny_tokens, reference):
    launch(tmp_path, tiny_tokens, training_params(1, precision={"recompute": True}))
    assert_losses_match(tmp_path, reference, rtol=1e-6)


def test_sharded_optimizer_state_checkpoints_unified_and_resumes(tmp_path, tiny_tokens, reference, layout_run):
    sharded = training_params(2, parallel=LAYOUTS["dp2-sharding1"][1])
    stopped_at_step_3(layout_run("dp2-sharding1"), tmp_path)
    from safetensors.numpy import load_file

    moments = load_file(str(tmp_path / "checkpoints" / "step_00000003" / "optimizer.safetensors"))
    full = load_file(str(reference / "checkpoints" / "step_00000003" / "optimizer.safetensors"))
    assert {k: v.shape for k, v in moments.items()} == {k: v.shape for k, v in full.items()}  # whole tensors
    assert launch(tmp_path, tiny_tokens, sharded).finished
    assert_losses_match(tmp_path, reference, rtol=1e-4)


def test_a_validation_split_smaller_than_one_evaluation_batch_is_skipped_with_a_warning(tmp_path, tiny_tokens):
    np.arange(3 * 32 + 1, dtype=tiny_tokens.dtype).tofile(tmp_path / "short.bin")  # 3 windows, a batch is 4
    data = dataclasses.replace(tiny_tokens, valid_prefix=str(tmp_path / "short"))
    got = launch(tmp_path, data, training_params(1, schedule={"max_steps": 3}))
    assert got.finished and got.val_loss is None and got.eval_windows == 0
    log = (tmp_path / "logs" / "node0" / "workerlog.0").read_text()
    assert ("No validation: the validation split holds 3 windows of 32 tokens, fewer than one evaluation batch "
            "(micro_batch_size × dp = 4); raise corpus.encoding.validation_fraction") in log


def test_norms_are_not_decayed_whatever_auto_parallel_names_them():
    """Auto-parallel renames parameters after the optimizer is built; the decay rule must still know the norms."""
    from train_deploy.training.config import TrainingConfig, resolve_layout
    from train_deploy.training.model import build_model
    from train_deploy.training.parallelize import parallelize
    from train_deploy.training.worker import build_optimizer

    config = TrainingConfig.from_params({**training_params(1), "parallel": {"single_process": "auto_parallel"}})
    model = build_model(config, 2000, 2)
    optimizer, _ = build_optimizer(model, config)
    before = {name: p.name for name, p in model.named_parameters()}
    model, optimizer, _ = parallelize(model, optimizer, layout=resolve_layout(config, 1, 2000), single="auto_parallel")
    renamed = {name: p for name, p in model.named_parameters()}
    assert any(before[name] != p.name for name, p in renamed.items())  # what the rule must survive
    decayed = {name: optimizer._apply_decay_param_fun(p.name) for name, p in renamed.items()}
    assert decayed == {name: p.ndim > 1 for name, p in renamed.items()}
    assert not decayed["llama.norm.weight"] and decayed["llama.embed_tokens.weight"]
