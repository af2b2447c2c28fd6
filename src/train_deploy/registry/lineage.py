"""Which corpus a registered model's evaluation set comes from, checked before a run gates on it.

The gate compares a candidate with the champion on the registered model's evaluation set, made by its first
registration from that run's validation split (``train_deploy.registry.gate``). A run on another corpus (another
``corpus.reader.source`` or ``paths``; the same paths holding more text are the same corpus) would be judged on
someone else's texts: :func:`check_same_corpus` refuses it before its first node unless ``registry.other_corpus``
is ``compare``, and then says in one line why it compares across corpora. The corpus of the set is read from the
parameters of the run that stored it (the run ``eval_set.uri`` names), so models registered before this check
are covered too. A set made from ``registry.eval_set.path`` belongs to no corpus and is never refused.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from train_deploy.config import ConfigError
from train_deploy.registry.config import RegistryConfig

logger = logging.getLogger(__name__)

_RUNS_URI = re.compile(r"^runs:/([0-9a-f]+)/")
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.\-]+")


def corpus_identity(corpus: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    """``(corpus.reader.source, corpus.reader.paths)`` of a ``corpus`` parameter block (defaults when absent)."""
    from train_deploy.corpus.config import ReaderConfig

    reader = (corpus or {}).get("reader") or {}
    default = ReaderConfig()
    return str(reader.get("source", default.source)), [str(path) for path in reader.get("paths") or []]


def described(identity: tuple[str, list[str]]) -> str:
    source, paths = identity
    return f"{source} {paths}" if paths else f"{source} (its built-in corpus)"


def suggested_name(identity: tuple[str, list[str]]) -> str:
    """A registered-model name for a corpus: the last part of its first path without globs and suffixes, ``_lm``."""
    source, paths = identity
    parts = [part for part in PurePath(paths[0]).parts if not set("*?[") & set(part)] if paths else []
    stem = PurePath(parts[-1]).name.split(".")[0] if parts else source
    return f"{_NOT_A_NAME.sub('_', stem).strip('_.-') or source}_lm"


def eval_set_corpus(client, model_name: str) -> tuple[str, list[str]] | None:
    """The corpus the registered model's evaluation set was made from, from the parameters of the run that stored
    it; None when the model has no set yet, its set came from ``registry.eval_set.path``, or that run is gone."""
    from mlflow.exceptions import MlflowException

    try:
        uri = client.get_registered_model(model_name).tags.get("eval_set.uri", "")
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    found = _RUNS_URI.match(uri)
    if not found:
        return None
    try:
        params = client.get_run(found.group(1)).data.params
    except MlflowException:
        return None
    if params.get("registry.eval_set.path", "None") not in ("None", "", "null") or "corpus.reader.source" not in params:
        return None
    try:
        paths = ast.literal_eval(params.get("corpus.reader.paths", "[]"))
    except (ValueError, SyntaxError):
        paths = [params["corpus.reader.paths"]]
    return params["corpus.reader.source"], [str(path) for path in paths]


def check_same_corpus(client, config: RegistryConfig, corpus: Mapping[str, Any] | None) -> None:
    """Refuse (:class:`ConfigError` naming ``registry.model_name``) a run whose corpus is not the one the model's
    evaluation set was made from; with ``registry.other_corpus: compare`` warn in one line instead."""
    ours, theirs = corpus_identity(corpus), eval_set_corpus(client, config.model_name)
    if theirs is None or theirs == ours:
        return
    what = (f"registered model {config.model_name}'s evaluation set was made from corpus {described(theirs)}, this "
            f"run reads {described(ours)}")
    if config.other_corpus == "compare":
        logger.warning("%s: the gate compares across corpora on that set because registry.other_corpus is compare",
                       what)
        return
    raise ConfigError(f"registry.model_name: {what}, and would be gated on the other corpus's texts; name a model "
                      f"of its own (--params registry.model_name={suggested_name(ours)}), or set "
                      "registry.other_corpus: compare to gate on that set anyway")


def warm_start_run_tags() -> dict[str, str]:
    """The active run's ``init_from`` tags (``init_from``, ``init_from.champion_version``, ``init_from.reason``, set
    by ``training.pretrained.record_init_source``), for the version it registers; empty outside a run."""
    import mlflow

    run = mlflow.active_run()
    tags = mlflow.MlflowClient().get_run(run.info.run_id).data.tags if run else {}
    return {key: value for key, value in tags.items() if key == "init_from" or key.startswith("init_from.")}
