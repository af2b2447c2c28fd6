"""The promotion gate: a bundle becomes a new version of the registered model, and ``champion`` only when better.

:func:`register_and_gate` runs inside the MLflow run that produced the bundle:

1. log the bundle as an MLflow model (:func:`train_deploy.registry.model.log_bundle_model`) and register it as a
   new version, tagged with where it comes from (:func:`version_tags`);
2. take the registered model's evaluation set (the first registration stores one, see
   ``train_deploy.registry.evalstore``: the JSONL file is an artifact of the model's own assets run, not of a
   training run retention may delete, ``eval_set.sha256`` and
   ``eval_set.uri`` are tags of the registered model, and every later run checks the bytes it downloads);
3. score the new version and the ``champion`` in this process on that set, text by text, in nats per character
   (``-Σ log p / Σ chars``: models with different tokenizers compare fairly), and compare them pairwise with a
   bootstrap interval of the improvement (``train_deploy.registry.paired``); the rules of
   ``train_deploy.registry.rules`` decide: never a champion worse than the unigram (or ``registry.require_beats``'
   baseline) on its validation windows, ``undecided`` on a set too small or an interval across
   ``registry.min_improvement``. A champion that cannot be scored
   (its files gone or damaged) fails the gate, unless ``registry.force`` promotes without a comparison;
   A candidate the rules would promote is then served as production serves it (``registry.serving_check``,
   ``train_deploy.registry.infra``: ``mlflow models serve`` of the version in a fresh process, one score and one
   generate request within a time limit); when that fails it is rejected, the reason on the version
   (``gate.serving_check``), and the champion stays;
4. take the model's registry lock (``train_deploy.registry.aliases``, which says why a lock and what window is
   left), complete any alias move an interrupted run recorded, and read ``champion`` again: when it changed since
   step 3 (another gate or a rollback in between), score the new champion on the same set and decide again;
5. decide (:func:`decide`), tag the version with the decision (``gate.*``) and append it to the model's history
   (``train_deploy.registry.history``); for a promotion, as the first steps of a recorded alias move;
6. last, move the aliases in the recorded order: ``previous`` to the old champion, then ``champion`` to the new
   version. Anything that fails before the move is recorded leaves the aliases as they were; a kill after it is
   completed by the next mover.

A version whose gate failed before step 5 is tagged ``gate.decision: failed`` (best effort: a killed process tags
nothing), and only versions with a decision (:data:`DECIDED`) count as "trained alike" for scheduled retraining
(``train_deploy.run_control.retrain``), so an ungated version never stops the next run from training and gating.

Concurrency: MLflow has no compare-and-set on aliases, so re-reading the champion before moving would only narrow
the race between two gates (or a gate and a rollback) to two calls. Steps 4 to 6 therefore run under a lock made
of MLflow's one atomic create-if-absent, a registered model's name (``<model>.aliases-lock``): two gates started
together score in parallel, then decide and move one after the other, the second against the first's result; a
rollback made meanwhile is compared against, never undone. What remains open (a holder stalled past the 600 s
lease, two processes breaking one stale lock at once, clock skew, aliases set by hand) is listed in
``train_deploy.registry.aliases``.

Every call to the tracking server goes through :class:`~train_deploy.registry.retry.Retrying`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from pydantic import with_config

from train_deploy.handoffs import DESCRIPTION, Bundle, TokenManifest, TrainingResult
from train_deploy.redaction import one_line as redacted_one_line
from train_deploy.registry.aliases import AliasLock, Move
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.evalstore import EvalSet, first_eval_set, stored_eval_set
from train_deploy.registry.history import CHAMPION, alias_version, event_key, record_event
from train_deploy.registry.infra import ServingCheckFailed, check_serving
from train_deploy.registry.paired import TextScores
from train_deploy.registry.retry import RegistryUnreachable, Retrying
from train_deploy.registry.rules import DECIDED, PROMOTING, BaselineCheck, Decision, Verdict, check_baselines, decide
from train_deploy.training.pretrained import TOKENIZER_TAG

logger = logging.getLogger(__name__)

METRIC = "nats_per_char"
_SCORE_CHUNK = 8  # texts per predict call: within any model's max_batch worth setting

__all__ = ["DECIDED", "DECISION_TAG", "FAILED", "PROMOTING", "SERVING_TAG", "Decision", "GateError",
           "RegistryDecision", "decide", "register_and_gate"]
DECISION_TAG, FAILED = "gate.decision", "failed"
SERVING_TAG = "gate.serving_check"
"""The serving check's outcome on the version: ``passed: …`` or ``failed: …`` (see ``registry/infra.py``)."""


class GateError(RuntimeError):
    """The gate cannot compare the candidate with the champion; the message names the version and why."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class RegistryDecision:
    """What the registry stage did with a bundle (``data/08_reporting/registry_decision.json``)."""

    model_name: str
    version: str
    """The version this run registered."""
    run_id: str
    """The MLflow run the version's model was logged to."""
    decision: Decision
    """``first`` (no champion yet), ``promoted``, ``rejected``, ``undecided`` (the set cannot tell them apart: the
    champion stays) or ``forced`` (``registry.force``); see ``train_deploy.registry.rules``."""
    reason: str
    """A sentence with the numbers it was decided on."""
    champion: bool
    """Whether the version holds ``champion`` now."""
    previous_champion: str | None
    """The version that held ``champion`` before (``previous`` now if this version was promoted)."""
    metric: str
    candidate_value: float
    champion_value: float | None
    eval_set_sha256: str
    eval_texts: int
    """The evaluation set's size (texts)."""
    decided_at: str
    improvement: float | None = None
    """The relative improvement in nats per character over the champion (0.01 = 1% fewer); None without one."""
    interval: list[float] | None = None
    """Its paired bootstrap interval ``[low, high]`` at ``confidence`` (``train_deploy.registry.paired``)."""
    confidence: float | None = None
    val_loss: float | None = None
    """The candidate's validation loss (nats/token) the baseline rule compared; None when the bundle has none."""
    baseline: str | None = None
    """The n-gram baseline it was held to (``unigram``, ``add-k bigram``, ``Kneser-Ney bigram``)."""
    baseline_loss: float | None = None
    """That baseline's loss on the same windows."""


def register_and_gate(bundle: Bundle, config: RegistryConfig, tags: dict[str, str],
                      build_texts: Callable[[], list[str]]) -> RegistryDecision:
    """Register ``bundle`` as a new version of ``config.model_name`` in the active run and gate it (see the module).

    ``build_texts`` makes the evaluation set when the registered model has none yet.
    """
    from train_deploy.registry.model import log_bundle_model

    run = mlflow.active_run()
    if run is None:
        raise MlflowException("register_and_gate needs an active MLflow run (kedro-mlflow opens one per kedro run)")
    client, name, run_id = MlflowClient(), config.model_name, run.info.run_id
    retry = Retrying(config.retries, mlflow.get_tracking_uri())
    baseline = check_baselines(bundle, config.require_beats)
    stored = retry("read the evaluation set", lambda: stored_eval_set(client, name))
    info = retry("log the model", lambda: log_bundle_model(Path(bundle.path), max_batch=config.max_batch,
                                                           serving=config.serving))
    version = register_version(client, retry, name, info.model_uri, {**tags, "source.run_id": run_id}, run_id)
    try:
        if stored is None:
            stored = first_eval_set(client, retry, name, run_id, build_texts)
        result = gate_version(client, retry, config, version, run_id, stored, baseline)
    except BaseException as exc:  # a SIGTERM too: the version must not look gated
        mark_failed(client, retry, name, version, exc)
        raise
    logger.info("%s version %s: %s (%s)", name, version, result.decision, result.reason)
    return result


def register_version(client: MlflowClient, retry: Retrying, name: str, model_uri: str, tags: dict[str, str],
                     run_id: str) -> str:
    """Register ``model_uri`` as a version of ``name`` once, however often it is tried: ``mlflow.register_model``
    creates the version, then polls it until it is ready, so a server that fails after the create (a database
    restarting) would otherwise leave an ungated twin behind the retry. Each try first looks for this run's version
    of ``model_uri``."""
    def once() -> str:
        for found in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if found.source == model_uri:
                logger.info("%s version %s: registered by an earlier try of this run", name, found.version)
                return str(found.version)
        return str(mlflow.register_model(model_uri, name, tags=tags).version)

    return retry("register the version", once)


def gate_version(client: MlflowClient, retry: Retrying, config: RegistryConfig, version: str, run_id: str,
                 stored: EvalSet, baseline: BaselineCheck) -> RegistryDecision:
    """Score ``version`` against the champion, then, under the registry lock, compare again if the champion
    changed meanwhile, record the decision and move the aliases (steps 3 to 6 of the module)."""
    name = config.model_name
    champion = retry("find the champion", lambda: alias_version(client, name, CHAMPION))
    ours = retry("score the candidate", lambda: score(f"models:/{name}/{version}", stored.texts, config))
    verdict = judge(ours, champion, stored, config, retry, baseline)
    checked = verdict.decision in PROMOTING  # served only when it would be promoted
    unservable = serving_failure(client, retry, config, version) if checked else None
    with AliasLock(client, name, f"gate of version {version}", retry) as lock:
        lock.repair()
        now = retry("find the champion again", lambda: alias_version(client, name, CHAMPION))
        if now != champion:
            logger.info("Registered model %s: champion moved from version %s to %s while version %s was scored; "
                        "comparing again", name, champion, now, version)
            verdict = judge(ours, now, stored, config, retry, baseline)
            verdict = dataclasses.replace(verdict, reason=verdict.reason + (
                f" (compared again: {CHAMPION} moved from version {champion} to {now} while the candidate was "
                "scored)"))
            if verdict.decision in PROMOTING and not checked:  # rare: the lock is held while it is served
                unservable = serving_failure(client, retry, config, version)
        if unservable and verdict.decision in PROMOTING:
            verdict = dataclasses.replace(verdict, decision="rejected", reason=(
                f"the serving check failed: {unservable} (the score: {verdict.reason})"))
        result = decision_record(config, version, run_id, now, ours, verdict, stored, baseline)
        event = promotion_event(result)
        if result.champion:  # decision, history and aliases as one recorded move: a kill midway is completed
            lock.move(Move(champion=version, previous=now, start=now, event=event_key(result.decided_at),
                           tags=decision_tags(result)), event)
        else:
            retry("tag the version", lambda: tag_decision(client, result))
            retry("record the history", lambda: record_event(client, name, event))
    return result


def decision_record(config: RegistryConfig, version: str, run_id: str, champion: str | None, ours: TextScores,
                    verdict: Verdict, stored: EvalSet, baseline: BaselineCheck) -> RegistryDecision:
    """The :class:`RegistryDecision` of ``verdict`` on ``version`` (``champion``: the version that held the alias)."""
    comparison = verdict.comparison
    return RegistryDecision(
        model_name=config.model_name, version=version, run_id=run_id, decision=verdict.decision,
        reason=verdict.reason, champion=verdict.decision in PROMOTING, previous_champion=champion, metric=METRIC,
        candidate_value=ours.nats_per_char, champion_value=verdict.champion_value, eval_set_sha256=stored.sha256,
        eval_texts=len(stored.texts), decided_at=dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"),
        improvement=None if comparison is None else comparison.improvement,
        interval=None if comparison is None else [comparison.low, comparison.high],
        confidence=None if comparison is None else comparison.confidence,
        val_loss=baseline.val_loss, baseline=baseline.baseline, baseline_loss=baseline.baseline_loss)


def serving_failure(client: MlflowClient, retry: Retrying, config: RegistryConfig, version: str) -> str | None:
    """Run the serving check (``registry.serving_check``) on the candidate about to be promoted: None when it
    passed or is off, else why it failed, in one line. The outcome is tagged on the version either way."""
    if not config.serving_check.enabled:
        return None
    uri = f"models:/{config.model_name}/{version}"
    try:
        passed = check_serving(uri, mlflow.get_tracking_uri(), mlflow.get_registry_uri(), config.serving_check,
                               Path.cwd())
    except ServingCheckFailed as exc:
        failure = str(exc)
        logger.warning("%s version %s: the serving check failed, so it cannot be promoted: %s", config.model_name,
                       version, failure)
        retry("tag the serving check", lambda: client.set_model_version_tag(
            config.model_name, version, SERVING_TAG, f"failed: {failure}"[:5000]))
        return failure
    logger.info("%s version %s: serving check passed (%s)", config.model_name, version, passed)
    retry("tag the serving check", lambda: client.set_model_version_tag(config.model_name, version, SERVING_TAG,
                                                                           f"passed: {passed}"[:5000]))
    return None


def judge(ours: TextScores, champion: str | None, stored: EvalSet, config: RegistryConfig, retry: Retrying,
          baseline: BaselineCheck) -> Verdict:
    """Score ``champion`` (when there is one) text by text and decide (``train_deploy.registry.rules.decide``)."""
    name, theirs, unscored = config.model_name, None, ""
    if champion is not None:
        try:
            theirs = retry("score the champion", lambda: score(f"models:/{name}/{champion}", stored.texts, config))
        except RegistryUnreachable:
            raise
        except Exception as exc:  # its files gone or damaged: whatever loading or scoring them raised
            unscored = one_line(exc)
            if not config.force:
                raise GateError(f"registered model {name}: champion version {champion} could not be scored "
                                f"({unscored}); no alias was changed (registry.force: true promotes the candidate "
                                "without a comparison)") from exc
            logger.warning("Registered model %s: champion version %s could not be scored (%s); registry.force "
                           "promotes the candidate without a comparison", name, champion, unscored)
    return decide(ours, champion, theirs, config, baseline, unscored)


def mark_failed(client: MlflowClient, retry: Retrying, name: str, version: str, exc: BaseException) -> None:
    """Tag ``version`` ``gate.decision: failed`` with why, unless it has a decision already (best effort: one try,
    since the server may be what failed; an untagged version has no decision, which counts the same)."""
    try:
        if DECISION_TAG in retry.once(lambda: client.get_model_version(name, version).tags):
            return
        for key, value in ((DECISION_TAG, FAILED), ("gate.reason", f"the gate failed: {one_line(exc)}"[:5000])):
            retry.once(lambda key=key, value=value: client.set_model_version_tag(name, version, key, value))
        logger.warning("%s version %s: the gate failed; the version is tagged %s: %s", name, version, DECISION_TAG,
                       FAILED)
    except Exception as tagging:
        logger.warning("%s version %s: the gate failed and the version could not be tagged (%s); it has no gate "
                       "decision, so no later run counts it", name, version, one_line(tagging))


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type when it has none), redacted, at most 300 characters
    (``train_deploy.redaction.one_line``)."""
    return redacted_one_line(exc)


def score(model_uri: str, texts: list[str], config: RegistryConfig) -> TextScores:
    """The nats and characters of each of ``texts`` under the model at ``model_uri`` (loaded and scored in this
    process)."""
    model = mlflow.pyfunc.load_model(model_uri)
    params = {"task": "score", "backend": config.backend, "int8": config.int8}
    chunk = min(_SCORE_CHUNK, config.max_batch)
    frames = [model.predict(pd.DataFrame({"text": texts[first : first + chunk]}), params=params)
              for first in range(0, len(texts), chunk)]
    return TextScores.from_frame(pd.concat(frames, ignore_index=True))


def version_tags(bundle: Bundle, token_files: TokenManifest, training_result: TrainingResult,
                 commit: str) -> dict[str, str]:
    """Where a version comes from: corpus (the token files export checked the checkpoint against), tokenizer,
    bundle, parity figures, project commit, training run and parallel layout."""
    meta, parity = bundle.meta, bundle.parity
    tags = {
        "corpus.fingerprint": token_files.fingerprint,
        "tokenizer.hash": meta.tokenizer["hash"],
        "bundle.fingerprint": bundle.fingerprint,
        "bundle.version": meta.version,
        "git.commit": commit,
        "training.run_name": training_result.run_name,
        "training.step": str(training_result.step),
        "training.layout": json.dumps(training_result.layout, sort_keys=True),
        "parity.passed": str(parity.passed),
    }
    tags |= {f"parity.max_abs_logit_diff.{form}": f"{value:.3g}" for form, value in parity.max_abs_logit_diff.items()}
    tags |= {f"parity.perplexity.{form}": f"{value:.6g}" for form, value in parity.perplexity.items()}
    tags |= warm_start_tags(training_result)
    return tags


def warm_start_tags(training_result: TrainingResult) -> dict[str, str]:
    """What the weights started from (``init_from``, ``init_from.hash``, why a champion start fell back to
    scratch) and the tokenizer configuration a later ``init_from: champion`` run compares with its own."""
    r = training_result
    tags = {"init_from": r.init_from}
    tags |= {"init_from.hash": r.init_from_hash} if r.init_from_hash else {}
    tags |= {"init_from.reason": r.init_from_reason[:5000]} if r.init_from_reason else {}
    tags |= {TOKENIZER_TAG: r.tokenizer_config_fingerprint} if r.tokenizer_config_fingerprint else {}
    return tags


def git_commit(folder: Path) -> str:
    """``git rev-parse HEAD`` in ``folder`` (the project), or ``unknown`` outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def decision_tags(result: RegistryDecision) -> dict[str, str]:
    """The ``gate.*`` tags of the version: decision, reason, both numbers and the metric, the improvement and its
    interval, the set's size, and the baseline rule's figures."""
    def number(value: float | None) -> str:
        return "none" if value is None else f"{value:.6f}"

    low, high = result.interval or (None, None)
    return {DECISION_TAG: result.decision, "gate.reason": result.reason[:5000], "gate.metric": result.metric,
            "gate.candidate": number(result.candidate_value), "gate.champion": number(result.champion_value),
            "gate.champion_version": result.previous_champion or "none",
            "gate.eval_set.sha256": result.eval_set_sha256, "gate.eval_set.texts": str(result.eval_texts),
            "gate.improvement": number(result.improvement), "gate.interval.low": number(low),
            "gate.interval.high": number(high),
            "gate.confidence": "none" if result.confidence is None else f"{result.confidence:g}",
            "gate.val_loss": number(result.val_loss), "gate.baseline": result.baseline or "none",
            "gate.baseline_loss": number(result.baseline_loss)}


def tag_decision(client: MlflowClient, result: RegistryDecision) -> None:
    """Set the :func:`decision_tags` of the version."""
    for key, value in decision_tags(result).items():
        client.set_model_version_tag(result.model_name, result.version, key, value)


def promotion_event(result: RegistryDecision) -> dict[str, object]:
    """The history entry of a gate decision."""
    promoted = result.champion
    return {"time": result.decided_at, "event": "gate", "decision": result.decision, "version": result.version,
            "champion": result.version if promoted else result.previous_champion,
            "previous": result.previous_champion if promoted else None,
            "metric": result.metric, "candidate": round(result.candidate_value, 6),
            "champion_value": None if result.champion_value is None else round(result.champion_value, 6),
            "improvement": _rounded(result.improvement),
            "interval": None if result.interval is None else [_rounded(bound) for bound in result.interval],
            "confidence": result.confidence, "eval_texts": result.eval_texts, "val_loss": _rounded(result.val_loss),
            "baseline": result.baseline, "baseline_loss": _rounded(result.baseline_loss),
            "reason": result.reason, "run_id": result.run_id}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
