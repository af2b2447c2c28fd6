"""`corpus.encoding.executor: ray` on a real Ray cluster started here on 127.0.0.1: the local executor's bytes, a
killed worker retried, bad input not retried and named as locally, a folder the tasks cannot see refused, and
`kedro run --pipelines corpus --env cluster` against the same head node."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.corpus.executors import assert_eta_lines
from tests.helpers.corpus import GOOD, encode, multistream_dump, output_bytes, sample_pages, stopped_mid_chunk
from tests.helpers.project import TINY_SLICE, TINY_TOKENIZER, cli_params, corpus_params, publish
from train_deploy.atomic import atomic_folder
from train_deploy.corpus.build import encode_corpus
from train_deploy.corpus.config import CorpusConfig, ReaderConfig
from train_deploy.corpus.readers import CorpusError, ReadStats, iter_documents, plan_corpus
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs

RAY = {"executor": "ray", "workers": 2}
# Ray replaces 127.0.0.1 by this machine's outward address unless told it is a one-machine cluster (the switch's
# name is Ray's; it is read when Ray is imported): the head, this process and `kedro run` all keep to 127.0.0.1.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
TASK = "ray::corpus_encode_chunk"  # a Ray worker's process title while it runs a chunk
SHARD = re.compile(r"/\.chunk-(\d{6})-[a-z0-9_]+/\d{6}\.(?:train|valid)\.bin$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, Path | None]]:
    """A Ray head node (2 CPUs, 127.0.0.1) started with ``ray start --head --block``; yields its address and a
    folder its tasks cannot see (a tmpfs mounted over it in the head's own mount namespace, as another machine
    would not have this one's disk), or None where mount namespaces are not available."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    private = temp / "private"
    private.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    start = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", address.split(":")[1],
             "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--object-store-memory", str(200 * 2**20),
             "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp / "session")]
    isolated = _can_unshare()
    if isolated:
        start = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs tmpfs "{private}" && exec "$@"', "sh", *start]
    head = subprocess.Popen(start, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **LOOPBACK})
    try:
        _wait_for_head(address, head)
        yield address, private if isolated else None
    finally:
        head.terminate()  # `ray start --block` stops the node's processes when it is told to end
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
        _kill_leftovers(str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_head(address: str, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    host, port = address.split(":")
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    pytest.fail("the Ray head node did not start within 2 minutes")


def _kill_leftovers(marker: str) -> None:
    """End this cluster's processes that outlived ``ray start`` (those whose command line names its folder)."""
    for process in psutil.process_iter(["cmdline"]):
        if marker in " ".join(process.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                process.kill()


@pytest.fixture(scope="module")
def ray_module():
    """Ray, imported with this module's settings (read when it is imported: no other test imports it, and the
    executor imports it only when asked for). An explicit address does not turn the head's token authentication
    on in the driver by itself."""
    os.environ.update(RAY_AUTH_MODE="token", **LOOPBACK)
    import ray

    return ray


@pytest.fixture(scope="module")
def ray_driver(ray_module, ray_head) -> Iterator[tuple[str, Path | None]]:
    """This process connected to :func:`ray_head` (the executor uses an existing connection)."""
    ray = ray_module
    ray.init(address=ray_head[0], log_to_driver=False)
    try:
        yield ray_head
    finally:
        ray.shutdown()


def test_a_ray_address_where_nothing_answers_is_refused_at_once_in_one_line(tmp_path, tiny_tokenizer, ray_module):
    assert not ray_module.is_initialized(), "runs before this module connects: the executor would reuse that"
    address = f"127.0.0.1:{_free_port()}"
    source = tmp_path / "c.txt"
    source.write_text(GOOD, encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(CorpusError) as exc:
        _encode_text(tmp_path, tiny_tokenizer, [source], **RAY, ray_address=address)
    assert time.monotonic() - started < 10  # not ray.init's minutes of retries
    assert str(exc.value) == (f"corpus.encoding.ray_address: nothing answers at {address} (Connection refused): "
                              "start the head node with `ray start --head` or correct the address")
    assert [p.name for p in tmp_path.iterdir()] == ["c.txt"]


@pytest.mark.slow
def test_without_an_address_a_private_ray_instance_encodes_and_leaves_no_process_or_folder(tmp_path, tiny_tokenizer,
                                                                                          ray_module):
    assert not ray_module.is_initialized(), "runs before this module connects: the executor would reuse that"
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("train_deploy-ray-*"))
    _, local = encode(tmp_path / "local", tiny_tokenizer)
    _, remote = encode(tmp_path / "ray", tiny_tokenizer, encoding=RAY)
    assert output_bytes(tmp_path / "ray" / "tokens") == output_bytes(tmp_path / "local" / "tokens")
    assert remote.fingerprint == local.fingerprint and 1 <= remote.workers <= 2
    assert not ray_module.is_initialized()
    assert set(temp.glob("train_deploy-ray-*")) == before  # its session folder and logs are gone
    time.sleep(1)
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if "train_deploy-ray-" in " ".join(
        p.info["cmdline"] or [])], "a process of the private Ray instance outlived the stage"


def _documents(max_bytes: int) -> list[str]:
    reader = ReaderConfig(max_bytes=max_bytes)
    return [d for c in plan_corpus(reader).chunks for d in iter_documents(c, reader, ReadStats())]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, dict]:
    """The determinism tests' inputs as reader blocks: People's Daily, a text file, JSON lines, a multistream dump."""
    folder = tmp_path_factory.mktemp("corpora")
    documents = _documents(60_000)
    (folder / "c.txt").write_text("\n\n".join(documents), encoding="utf-8")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in documents),
                                    encoding="utf-8")
    (folder / "wiki.xml.bz2").write_bytes(multistream_dump(sample_pages(400), 10))
    small = {"max_bytes": None, "chunk_bytes": 4096}
    return {"people_daily": {},
            "text": {"source": "text", "paths": [str(folder / "c.txt")], **small},
            "jsonl": {"source": "jsonl", "paths": [str(folder / "c.jsonl")], **small},
            "wiki": {"source": "wiki_xml", "paths": [str(folder / "wiki.xml.bz2")], **small}}


@pytest.mark.parametrize(("corpus", "shards"), [("people_daily", "shared_folder"), ("text", "object_store"),
                                                 ("jsonl", "shared_folder"), ("wiki", "object_store")])
@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_ray_tasks_write_the_local_executors_bytes_and_manifest_counts(tmp_path, tiny_tokenizer, ray_driver, corpora,
                                                                      corpus, shards):
    cleaning = {"max_repeated_ngram_share": 1.0, "near_dedup": False} if corpus == "wiki" else {}  # pages alike
    _, local = encode(tmp_path / "local", tiny_tokenizer, reader=corpora[corpus], cleaning=cleaning)
    _, remote = encode(tmp_path / "ray", tiny_tokenizer, reader=corpora[corpus], cleaning=cleaning,
                       encoding={**RAY, "shards": shards})
    assert remote.input["chunks"] >= 4 and remote.config["encoding"]["executor"] == "ray"
    assert output_bytes(tmp_path / "ray" / "tokens") == output_bytes(tmp_path / "local" / "tokens")
    assert remote.fingerprint == local.fingerprint
    assert (remote.documents, remote.tokens, remote.splits) == (local.documents, local.tokens, local.splits)
    assert 1 <= remote.workers <= 2 and len(remote.peak_rss_mb["helpers"]) == remote.workers  # Ray's processes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "ray"]


def test_ray_encoding_logs_its_eta_line_as_chunks_finish(tmp_path, tiny_tokenizer, ray_driver, caplog, monkeypatch):
    monkeypatch.setattr("train_deploy.corpus.executors.progress.LOG_EVERY_S", 0.0)  # a line for every chunk
    with caplog.at_level(logging.INFO, logger="train_deploy.corpus.executors.progress"):
        _, manifest = encode(tmp_path, tiny_tokenizer, encoding=RAY)
    assert_eta_lines(caplog.records, manifest.input["chunks"])


@pytest.mark.slow
def test_a_ray_worker_killed_while_encoding_is_retried_and_the_output_is_unchanged(tmp_path, tiny_tokenizer,
                                                                                   ray_driver):
    reader = {"max_bytes": 3_000_000, "chunk_bytes": 64 * 1024}  # 46 chunks: seconds of work for 2 warm workers
    _, local = encode(tmp_path / "local", tiny_tokenizer, reader=reader, encoding={"workers": 2})
    config, plan = plan_inputs(corpus_params(reader=reader, encoding=RAY))
    outcome: list[object] = []
    stage = threading.Thread(target=lambda: outcome.append(
        publish(encode_tokens(config, plan, tiny_tokenizer), tmp_path / "ray" / "tokens", TokenManifest)))
    stage.start()
    running = lambda: [p for p in psutil.process_iter(["name"]) if p.info["name"] == TASK]  # noqa: E731 - cheap first
    worker, chunk = stopped_mid_chunk(time.monotonic() + 60, running, TASK, SHARD)
    worker.send_signal(signal.SIGKILL)
    stage.join(120)
    assert not stage.is_alive() and len(outcome) == 1, "the stage did not finish after its worker was killed"
    remote = outcome[0]
    assert 0 <= chunk < len(plan.chunks) and not psutil.pid_exists(worker.pid)
    assert output_bytes(tmp_path / "ray" / "tokens") == output_bytes(tmp_path / "local" / "tokens")
    assert (remote.fingerprint, remote.documents, remote.tokens) == (local.fingerprint, local.documents, local.tokens)


class _Opens:
    """Counts the times any process opens ``path`` (inotify ``IN_OPEN``)."""

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK)
        assert self._libc.inotify_add_watch(self._fd, str(path).encode(), 0x20) >= 0

    def count(self) -> int:
        events = 0
        while True:
            try:
                events += len(os.read(self._fd, 4096)) // 16  # a watched file's events carry no name
            except BlockingIOError:
                return events

    def close(self) -> None:
        os.close(self._fd)


def _encode_text(tmp_path: Path, tokenizer, paths: list[Path], **encoding) -> TokenManifest:
    params = corpus_params(reader={"source": "text", "paths": [str(p) for p in paths], "max_bytes": None,
                                   "chunk_bytes": 4096}, encoding=encoding)
    config = CorpusConfig.from_params(params)
    plan = plan_corpus(config.reader)
    with atomic_folder(tmp_path / "tokens") as staging:
        return encode_corpus(config, plan, tokenizer, staging)


def test_bad_input_in_a_ray_task_is_the_local_one_line_error_and_is_not_retried(tmp_path, tiny_tokenizer, ray_driver):
    good, bad = tmp_path / "a.txt", tmp_path / "b_gbk.txt"
    good.write_text(GOOD * 20, encoding="utf-8")
    bad.write_bytes(GOOD.encode() + "这是GBK编码\n".encode("gbk"))  # one chunk, opened once per attempt
    messages, opens = [], []
    for encoding in ({"workers": 1}, {**RAY, "max_retries": 3}):
        watch = _Opens(bad)
        with pytest.raises(CorpusError) as exc:
            _encode_text(tmp_path, tiny_tokenizer, [good, bad], **encoding)
        messages.append(str(exc.value))
        time.sleep(0.5)  # a retry, were there one, would open the file again by now
        opens.append(watch.count())
        watch.close()
    assert messages[0] == messages[1] == f"{bad} line 61: not valid UTF-8 (byte 0xd5 at column 1)"
    assert opens[0] == opens[1] >= 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".tokens", "tokens"))] == []


def test_an_output_folder_the_ray_tasks_cannot_see_is_refused_at_start(tmp_path, tiny_tokenizer, ray_driver):
    _, private = ray_driver
    if private is None:
        pytest.skip("needs `unshare --mount` to hide a folder from the Ray node's processes")
    source = tmp_path / "c.txt"
    source.write_text(GOOD * 40, encoding="utf-8")
    output = private / "out"
    output.mkdir()
    with pytest.raises(CorpusError) as exc:
        _encode_text(output, tiny_tokenizer, [source], **RAY)
    assert str(exc.value) == (f"{output}: Ray tasks on node 127.0.0.1 cannot see this folder (the probe file written "
                              "here is not there): put the output on storage every node mounts at the same path, or "
                              "set corpus.encoding.shards: object_store")
    assert list(output.iterdir()) == []
    manifest = _encode_text(output, tiny_tokenizer, [source], **RAY, shards="object_store")  # no shared disk needed
    assert manifest.documents.kept == 30 and (output / "tokens" / "train.bin").is_file()


@pytest.mark.slow
def test_kedro_run_corpus_env_cluster_joins_the_head_node_and_writes_the_local_bytes(project, tmp_path,
                                                                                     tiny_tokenizer, ray_driver):
    params = {"corpus": {"reader": {"max_bytes": TINY_SLICE, "chunk_bytes": 32 * 1024}, "tokenizer": TINY_TOKENIZER,
                         "encoding": {"progress": False}}}
    env = {**os.environ, "RAY_ADDRESS": ray_driver[0], "RAY_AUTH_MODE": "token", **LOOPBACK}
    command = [str(Path(sys.executable).parent / "kedro"), "run", "--pipelines", "corpus", "--env", "cluster",
               "--params", ",".join(cli_params(params))]
    run = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    remote = TokenManifest.read_folder(project / "data/04_feature/tokens")
    assert remote.config["encoding"]["executor"] == "ray" and remote.config["encoding"]["ray_address"] == "auto"
    assert remote.input["chunks"] >= 4 and remote.workers >= 1
    trained = TokenizerInfo.read_folder(project / "data/06_models/tokenizer")
    local = publish(encode_tokens(*plan_inputs(corpus_params(reader=params["corpus"]["reader"],
                                                             encoding={"workers": 2})), trained),
                    tmp_path / "local" / "tokens", TokenManifest)
    assert output_bytes(project / "data/04_feature/tokens") == output_bytes(tmp_path / "local" / "tokens")
    assert remote.fingerprint == local.fingerprint and remote.documents == local.documents
