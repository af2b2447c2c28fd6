"""Where a registered model keeps its evaluation set: the JSONL file is an MLflow artifact, ``eval_set.sha256``
and ``eval_set.uri`` are tags of the registered model, and every reader checks the bytes it downloads.

The gate (``train_deploy.registry.gate``) and the skip check read the set through :func:`stored_eval_set`.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.registry import evalset
from train_deploy.registry.aliases import AliasLock
from train_deploy.registry.retry import Retrying

logger = logging.getLogger(__name__)

EVAL_SET_ARTIFACT = "registry/eval_set.jsonl"
TAG_EVAL_SHA256, TAG_EVAL_URI, TAG_EVAL_TEXTS = "eval_set.sha256", "eval_set.uri", "eval_set.texts"


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
    """The registered model's evaluation set, checked against its recorded hash; None when it has none yet."""
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
    return EvalSet(texts=evalset.from_jsonl(data, uri), sha256=expected)


def store_eval_set(client: MlflowClient, name: str, run_id: str, texts: list[str]) -> EvalSet:
    """Log ``texts`` as the run's ``registry/eval_set.jsonl`` and make it the registered model's set (tags)."""
    data = evalset.to_jsonl(texts)
    with tempfile.TemporaryDirectory(prefix="train_deploy-eval-") as folder:
        path = Path(folder) / Path(EVAL_SET_ARTIFACT).name
        path.write_bytes(data)
        client.log_artifact(run_id, str(path), str(Path(EVAL_SET_ARTIFACT).parent))
    digest = evalset.sha256(data)
    for key, value in ((TAG_EVAL_URI, f"runs:/{run_id}/{EVAL_SET_ARTIFACT}"), (TAG_EVAL_TEXTS, str(len(texts))),
                       (TAG_EVAL_SHA256, digest)):  # the hash last: it is what says the model has a set
        client.set_registered_model_tag(name, key, value)
    logger.info("Registered model %s: evaluation set of %d texts stored (sha256 %s)", name, len(texts), digest)
    return EvalSet(texts=list(texts), sha256=digest)
