"""Elastic training on Paddle's own machinery: ``training.launch.elastic`` and what the launch and the worker need.

With it every node runs::

    python -m paddle.distributed.launch --master etcd://HOST:PORT --nnodes MIN:MAX --elastic_level 1
        --elastic_timeout T --nproc_per_node G --job_id J ... worker.py --run run.json

Paddle's ``CollectiveElasticController`` (``paddle/distributed/launch/controllers/collective.py``) registers each
node's heartbeat in etcd under a lease of 10 s (``ETCDMaster.register_heartbeat``, ``controllers/master.py``). A
node that dies stops refreshing its lease; when the key expires every other node's launcher stops its workers
and forms the job again from the nodes alive after ``timeout_s`` quiet seconds (``wait_peer_ready``), at least
``min_nodes``; a node that joins rewrites the job's keys, which makes every launcher re-form with it. The
workers start afresh at the new world size and resume from the newest complete checkpoint (``resume: auto``),
with the global batch kept by gradient accumulation (docs/training.md says why).

Each formation after the first is a re-form: rank 0 records it (:func:`record_formation`) in the log and as
``elastic_*`` metrics at the step it resumed from, which the training node sends to the MLflow run.

The launcher's training script is this module (:func:`main`), which runs ``worker.py`` as its child and, when the
worker fails, stays alive up to :data:`HOLD_S` seconds before failing with it: Paddle's launcher must learn of a
lost node from etcd (the node's lease expiring), not from its own worker's failure, or a second survivor ends
with "peer not ready" (:func:`hold_failed_worker` says why; docs/training.md shows the log lines).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from train_deploy.config import CONFIG, ConfigError, check, check_range
from train_deploy.redaction import redact_uri
from train_deploy.run_control.processes import stop_process_tree

logger = logging.getLogger(__name__)

SCHEME = "etcd://"
LAUNCHER_ENVIRONMENT = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "GRPC_ENABLE_FORK_SUPPORT": "0"}
"""Set only in the elastic launcher's environment (the workers inherit it). ``etcd3`` 0.12 (the client Paddle's
``ETCDMaster`` imports) ships protobuf code generated before protobuf 4, which the installed protobuf's C
implementation refuses to load. And the launcher forks each worker while etcd3's gRPC threads (heartbeat, watch)
are busy: with gRPC's fork handlers on, some children die before they run ("Other threads are currently calling
into gRPC, skipping fork() handlers", then "epoll_wait error: Bad file descriptor"; 2-3 of 60 forks measured here),
and the launcher takes that for a failed worker."""
FORMATIONS_FILE = "elastic_formations.jsonl"
"""Rank 0's record of each formation (time, world size, step resumed from), one JSON object per line, in the
run's log folder."""
REACH_TIMEOUT_S = 5.0
LEASE_S = 10
"""Paddle's heartbeat lease (``ETCDMaster.register_heartbeat(ttl=10)``, refreshed every 5 s): a killed node's key
expires 5-10 s after its last refresh."""
HOLD_S = 6.0 * LEASE_S
"""How long a failed worker's process stays alive before failing (:func:`hold_failed_worker`): six leases, so
that the lost node's key has expired and every launcher has seen it (its watch polls every 2 s) even on a loaded
machine. What it costs: a worker that fails on its own (a bug, out of memory) is reported a minute later."""
STOP_GRACE_S = 20.0
"""After the launcher's SIGTERM, how long the worker may take to end before SIGKILL (Paddle's launcher waits 30 s)."""


# A pydantic dataclass like every configuration block (``train_deploy.config.CONFIG``, frozen besides): each key's
# range is a field constraint, in the schema the reference and the probes read; the invariants across blocks are
# checked by :func:`check_layout`, with the one-line errors of the other keys.
@dataclass(config=ConfigDict(CONFIG, frozen=True), kw_only=True)
class ElasticConfig:
    """``training.launch.elastic``: the job goes on when nodes leave or join (null = off)."""

    min_nodes: int = Field(1, ge=1)
    """The fewest nodes the job trains on; below it the launchers wait ``timeout_s`` and then fail."""
    max_nodes: int = Field(2, ge=1)
    """The most nodes the job takes in; a further node waits outside."""
    etcd: str = "etcd://127.0.0.1:2379"
    """The etcd every node reaches, ``etcd://HOST:PORT`` (Paddle's launcher takes no credentials or TLS)."""
    timeout_s: int = Field(30, ge=1)
    """Seconds without a node leaving or joining before the launchers (re-)form the job (``--elastic_timeout``)."""


def launcher_arguments(elastic: ElasticConfig) -> list[str]:
    """Paddle's launcher arguments of elastic mode; no ``--rank``: etcd orders the nodes at each formation."""
    return ["--master", elastic.etcd, "--nnodes", f"{elastic.min_nodes}:{elastic.max_nodes}",
            "--elastic_level", "1", "--elastic_timeout", str(elastic.timeout_s)]


def world_sizes(elastic: ElasticConfig, nproc_per_node: int) -> list[int]:
    """Every world size the job may form at."""
    return [nodes * nproc_per_node for nodes in range(elastic.min_nodes, elastic.max_nodes + 1)]


def check_layout(elastic: ElasticConfig, *, pp: int, mp: int, dp: int, nproc_per_node: int, nnodes: int) -> None:
    """Refuse, in one line naming the key, an elastic job that cannot survive a lost node."""
    key = "training.launch.elastic"
    check_range(f"{key}.min_nodes", elastic.min_nodes, 1)
    check(elastic.max_nodes >= elastic.min_nodes, f"{key}.max_nodes",
          f"{elastic.max_nodes} is below min_nodes = {elastic.min_nodes}; raise it or lower min_nodes")
    check_range(f"{key}.timeout_s", elastic.timeout_s, 1)
    check(pp == 1, "training.parallel.pp", f"elastic training cannot run pipeline parallel (pp = {pp}): a lost "
          "node takes whole stages with it; set pp: 1 or training.launch.elastic: null")
    check(mp <= nproc_per_node, "training.parallel.mp",
          f"mp = {mp} spans nodes (launch.nproc_per_node = {nproc_per_node}); elastic training needs model "
          "parallel within a node, since a lost node takes shards of every layer with it")
    check(dp == -1, "training.parallel.dp", f"is fixed at {dp}, but elastic training changes the data-parallel "
          "degree with the nodes; set dp: -1 (inferred)")
    check(nnodes == 1, "training.launch.nnodes", f"is {nnodes}, but with elastic the nodes come and go between "
          "min_nodes and max_nodes; leave nnodes at 1")


def check_reachable(url: str, timeout: float = REACH_TIMEOUT_S) -> None:
    """Refuse an etcd URL that is not ``etcd://HOST:PORT`` or that nothing answers at; the error shows the URL
    without credentials."""
    shown = redact_uri(url)
    address = url.removeprefix(SCHEME)
    host, _, port = address.rpartition(":")
    if not url.startswith(SCHEME) or not host or "@" in address or "/" in address or not port.isdigit():
        raise ConfigError(f"training.launch.elastic.etcd: {shown} is not etcd://HOST:PORT (Paddle's launcher takes "
                          "no credentials, path or TLS)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"training.launch.elastic.etcd: cannot reach {shown} ({reason}); start etcd there or "
                          "correct the URL") from None


def record_formation(logs: Path, world_size: int, step: int, now: float | None = None) -> dict[str, float] | None:
    """Append this formation to ``logs/elastic_formations.jsonl``; return the re-form event as metrics (at
    ``step``) when a formation came before it, else None. Rank 0 calls it once per start of its workers."""
    path = Path(logs) / FORMATIONS_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    previous = json.loads(lines[-1]) if lines else None
    formation = {"time": time.time() if now is None else now, "world_size": world_size, "step": step}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(formation) + "\n")
    if previous is None:
        return None
    logger.info("Elastic re-form %d: world size %d -> %d, resumed from step %d", len(lines), previous["world_size"],
                world_size, step)
    return {"elastic_reform": float(len(lines)), "elastic_previous_world_size": float(previous["world_size"]),
            "elastic_world_size": float(world_size), "elastic_reform_time": formation["time"]}


def hold_failed_worker(command: list[str], hold_s: float = HOLD_S) -> int:
    """Run the worker ``command`` and return its exit status; when it fails, first stay alive up to ``hold_s``
    seconds, ended early (with the worker) by the launcher's SIGTERM.

    Why: a lost node makes every other worker abort at once (gloo: "Connection reset by peer"). A launcher that sees
    its own worker fail sets its status to FAILED and deletes every node's heartbeat key (Paddle 3.3.1
    ``controller.py`` ``watch``, ``master.py`` ``restart_peer``). Only an etcd event on those keys turns FAILED into
    RESTARTING; the second survivor's deletion finds no key left, so no event comes, and ``wait_peer_ready``, whose
    loop runs only while the status is not done, counts the live heartbeats at once (none: they were just deleted),
    logs "peer not ready" and ends the launcher; its heartbeat thread, which also stops on FAILED, may already be
    gone. With the worker held alive the launcher sees no failure: the lost node's lease expires, every survivor
    gets that event (RESTARTING), stops its worker and re-forms from the heartbeats alive."""
    worker = subprocess.Popen(command)  # in the launcher's process group: its SIGTERM reaches both

    def stop(signum: int, frame: FrameType | None) -> None:
        stop_process_tree(worker, STOP_GRACE_S)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        code = worker.wait()
        if code != 0:
            logger.warning("The worker ended with status %d; holding up to %.0f s so that the launcher re-forms the "
                           "job if a node was lost", code, hold_s)
            time.sleep(hold_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 128 - code if code < 0 else code  # a signal's death as a shell shows it (SIGABRT: 134)


def main(argv: list[str] | None = None) -> None:
    """``python elastic.py WORKER.py ARGS...``: the elastic launcher's training script (:func:`hold_failed_worker`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s elastic %(levelname)s %(message)s", stream=sys.stdout)
    sys.exit(hold_failed_worker([sys.executable, "-u", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
