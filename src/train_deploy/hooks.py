"""Project hooks."""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sqlite3
import sys
import threading
from pathlib import Path

import mlflow
from kedro.framework.hooks import hook_impl
from mlflow.utils.file_utils import local_file_uri_to_path

from train_deploy.atomic import clean_leftovers, remove_leftovers
from train_deploy.console import log_above_bars_on_terminal, log_to_file, plain_console_unless_terminal
from train_deploy.datasets import ArtifactFolderDataset, WorkFolderDataset
from train_deploy.preflight import check_run, check_tracking
from train_deploy.retrain import CHECKED_NODES, OUTCOME_TAG, REASON_TAG, NothingToRetrain, check_for_changes
from train_deploy.run_lock import RunConfig, RunLock
from train_deploy.schedule import TRIGGER_VARIABLE

logger = logging.getLogger(__name__)


class ConsoleLogging:
    """Every record of the run in the project's ``logs/train_deploy.log``, plain console lines when the console is
    not a terminal, and records above the progress bars when it is one (``train_deploy.console``)."""

    @hook_impl(tryfirst=True)
    def after_context_created(self, context) -> None:
        log_to_file(context.project_path)
        plain_console_unless_terminal()
        log_above_bars_on_terminal()


class ProjectRunLock:
    """One run at a time per project (``run.lock: fail | wait``, see ``train_deploy.run_lock``).

    A wrapper around the other ``before_pipeline_run`` hooks: the lock is taken before kedro-mlflow opens a
    run (a refused run leaves no MLflow run behind) and given back if any of them fails.
    """

    def __init__(self) -> None:
        self._lock: RunLock | None = None
        self._config = RunConfig()

    @hook_impl
    def after_context_created(self, context) -> None:
        self._lock = RunLock(Path(context.project_path) / "data")
        self._config = RunConfig.from_params(context.params.get("run"))

    @hook_impl(wrapper=True)
    def before_pipeline_run(self, run_params, catalog):
        if self._lock is not None:
            self._lock.acquire(self._config, ", ".join(run_params.get("pipeline_names") or ["__default__"]))
        try:
            _report_leftovers(self._lock.folder if self._lock else None, catalog)
            return (yield)
        except BaseException:
            self._release()
            raise

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._release()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()


def _report_leftovers(data: Path | None, catalog) -> None:
    """Remove what interrupted runs left where this project writes (under the lock: nobody writes now)."""
    removed = clean_leftovers(data) if data is not None else []
    for name in catalog:
        dataset = catalog.get(name)
        if isinstance(dataset, ArtifactFolderDataset | WorkFolderDataset):
            folder, store = dataset.folder, getattr(dataset, "store", None)
            if data is None or not folder.is_relative_to(data):  # data/ was walked already
                removed += clean_leftovers(store or folder)
                removed += remove_leftovers(folder.parent, prefix=f".{folder.name}.")
    if removed:
        logger.warning("Removed %d leftover(s) of interrupted runs: %s%s", len(removed),
                       ", ".join(str(p) for p in removed[:5]), " …" if len(removed) > 5 else "")


class LocalMlflowStore:
    """The local SQLite tracking store in write-ahead-log mode: the MLflow UI or a scheduler reading it while a
    run writes does not make the run fail with "database is locked" (readers no longer block the writer)."""

    @hook_impl(trylast=True)  # after kedro-mlflow has set the tracking URI (and created the store)
    def after_context_created(self) -> None:
        uri = mlflow.get_tracking_uri()
        if not uri.startswith("sqlite:///"):
            return
        with sqlite3.connect(uri.removeprefix("sqlite:///"), timeout=30) as connection:
            connection.execute("PRAGMA journal_mode=WAL")  # stored in the database file: once is enough


class CheckConfiguration:
    """Refuse a run whose parameters are invalid before any node runs, with one line naming the key.

    Every stage block is validated, and what the pipeline's stages need of each other is checked
    (``train_deploy.preflight``). ``tryfirst``: before kedro-mlflow opens its run, so a refused run leaves none.
    A tracking server that does not answer or refuses the credentials stops the session as it starts, with one
    line naming its URI and what to set, before kedro-mlflow asks it with minutes of retries.
    """

    @hook_impl(tryfirst=True)
    def after_context_created(self, context) -> None:
        if mlflow.active_run() is None:  # an outer run: kedro-mlflow logs into it and reads no mlflow.yml
            check_tracking(context.config_loader)

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, pipeline, catalog) -> None:
        stages = {name.removeprefix("params:") for name in pipeline.inputs() if name.startswith("params:")}
        check_run(catalog.load("parameters"), stages)


class OuterRunAware:
    """Remembers the MLflow run that was active before the Kedro session started (a notebook's, a caller's): hooks
    that end runs leave that one open, as kedro-mlflow logs into it."""

    def __init__(self) -> None:
        self._outer_run_id: str | None = None

    @hook_impl
    def after_context_created(self) -> None:
        run = mlflow.active_run()
        self._outer_run_id = run.info.run_id if run else None


class CloseMlflowRun(OuterRunAware):
    """End the MLflow run of a Kedro run completely when the pipeline finishes or fails.

    kedro-mlflow re-opens its run before every node; with MLflow 3 that leaves the run on the
    active-run stack after kedro-mlflow ends it, so a second KedroSession in the same process (a
    scheduler, a notebook, the tests) would log into the first run. A run that was already active
    before the session started is left open, as kedro-mlflow documents.
    """

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._close()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._close()

    def _close(self) -> None:
        end_mlflow_runs(self._outer_run_id)


def end_mlflow_runs(outer_run_id: str | None, status: str = "FINISHED") -> None:
    """End the active MLflow runs down to the run ``outer_run_id`` (open before the session; None: all)."""
    while (run := mlflow.active_run()) is not None and run.info.run_id != outer_run_id:
        mlflow.end_run(status)


class TagTrigger:
    """Tag the MLflow run with what started it: ``trigger`` = ``schedule`` for ``train-deploy schedule`` (which
    sets ``TRAIN_DEPLOY_TRIGGER``), ``manual`` otherwise."""

    @hook_impl(trylast=True)  # after kedro-mlflow has opened its run
    def before_pipeline_run(self) -> None:
        if mlflow.active_run() is not None:
            mlflow.set_tag("trigger", os.environ.get(TRIGGER_VARIABLE) or "manual")


class SkipUnchanged(OuterRunAware):
    """A run that trains and registers first compares its corpus and training configuration with the champion's
    (``train_deploy.retrain``) and ends before its first node when nothing changed.

    ``trylast``: after kedro-mlflow has opened the run, which records the fingerprints and the reason, and, for
    a skipped run, ``outcome=skipped``; it is then closed as finished and :class:`NothingToRetrain` stops the
    session (``kedro run`` exits 0 saying why, see ``train_deploy.cli``).
    """

    @hook_impl(trylast=True)
    def before_pipeline_run(self, pipeline, catalog) -> None:
        if not CHECKED_NODES <= {node.name for node in pipeline.nodes}:
            return
        active = mlflow.active_run() is not None
        check = check_for_changes(catalog.load("parameters"))  # if it fails, EndStoppedRun ends the run FAILED
        if active:
            mlflow.set_tags({**check.fingerprints, REASON_TAG: check.reason})
        if check.retrain:
            logger.info("Retraining: %s", check.reason)
            return
        if active:
            mlflow.set_tag(OUTCOME_TAG, "skipped")
        end_mlflow_runs(self._outer_run_id)
        raise NothingToRetrain(check.reason)


class RelativeArtifactLocation:
    """The project's SQLite store keeps its experiment's artifact location relative to the project (``mlartifacts``
    from conf/base/mlflow.yml): kedro-mlflow and MLflow store it absolute, so a moved or copied project would
    write its runs' artifacts into the old folder. Runs and ``make ui`` resolve it from the project root."""

    @hook_impl(trylast=True)  # after kedro-mlflow has created the experiment
    def after_context_created(self, context) -> None:
        config = getattr(context, "mlflow", None)
        uri = mlflow.get_tracking_uri()
        if config is None or not uri.startswith("sqlite:///"):
            return
        location = config.tracking.experiment.create_experiment_kwargs.artifact_location or ""
        if not location.startswith("file://"):
            return
        project = Path(context.project_path).resolve()
        absolute = Path(local_file_uri_to_path(location)).resolve()
        if absolute.is_relative_to(project):
            with sqlite3.connect(uri.removeprefix("sqlite:///"), timeout=30) as connection:
                connection.execute("UPDATE experiments SET artifact_location = ? WHERE name = ? AND "
                                   "artifact_location = ?", (absolute.relative_to(project).as_posix(),
                                                             config.tracking.experiment.name, location))


class LineageTags:
    """Tags that link the runs of single stages (``--pipelines corpus``, then ``training``, …): every run that
    reads the token files carries ``corpus.fingerprint``, every run that reads or writes a training result its
    ``training.run_name``; and ``runner`` is the runner's class name, not its object repr."""

    TAGS = {"token_files": ("corpus.fingerprint", "fingerprint"),
            "training_result": ("training.run_name", "run_name")}

    @hook_impl(trylast=True)  # after kedro-mlflow has opened its run and tagged it with the run parameters
    def before_pipeline_run(self, run_params) -> None:
        if mlflow.active_run() is not None:
            mlflow.set_tag("runner", _runner_name(str(run_params.get("runner"))))

    @hook_impl
    def after_dataset_loaded(self, dataset_name: str, data) -> None:
        self._tag(dataset_name, data)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data) -> None:
        self._tag(dataset_name, data)

    def _tag(self, dataset_name: str, data) -> None:
        tag, field = self.TAGS.get(dataset_name, (None, ""))
        value = getattr(data, field, None)
        if tag and isinstance(value, str) and mlflow.active_run() is not None:
            mlflow.set_tag(tag, value)


def _runner_name(recorded: str) -> str:
    """The runner's class name from what Kedro records: an instance's repr, a class's name, or ``None`` for its
    default runner."""
    if recorded == "None":
        return "SequentialRunner"
    instance = re.fullmatch(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", recorded)
    return instance.group(1).rsplit(".", 1)[-1] if instance else recorded


class EndStoppedRun(OuterRunAware):
    """A Kedro run that fails in a ``before_pipeline_run`` hook after kedro-mlflow opened its MLflow run ends it
    ``FAILED``; one stopped by SIGTERM or Ctrl-C ends it ``KILLED``. Neither stays ``RUNNING``, nor ends
    ``FINISHED`` by MLflow's exit handler. (SIGKILL leaves no chance: that run stays ``RUNNING``.)

    While the pipeline runs, SIGTERM (when nobody else handles it) exits with status 143 through ``SystemExit``,
    so ``finally`` blocks and exit handlers run, as Ctrl-C's ``KeyboardInterrupt`` does.
    """

    def __init__(self) -> None:
        super().__init__()
        self._previous_sigterm = None

    @hook_impl(wrapper=True)
    def before_pipeline_run(self):
        try:
            result = yield
        except BaseException as error:  # Kedro calls no on_pipeline_error before the first node
            end_mlflow_runs(self._outer_run_id, _stopped_status(error))
            raise
        atexit.register(self._end_abandoned)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return result

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._restore()

    @hook_impl
    def on_pipeline_error(self) -> None:
        self._restore()

    def _restore(self) -> None:
        atexit.unregister(self._end_abandoned)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _end_abandoned(self) -> None:
        """At exit, a run still open was stopped between its hooks (Ctrl-C, SIGTERM, ``SystemExit``)."""
        try:
            end_mlflow_runs(self._outer_run_id, "KILLED")
        except Exception as exc:  # an exit handler must not raise; the tracking server may be gone
            logger.warning("Could not end the MLflow run as KILLED: %s", exc)


def _stopped_status(error: BaseException) -> str:
    return "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


class ShowBundle:
    """After a run that exported a bundle, print where it is, its validation loss beside the n-gram baselines and
    how to load it, with a sample that continues the start of a validation document (plain text, unwrapped)."""

    @hook_impl
    def after_pipeline_run(self, pipeline, catalog) -> None:
        if "export_bundle" not in pipeline.all_outputs():
            return
        bundle = catalog.load("export_bundle")
        folder, baselines = bundle.path, _baseline_line(bundle.meta["source"], bundle.parity)
        prompt, sample = _validation_sample(folder, catalog.load("token_files"))
        call = (f"model.generate({prompt!r}, max_new_tokens={SAMPLE_TOKENS}, temperature={SAMPLE_TEMPERATURE}, "
                f"top_k={SAMPLE_TOP_K}, seed=0)")
        sys.stdout.write(
            f"\nExported bundle: {folder}\n"
            f"  model card: {folder}/MODEL_CARD.md\n"
            + (f"  {baselines}\n" if baselines else "")
            + "  load it (Paddle Inference; backend='onnx', int8=True for the edge model):\n"
            "    from train_deploy.export import LanguageModel\n"
            f"    model = LanguageModel.load({folder!r})\n"
            f"    print({call})\n"
            + (f"  which printed: {prompt}|{sample}\n" if sample is not None else ""))


SAMPLE_TOKENS, SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 30, 0.8, 20
"""The end-of-run sample: a little sampling (greedy decoding of a small model repeats itself), a fixed seed."""
PROMPT_TOKENS = 8
"""The prompt: at most this many tokens of the first validation document (at most half of it)."""


def _baseline_line(source: dict, parity: dict) -> str | None:
    """The model's validation loss beside the n-gram baselines of the same windows: the evaluation windows the
    loss was measured on, else the parity windows (None for bundles made before the baselines)."""
    from train_deploy.baselines import Baselines

    if source.get("val_baselines") and source.get("val_loss") is not None:
        base, loss = source["val_baselines"], source["val_loss"]
    elif parity.get("baselines"):
        base, loss = parity["baselines"], parity["baselines"]["model_loss"]
    else:
        return None
    return "validation: " + Baselines(**{name: base[name] for name in Baselines.__slots__}).describe(loss)


def _validation_sample(folder: str, tokens) -> tuple[str, str | None]:
    """The start of the first validation document, decoded, and the bundle's sampled continuation of it (None,
    with a warning, when the bundle cannot generate here)."""
    import numpy as np

    from train_deploy.export import LanguageModel

    try:
        valid = np.memmap(f"{tokens.prefix('valid')}.bin", dtype=np.dtype(tokens.dtype), mode="r")
        ends = np.flatnonzero(np.asarray(valid[:4096]) == tokens.tokenizer.eos_id)
        document = np.asarray(valid[: ends[0] if len(ends) else min(len(valid), 4096)], dtype=np.int64)
        model = LanguageModel.load(folder)
        prompt = model.tokenizer.decode(document[: max(1, min(PROMPT_TOKENS, len(document) // 2))].tolist())
        prompt = prompt if prompt.strip() else "中国"
        return prompt, model.generate(prompt, max_new_tokens=SAMPLE_TOKENS, temperature=SAMPLE_TEMPERATURE,
                                      top_k=SAMPLE_TOP_K, seed=0)
    except Exception as exc:  # a hint must not fail a run that has finished
        logger.warning("No sample from %s: %s", folder, exc)
        return "中国", None


class ShowRegistryDecision:
    """After a run that registered a version, print its MLflow run, the version and whether it became ``champion``,
    with the gate's reason (plain text, unwrapped)."""

    @hook_impl
    def after_pipeline_run(self, pipeline, catalog) -> None:
        if "registry_decision" not in pipeline.all_outputs():
            return
        decision = catalog.load("registry_decision")
        verdict = ("became champion" if decision.champion else
                   f"did not become champion (champion stays version {decision.previous_champion})")
        sys.stdout.write(
            f"\nMLflow run: {decision.run_id}\n"
            f"Registered {decision.model_name} version {decision.version}: {verdict} [{decision.decision}]\n"
            f"  reason: {decision.reason}\n"
            f"  serve the champion: mlflow models serve -m models:/{decision.model_name}@champion --env-manager local\n"
            f"  history and rollback: train-deploy-registry history|rollback --model {decision.model_name}\n")
