"""The corpus stage's chunks as Ray tasks (``corpus.encoding.executor: ray``).

One task per planned chunk runs the local executor's own read → clean → encode → shard kernel
(:class:`train_deploy.corpus.encode.ChunkEncoder`); the driver merges the shards in chunk order as before, so
the token files, the manifest's counts and the fingerprint do not depend on the executor. A task whose worker
process or node dies is run again by Ray (``max_retries``); bad input (:class:`CorpusError`) is not retried and
is raised here with its own one-line message. The tokenizer the driver trained reaches the tasks through
Ray's object store; the shards come back beside the output folder (``shards: shared_folder``, which a probe
file checks every node sees) or through the object store.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from train_deploy.corpus.config import CorpusConfig, EncodingConfig
from train_deploy.corpus.encode import ChunkEncoder, ChunkResult, chunk_place
from train_deploy.corpus.errors import CorpusError
from train_deploy.corpus.executors.progress import EncodingProgress
from train_deploy.corpus.readers import Chunk, CorpusPlan
from train_deploy.handoffs import TokenizerInfo

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT = 300  # seconds: a node that cannot start one small task in this time is not usable
_PREPARED: tuple[tuple[CorpusConfig, str], ChunkEncoder] | None = None
"""In a Ray worker process: the configuration and tokenizer hash its encoder was set up for, and that encoder."""


def run_on_ray(config: CorpusConfig, plan: CorpusPlan, tokenizer: TokenizerInfo, work: Path) -> list[ChunkResult]:
    """Encode every chunk of ``plan`` as a Ray task; their shards end up in ``work``; return their statistics."""
    try:
        import ray
    except ImportError:
        raise CorpusError("corpus.encoding.executor: ray needs the ray package (pip install -r requirements.lock)") \
            from None
    e, work = config.encoding, work.resolve()  # the tasks' working folder is not this process's
    joined, temp_dir = _connect(ray, e, config.workers)
    try:
        logger.info("Encoding %d chunk(s) on Ray (%s CPUs in the cluster, %s per task, shards: %s)",
                    len(plan.chunks), ray.cluster_resources().get("CPU", 0), e.num_cpus, e.shards)
        shared = e.shards == "shared_folder"
        if shared:
            _check_shared_folder(ray, work)
        encode = ray.remote(_encode_task).options(num_cpus=e.num_cpus, max_retries=e.max_retries,
                                                  retry_exceptions=False, name="corpus_encode_chunk")
        files = ray.put(_folder_files(Path(tokenizer.path)))
        pending = {encode.remote(config, tokenizer, files, chunk, str(work) if shared else None): chunk
                   for chunk in plan.chunks}
        return _collect(ray, pending, work, e)
    finally:
        if joined:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _connect(ray: Any, e: EncodingConfig, workers: int) -> tuple[bool, str | None]:
    """Join ``ray_address`` or start a private local instance; return whether this call connected (to
    disconnect at the end) and the private instance's temporary folder (to remove after it stopped). A process
    already connected keeps its connection."""
    if ray.is_initialized():
        return False, None
    options = {"include_dashboard": False, "configure_logging": False, "log_to_driver": True}
    if e.ray_address is not None:
        _check_answers(e.ray_address)
        try:
            ray.init(address=e.ray_address, **options)
        except (ConnectionError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CorpusError(f"corpus.encoding.ray_address: no Ray cluster at {e.ray_address!r} ({reason})") from None
        return True, None
    temp_dir = tempfile.mkdtemp(prefix="train_deploy-ray-")  # its logs go with it, not into /tmp/ray forever
    ray.init(address="local", num_cpus=workers, _temp_dir=temp_dir, **options)
    return True, temp_dir


def _check_answers(address: str) -> None:
    """Fail at once where nothing listens at the head's ``host:port`` (``ray.init`` retries it for minutes)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")  # else Ray looks for this node's cluster and says so itself
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise CorpusError(f"corpus.encoding.ray_address: nothing answers at {address} ({exc.strerror or exc}): start "
                          "the head node with `ray start --head` or correct the address") from None


def _check_shared_folder(ray: Any, work: Path) -> None:
    """Refuse to start unless a task on every node reads the probe file this process writes into ``work``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    probe = work / f".probe-{token}"
    probe.write_text(token, encoding="ascii")
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    read = ray.remote(_read_probe)
    refs = [read.options(num_cpus=0, max_retries=0, name="corpus_probe",
                         scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(str(probe))
            for n in nodes]
    try:
        seen = ray.get(refs, timeout=_PROBE_TIMEOUT)
    finally:
        probe.unlink()
    for address, content in seen:
        if content != token:
            raise CorpusError(
                f"{work.parent.parent}: Ray tasks on node {address} cannot see this folder (the probe file written "
                "here is not there): put the output on storage every node mounts at the same path, or set "
                "corpus.encoding.shards: object_store")


def _read_probe(path: str) -> tuple[str, str | None]:
    """In a task: this node's address and the probe file's content (None where the file is not there)."""
    import ray

    try:
        content = Path(path).read_text(encoding="ascii")
    except OSError:
        content = None
    return ray.util.get_node_ip_address(), content


def _collect(ray: Any, pending: dict[Any, Chunk], work: Path, e: EncodingConfig) -> list[ChunkResult]:
    """Wait for every chunk's task (the progress counts chunks, documents and tokens as chunks finish); write shards
    returned through the object store into ``work``; raise the first failure after cancelling the other tasks."""
    results: list[ChunkResult] = []
    with EncodingProgress(len(pending), e.progress) as bar:
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
                for ref in done:
                    result, shards = _result(ray, ref, pending.pop(ref), e.max_retries)
                    for name, data in (shards or {}).items():
                        (work / name).write_bytes(data)
                    results.append(result)
                    bar.add(1, result.documents_read - sum(result.dropped.values()), result.tokens_encoded)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
    return results


def _result(ray: Any, ref: Any, chunk: Chunk, retries: int) -> tuple[ChunkResult, dict[str, bytes] | None]:
    """A finished task's return value; its bad-input error as raised in the task, or its workers' deaths."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, CorpusError):
            raise exc.cause from None  # the same one-line message as the local executor's
        raise
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as exc:
        raise CorpusError(f"corpus task for {chunk_place(chunk)} failed {retries + 1} time(s), its Ray worker or node "
                          f"died ({type(exc).__name__}); nothing was published") from None


def _encode_task(config: CorpusConfig, tokenizer: TokenizerInfo, tokenizer_files: dict[str, bytes], chunk: Chunk,
                 shared_work: str | None) -> tuple[ChunkResult, dict[str, bytes] | None]:
    """A Ray task: encode one chunk with the local executor's function into a folder of its own, then move its
    shards into ``shared_work`` (renames: a worker killed mid-chunk leaves no partial shard there), or return
    them (file name → bytes) for the object store."""
    global _PREPARED
    if _PREPARED is None or _PREPARED[0] != (config, tokenizer.hash):  # set up once per worker process, not per chunk
        local = replace(tokenizer, path=str(_materialise(tokenizer, tokenizer_files)))
        _PREPARED = (config, tokenizer.hash), ChunkEncoder(config, local)
    encoder = _PREPARED[1]
    parent = Path(shared_work) if shared_work is not None else None
    attempt = Path(tempfile.mkdtemp(prefix=f".chunk-{chunk.index:06d}-", dir=parent))
    try:
        result = encoder.encode(chunk, attempt).stamp()
        if parent is None:
            return result, {f.name: f.read_bytes() for f in sorted(attempt.iterdir())}
        for file in attempt.iterdir():
            os.replace(file, parent / file.name)
        return result, None
    finally:
        shutil.rmtree(attempt, ignore_errors=True)


def _folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of a (tokenizer) folder by its relative path: a few hundred kB for the object store."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _materialise(tokenizer: TokenizerInfo, files: dict[str, bytes]) -> Path:
    """The tokenizer's files in this node's Ray session folder (removed with Ray's other files of the session),
    written once per node and named by their hash."""
    folder = _session_folder() / f"train_deploy-tokenizer-{tokenizer.hash}"
    if folder.is_dir():
        return folder
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    try:
        staging.rename(folder)
    except OSError:  # another worker of this node was first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _session_folder() -> Path:
    """This node's Ray session folder (Ray has no public call for it), else the temporary folder."""
    try:
        from ray._private.worker import global_worker

        return Path(global_worker.node.get_session_dir_path())
    except (ImportError, AttributeError):
        return Path(tempfile.gettempdir())

