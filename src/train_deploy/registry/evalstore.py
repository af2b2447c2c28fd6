"""Where a registered model keeps its evaluation set: the JSONL file is an artifact of the model's own assets run,
``eval_set.sha256`` and ``eval_set.uri`` are tags of the registered model, and every reader checks the bytes it
downloads.

The set belongs to the registered model, not to a training run that retention may delete (a first version whose
gate failed, a retired champion): the first registration stores it in a run of the same experiment named
``<model>.assets`` and tagged :data:`ASSETS_TAG` (finished at once, holding a copy of the registering run's
parameters, which the corpus check in ``train_deploy.registry.lineage`` reads). A set that still lives in a training
run (stored before this) moves there the next time it is read: copied, its hash checked, the tags pointed at the
copy. Retention keeps every run a project model's tags name (``train_deploy.retention.store``).

The gate (``train_deploy.registry.gate``) and the skip check read the set through :func:`stored_eval_set`.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException

from train_deploy.registry import evalset
from train_deploy.registry.aliases import AliasLock
from train_deploy.registry.retry import Retrying

logger = logging.getLogger(__name__)

EVAL_SET_ARTIFACT = "registry/eval_set.jsonl"
TAG_EVAL_SHA256, TAG_EVAL_URI, TAG_EVAL_TEXTS = "eval_set.sha256", "eval_set.uri", "eval_set.texts"
ASSETS_TAG = "train_deploy.registry_assets"
"""On a registered model's assets run: the model's name. Retention never plans such a run."""
_RUNS_URI = re.compile(r"^runs:/([0-9a-f]+)/")
_PARAMS_PER_CALL = 100  # MLflow's log_batch limit


@dataclass(frozen=True, slots=True)
class EvalSet:
    texts: list[str]
    sha256: str


def first_eval_set(client: MlflowClient, retry: Retrying, name: str, run_id: str,
                   build_texts: Callable[[], list[str]]) -> EvalSet:
    """The registered model's evaluation set when it has none yet: stored by this run, under the registry lock, unless
    another first registration stored one meanwhile (two machines' first runs racing), which then serves both."""
    texts = build_texts()
    with AliasLock(client, name, "store the evaluation set", retry):
        stored = retry("read the evaluation set again", lambda: stored_eval_set(client, name))
        if stored is not None:
            logger.info("Registered model %s: another run stored the evaluation set meanwhile (sha256 %s); this "
                        "version is gated on it", name, stored.sha256)
            return stored
        return retry("store the evaluation set", lambda: store_eval_set(client, name, run_id, texts))


def stored_eval_set(client: MlflowClient, name: str) -> EvalSet | None:
    """The registered model's evaluation set, checked against its recorded hash; None when it has none yet. A set
    still held by a training run moves to the model's assets run (best effort: a reader without the right to
    write, or a server error, leaves it where it is and is answered all the same)."""
    try:
        model_tags = client.get_registered_model(name).tags
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    if TAG_EVAL_SHA256 not in model_tags:
        return None
    uri, expected = model_tags.get(TAG_EVAL_URI, "(no eval_set.uri tag)"), model_tags[TAG_EVAL_SHA256]
    with tempfile.TemporaryDirectory(prefix="train_deploy-eval-") as folder:
        data = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=folder)).read_bytes()
    if (found := evalset.sha256(data)) != expected:
        raise evalset.EvalSetError(f"{uri}: the evaluation set of registered model {name} has sha256 {found}, but "
                                   f"the model records {expected} ({TAG_EVAL_SHA256}); it was changed after it was "
                                   "stored, so no candidate can be compared with the champion")
    held_by = eval_set_run_id(model_tags)
    if held_by and client.get_run(held_by).data.tags.get(ASSETS_TAG) != name:
        try:
            _write_set(client, name, held_by, data)
            logger.info("Registered model %s: evaluation set moved from run %s to the model's assets run", name,
                        held_by)
        except (MlflowException, OSError) as exc:  # no right to write (a read-only account), a store refusing
            logger.warning("Registered model %s: the evaluation set stays in run %s for now (moving it to the "
                           "model's assets run failed: %s)", name, held_by, str(exc).splitlines()[0][:300])
    return EvalSet(texts=evalset.from_jsonl(data, uri), sha256=expected)


def store_eval_set(client: MlflowClient, name: str, run_id: str, texts: list[str]) -> EvalSet:
    """Store ``texts`` as the registered model's set: ``registry/eval_set.jsonl`` of its assets run (made in the
    experiment of ``run_id``, the registering run), and the model's tags."""
    data = evalset.to_jsonl(texts)
    digest = _write_set(client, name, run_id, data)
    logger.info("Registered model %s: evaluation set of %d texts stored (sha256 %s)", name, len(texts), digest)
    return EvalSet(texts=list(texts), sha256=digest)


def eval_set_run_id(model_tags: dict[str, str]) -> str | None:
    """The run that holds the set a registered model's tags name (``eval_set.uri``), or None."""
    found = _RUNS_URI.match(model_tags.get(TAG_EVAL_URI, ""))
    return found.group(1) if found else None


def assets_run(client: MlflowClient, name: str, experiment_id: str) -> str:
    """The id of registered model ``name``'s assets run in ``experiment_id``: the one found, else a new one."""
    runs = client.search_runs([experiment_id], f"tags.`{ASSETS_TAG}` = '{name}'", max_results=1,
                              order_by=["attributes.start_time ASC"])
    if runs:
        return runs[0].info.run_id
    run = client.create_run(experiment_id, tags={ASSETS_TAG: name}, run_name=f"{name}.assets")
    client.set_terminated(run.info.run_id, "FINISHED")  # a finished run: never taken for a failed night
    return run.info.run_id


def _write_set(client: MlflowClient, name: str, source_run: str, data: bytes) -> str:
    """Log ``data`` to the model's assets run (in ``source_run``'s experiment, with its parameters), then point the
    model's tags at it; return its sha256."""
    source = client.get_run(source_run)
    owner = assets_run(client, name, source.info.experiment_id)
    params = [Param(key, value) for key, value in sorted(source.data.params.items())
              if key not in client.get_run(owner).data.params]
    for first in range(0, len(params), _PARAMS_PER_CALL):
        client.log_batch(owner, params=params[first:first + _PARAMS_PER_CALL])
    with tempfile.TemporaryDirectory(prefix="train_deploy-eval-") as folder:
        path = Path(folder) / Path(EVAL_SET_ARTIFACT).name
        path.write_bytes(data)
        client.log_artifact(owner, str(path), str(Path(EVAL_SET_ARTIFACT).parent))
    digest = evalset.sha256(data)
    texts = len(data.splitlines())
    for key, value in ((TAG_EVAL_URI, f"runs:/{owner}/{EVAL_SET_ARTIFACT}"), (TAG_EVAL_TEXTS, str(texts)),
                       (TAG_EVAL_SHA256, digest)):  # the hash last: it is what says the model has a set
        client.set_registered_model_tag(name, key, value)
    return digest
