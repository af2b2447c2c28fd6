"""Change detection for scheduled retraining: train only when the corpus or the training changed since the champion.

Before any heavy work, a run of the whole chain (one that trains and registers) fingerprints what it would train
on and how:

- ``retrain.corpus_fingerprint``: the corpus inputs' contents with the reading, cleaning, tokenizer and split
  settings (a loaded tokenizer by its files) — what the token files are made from, known before tokenizing;
- ``retrain.training_identity``: what determines the weights besides the data
  (:meth:`~train_deploy.training.config.TrainingConfig.identity`).

Both are tags of the run and of the version it registers. When they equal the champion's there is nothing to retrain:
the run's owner (``hooks.life.RunLife``, with ``hooks.runs.skip_if_unchanged``) records the run as skipped
(``outcome=skipped`` and the reason) and stops it with :class:`NothingToRetrain` before the first node, having read the
inputs once; ``kedro run`` reports it as a success (``train_deploy.cli``). ``retrain.force: true`` trains anyway. A
version trained alike counts only when the gate decided on it (:func:`trained_alike`), and an alias move a killed run
left half done is completed before the champion is read (``train_deploy.registry.aliases``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlflow import MlflowClient

from train_deploy.config import block, from_mapping
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.fingerprints import source_fingerprint
from train_deploy.corpus.readers import plan_corpus
from train_deploy.hashing import digest
from train_deploy.registry.aliases import repair_interrupted
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.gate import DECIDED, DECISION_TAG
from train_deploy.registry.history import CHAMPION, alias_version
from train_deploy.registry.retry import Retrying
from train_deploy.training.config import TrainingConfig
from train_deploy.training.pretrained import init_identity

CORPUS_TAG, TRAINING_TAG = "retrain.corpus_fingerprint", "retrain.training_identity"
REASON_TAG, OUTCOME_TAG = "retrain.reason", "outcome"
# The nodes of a run that trains and registers: only such a run compares itself with the champion.
CHECKED_NODES = frozenset({"train_model", "register_bundle"})


@block
class RetrainConfig:
    """The ``retrain`` parameter block: when a run of the whole chain trains."""

    force: bool = False
    """Train even when the corpus and the training configuration are those of the champion."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RetrainConfig:
        return from_mapping(cls, params, "retrain")


class NothingToRetrain(Exception):  # noqa: N818 (an outcome, not an error: ``kedro run`` exits 0 with it)
    """The run was stopped before its first node because nothing changed since the champion; the message says so."""


@dataclass(frozen=True, slots=True)
class RetrainCheck:
    """Whether to train, why, and the fingerprints the run is recorded with."""

    retrain: bool
    reason: str
    fingerprints: dict[str, str]


def check_for_changes(params: dict[str, Any]) -> RetrainCheck:
    """Compare the run's fingerprints (from its ``params``) with the champion's in the registry MLflow points at."""
    fingerprints = current_fingerprints(params)
    if RetrainConfig.from_params(params.get("retrain")).force:
        return RetrainCheck(True, "retrain.force is true", fingerprints)
    registry = RegistryConfig.from_params(params.get("registry"))
    client = MlflowClient()
    retry = Retrying(registry.retries, client.tracking_uri)
    repair_interrupted(client, registry.model_name, retry)  # a run killed mid-move: complete it before reading
    champion = retry("find the champion", lambda: alias_version(client, registry.model_name, CHAMPION))
    if champion is None:
        return RetrainCheck(True, f"{registry.model_name} has no champion yet", fingerprints)
    recorded = retry("read the champion's tags",
                     lambda: client.get_model_version(registry.model_name, champion).tags)
    retrain, reason = compare(fingerprints, recorded, f"champion version {champion}", registry.model_name)
    if retrain:  # a version already trained alike and not champion (the gate kept the champion, or a rollback)
        tried = retry("find versions trained alike", lambda: trained_alike(client, registry.model_name, fingerprints))
        if tried is not None:
            return RetrainCheck(False, (
                f"nothing to retrain: version {tried.version} was trained on this corpus with this configuration "
                f"and is not champion (gate: {tried.tags.get('gate.decision', 'unknown')}); champion is version "
                f"{champion} (retrain.force: true trains anyway)"), fingerprints)
    return RetrainCheck(retrain, reason, fingerprints)


def trained_alike(client: MlflowClient, model_name: str, fingerprints: dict[str, str]):
    """The newest version of ``model_name`` recorded with these ``fingerprints`` and a gate decision, or None.

    A version the gate never decided on (its process killed after registering it, a champion that could not be
    scored, the tracking server gone while scoring: tagged ``gate.decision: failed``, or not tagged at all) does
    not count, so the next run trains and gates again."""
    where = " and ".join(f"tags.`{tag}` = '{value}'" for tag, value in sorted(fingerprints.items()))
    found = client.search_model_versions(f"name = '{model_name}' and {where}")
    return max((v for v in found if v.tags.get(DECISION_TAG) in DECIDED), key=lambda v: int(v.version), default=None)


def compare(current: dict[str, str], recorded: dict[str, str], champion: str,
            model_name: str | None = None) -> tuple[bool, str]:
    """(retrain, reason) for the ``current`` fingerprints against those ``recorded`` on the ``champion``; a skip
    names the registered model ``model_name`` too (a project may train several)."""
    if not {CORPUS_TAG, TRAINING_TAG} <= recorded.keys():
        return True, f"{champion} records no fingerprints (registered before change detection)"
    changed = [what for tag, what in ((CORPUS_TAG, "the corpus (inputs, reading, cleaning, tokenizer or split)"),
                                      (TRAINING_TAG, "the training configuration"))
               if recorded[tag] != current[tag]]
    if changed:
        return True, f"{' and '.join(changed)} changed since {champion}"
    of_model = f" of {model_name}" if model_name else ""
    return False, (f"nothing to retrain: the corpus and the training configuration are those of {champion}{of_model} "
                   "(retrain.force: true trains anyway)")


def run_fingerprints(run_id: str) -> dict[str, str]:
    """The fingerprints the check recorded on MLflow run ``run_id`` (none when the run was not checked)."""
    tags = MlflowClient().get_run(run_id).data.tags
    return {tag: tags[tag] for tag in (CORPUS_TAG, TRAINING_TAG) if tag in tags}


def current_fingerprints(params: dict[str, Any]) -> dict[str, str]:
    """The run's fingerprints; reads every corpus input once, and the corpus stage's plan of the same unchanged
    inputs in this process is then a lookup (:func:`~train_deploy.corpus.readers.plan_corpus`). The training
    block is validated here as the corpus stage's configure node validates it (that node is only the seam between
    the catalog and :class:`~train_deploy.training.config.TrainingConfig`; importing it would be an import up)."""
    corpus = CorpusConfig.from_params(params.get("corpus"))
    training = TrainingConfig.from_params(params.get("training"))
    return {CORPUS_TAG: source_fingerprint(corpus, plan_corpus(corpus.reader)),
            TRAINING_TAG: digest(training.identity(init_identity(training.init_from)))}
