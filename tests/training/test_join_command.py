"""`train-deploy-join` refuses what cannot join the job in one line, before launching anything."""

from __future__ import annotations

import pytest

from tests.helpers.training import run_spec, training_params
from train_deploy.handoffs import DataSpec, write_json
from train_deploy.training.launch import join_main


def _refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        join_main(list(argv))
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.fixture()
def two_node_job(tmp_path):
    """A two-node job's run.json as node 0's training node writes it (its data is never read here)."""
    data = DataSpec(train_prefix=str(tmp_path / "train"), valid_prefix=str(tmp_path / "valid"), dtype="uint16",
                    vocab_size=2000, eos_id=2, corpus_fingerprint="c", tokenizer_hash="t")
    params = training_params(1, launch={"nproc_per_node": 1, "nnodes": 2, "master": "127.0.0.1:29511"})
    file = tmp_path / "logs" / "run.json"
    file.parent.mkdir()
    write_json(file, run_spec(tmp_path, data, params))
    return file


def test_a_missing_run_file_is_refused_in_one_line(tmp_path, capsys):
    missing = tmp_path / "logs" / "run.json"
    assert _refusal(capsys, "--run", str(missing), "--node-rank", "1") == (
        f"train-deploy-join: --run {missing}: no such file; node 0's kedro run writes it into its training_logs "
        "folder, on storage every node sees\n")


def test_a_file_that_is_not_a_run_description_is_refused_in_one_line(tmp_path, capsys):
    other = tmp_path / "result.json"
    other.write_text('{"step": 3}', encoding="utf-8")
    assert _refusal(capsys, "--run", str(other), "--node-rank", "1").startswith(
        f"train-deploy-join: --run {other}: not a job's run.json (")


@pytest.mark.parametrize("rank", ["0", "2", "-1"])
def test_a_node_rank_outside_the_jobs_nodes_is_refused_in_one_line(two_node_job, capsys, rank):
    assert _refusal(capsys, "--run", str(two_node_job), "--node-rank", rank) == (
        f"train-deploy-join: --node-rank {rank}: the job has training.launch.nnodes = 2, so the other machines "
        "join as 1 .. 1 (node 0 runs kedro run)\n")
