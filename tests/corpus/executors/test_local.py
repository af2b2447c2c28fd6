"""The local executor: this process and spawned helpers write the same bytes for any worker count; a helper that
dies (the OOM killer) fails the stage at once, names its chunk and publishes nothing."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from kedro.io import DatasetError

from tests.corpus.executors import assert_eta_lines
from tests.helpers.corpus import encode, output_bytes, stopped_mid_chunk
from tests.helpers.project import corpus_params, publish
from train_deploy.corpus.readers import people_daily_path
from train_deploy.handoffs import TokenManifest
from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs

SHARD = re.compile(r"/\.shards\.tdstage-[a-z0-9_]+/(\d{6})\.(?:train|valid)\.bin$")


def published_files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def helper_mid_chunk(deadline: float) -> tuple[psutil.Process, int]:
    """Find this process's corpus helper and stop it (SIGSTOP) while it writes a chunk; return it and the chunk."""
    return stopped_mid_chunk(deadline, lambda: psutil.Process().children(), "spawn_main", SHARD)


def test_output_is_byte_identical_with_one_and_two_workers(tmp_path, tiny_tokenizer):
    _, one = encode(tmp_path / "w1", tiny_tokenizer, encoding={"workers": 1})
    _, two = encode(tmp_path / "w2", tiny_tokenizer, encoding={"workers": 2})
    assert one.input["chunks"] > 2 and two.workers == 2
    first, second = output_bytes(tmp_path / "w1" / "tokens"), output_bytes(tmp_path / "w2" / "tokens")
    assert set(first) == {"train.bin", "train.idx", "valid.bin", "valid.idx"}
    assert first == second


def test_helpers_start_without_importing_the_parents_main_module(monkeypatch):
    import sys
    import types

    from train_deploy.corpus.executors.local import _main_module_hidden

    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = "/venv/bin/kedro", types.SimpleNamespace(name="kedro")
    monkeypatch.setitem(sys.modules, "__main__", main)
    with _main_module_hidden():
        from multiprocessing.spawn import get_preparation_data

        data = get_preparation_data("helper")
        assert "init_main_from_path" not in data and "init_main_from_name" not in data
    assert main.__file__ == "/venv/bin/kedro" and main.__spec__.name == "kedro"


@pytest.mark.slow
def test_a_killed_helper_fails_the_stage_within_a_minute_naming_its_chunk(tmp_path, tiny_tokenizer):
    tokens = tmp_path / "tokens"
    publish(encode_tokens(*plan_inputs(corpus_params()), tiny_tokenizer), tokens, TokenManifest)
    before = published_files(tokens)
    # The whole People's Daily corpus (10 MB) in 64 KB chunks: the stage runs for seconds with two processes.
    config, plan = plan_inputs(corpus_params(reader={"max_bytes": None, "chunk_bytes": 64 * 1024},
                                             encoding={"workers": 2}))
    failure: list[BaseException] = []

    def stage() -> None:
        try:
            publish(encode_tokens(config, plan, tiny_tokenizer), tokens, TokenManifest)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failure.append(exc)

    thread = threading.Thread(target=stage)
    thread.start()
    helper, chunk = helper_mid_chunk(time.monotonic() + 60)
    helper.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    thread.join(60)
    assert not thread.is_alive(), "the stage still runs a minute after its helper was killed"
    elapsed = time.monotonic() - killed
    assert len(failure) == 1 and isinstance(failure[0], DatasetError)
    message = str(failure[0])
    span = plan.chunks[chunk]
    assert message == (f"corpus helper {helper.pid} died (signal SIGKILL) while encoding chunk {chunk} of "
                       f"{people_daily_path()} (bytes {span.start}..{span.end}); nothing was published")
    assert elapsed < 60, elapsed
    assert published_files(tokens) == before  # the published token folder is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["tokens"]  # no staging folder left
    assert not [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())], \
        "a helper outlived the stage"



def test_encoding_logs_its_eta_line_over_the_plans_chunks_monotone_to_the_end(tmp_path, tiny_tokenizer, caplog,
                                                                                 capsys, monkeypatch):
    monkeypatch.setattr("train_deploy.corpus.executors.progress.LOG_EVERY_S", 0.0)  # a line for every chunk
    with caplog.at_level(logging.INFO, logger="train_deploy.corpus.executors.progress"):
        _, manifest = encode(tmp_path, tiny_tokenizer, encoding={"workers": 2})
    assert_eta_lines(caplog.records, manifest.input["chunks"])
    assert "\r" not in "".join(capsys.readouterr())  # no bar: standard error is not a terminal
