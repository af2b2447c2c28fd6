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
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from train_deploy.config import CONFIG, ConfigError, check, check_range
from train_deploy.redaction import redact_uri

logger = logging.getLogger(__name__)

SCHEME = "etcd://"
LAUNCHER_ENVIRONMENT = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
"""Set only in the elastic launcher's environment: ``etcd3`` 0.12 (the client Paddle's ``ETCDMaster`` imports)
ships protobuf code generated before protobuf 4, which the installed protobuf's C implementation refuses to load."""
FORMATIONS_FILE = "elastic_formations.jsonl"
"""Rank 0's record of each formation (time, world size, step resumed from), one JSON object per line, in the
run's log folder."""
REACH_TIMEOUT_S = 5.0


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
