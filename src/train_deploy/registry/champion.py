"""``training.init_from`` resolved: scratch, a model folder, or the registered champion's ``pretrained/`` folder
downloaded from the MLflow registry; and what the weights start from, recorded on the MLflow run.

This is the registry's side of a warm start: ``train_deploy.training.pretrained`` reads and checks a model folder
and knows nothing of MLflow; here the champion is found, its tokenizer configuration compared with this run's,
its bundle's ``pretrained/`` downloaded once into the init cache, and the start logged.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from train_deploy.handoffs import InitSource
from train_deploy.training.pretrained import (
    CHAMPION,
    CONFIG_FILE,
    SCRATCH,
    TOKENIZER_TAG,
    folder_source,
    tokenizer_config_fingerprint,
)

logger = logging.getLogger(__name__)


def resolve_init_source(init_from: str, corpus_config, registry, cache: Path) -> InitSource:
    """Where this run's weights and tokenizer come from: nothing (scratch), a model folder, or the champion's
    ``pretrained/`` downloaded into ``cache`` (``registry``: the ``RegistryConfig`` naming the model and how often
    to try the tracking server); the champion falls back to scratch, with the reason, when there is none or its
    tokenizer configuration differs."""
    fingerprint = tokenizer_config_fingerprint(corpus_config)
    if init_from == SCRATCH:
        return InitSource(requested=init_from, tokenizer_config_fingerprint=fingerprint)
    if init_from == CHAMPION:
        folder, version, reason = champion_folder(registry, fingerprint, Path(cache))
        if folder is None:  # record_init_source says so in the log and on the run
            return InitSource(requested=init_from, reason=reason, tokenizer_config_fingerprint=fingerprint)
        source = folder_source(folder, init_from, fingerprint, Path(cache))
        source.champion_version = version
        return source
    return folder_source(Path(init_from).expanduser().resolve(), init_from, fingerprint, Path(cache))


def champion_folder(registry, fingerprint: str, cache: Path) -> tuple[Path | None, str, str]:
    """The champion version's ``pretrained/`` folder, downloaded once into ``cache``, and its version; or None
    and why the run starts from scratch."""
    import mlflow
    from mlflow import MlflowClient

    from train_deploy.registry.history import CHAMPION as ALIAS
    from train_deploy.registry.history import alias_version
    from train_deploy.registry.retry import Retrying

    client, model_name = MlflowClient(), registry.model_name
    retry = Retrying(registry.retries, client.tracking_uri)
    version = retry("find the champion", lambda: alias_version(client, model_name, ALIAS))
    if version is None:
        return None, "", f"registered model {model_name} has no {ALIAS} yet"
    tags = retry("read the champion's tags", lambda: client.get_model_version(model_name, version).tags)
    if tags.get(TOKENIZER_TAG) != fingerprint:
        return None, version, (f"the tokenizer configuration (corpus.cleaning and corpus.tokenizer) is not the one "
                               f"{ALIAS} version {version} was trained with ({TOKENIZER_TAG} "
                               f"{tags.get(TOKENIZER_TAG, 'missing')}, this run {fingerprint})")
    target = cache / "champion" / f"{model_name}-v{version}"
    if not (target / CONFIG_FILE).is_file():
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            downloaded = mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{version}/artifacts/bundle/pretrained", dst_path=str(staging))
        except mlflow.exceptions.MlflowException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            return None, version, (f"{ALIAS} version {version}'s bundle has no pretrained/ folder (exported before "
                                   f"train_deploy wrote one?): {exc.message.splitlines()[0]}")
        shutil.rmtree(target, ignore_errors=True)
        Path(downloaded).rename(target)
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("Downloaded %s version %s's pretrained/ into %s", model_name, version, target)
    return target, version, ""


def record_init_source(source: InitSource) -> None:
    """What the weights start from, on the active MLflow run if any (the corpus and the training stage both record
    it, so either run alone has it): params ``init_from`` (as configured) and ``init_from.hash``,
    tags ``init_from`` (scratch, champion or folder) and, when a champion start fell back to scratch, the reason."""
    import mlflow

    if source.reason:
        logger.warning("training.init_from: %s: starting from scratch: %s", source.requested, source.reason)
    if mlflow.active_run() is None:
        return
    mlflow.log_params({"init_from": source.requested, "init_from.hash": source.hash or "none"})
    tags = {"init_from": source.started_from}
    tags |= {"init_from.reason": source.reason} if source.reason else {}
    tags |= {"init_from.champion_version": source.champion_version} if source.champion_version else {}
    mlflow.set_tags(tags)
