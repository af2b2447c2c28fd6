"""Shared fixtures: tiny corpus slices and a tokenizer trained once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from kedro.framework.startup import bootstrap_project

from tests.helpers.project import NO_SERVING_CHECK, copy_project, corpus_params, publish, published
from tests.helpers.shared import built_once
from train_deploy.handoffs import DataSpec, TokenizerInfo, TokenManifest, TrainingResult

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


# The longest test files (by the fresh-clone CI's durations, longest first) start first: `make test` hands whole
# files to two workers (--dist loadfile; pytest_configure keeps this order, which xdist would otherwise sort by the
# files' numbers of tests), so a five-minute file that came last would leave one worker idle at the end.
LONGEST_FILES = (
    "tests/team/test_team_server.py",
    "tests/serving/test_replicas.py",
    "tests/test_gate_end_to_end.py",
    "tests/registry/test_gate.py",
    "tests/test_signals.py",
    "tests/training/test_worker.py",
    "tests/training/test_faults.py",
    "tests/test_cli.py",
    "tests/registry/test_aliases.py",
    "tests/validation/test_content_nights.py",
    "tests/registry/test_lineage.py",
    "tests/test_alert_delivery.py",
    "tests/test_run.py",
    "tests/training/test_unattended.py",
    "tests/benchmarks/test_gpu_train_check.py",
    "tests/test_schedule.py",
    "tests/pipelines/registry/test_pipeline.py",
    "tests/registry/test_model.py",
    "tests/pipelines/validation/test_pipeline.py",
    "tests/registry/test_serve.py",
)


TRAINED = frozenset({"tiny_run", "tiny_checkpoint", "tiny_training_logs", "tiny_bundle", "tiny_model",
                     "seed_champion", "step_bundles", "champion"})
"""Fixtures that train or export a model: a test using one is marked ``trained`` (``make mutation`` and
``make test-quick`` leave those tests out: building them takes minutes, once per session or per mutant)."""


def pytest_configure(config: pytest.Config) -> None:
    """xdist hands out whole files (``--dist loadfile``) in the collected order, not reordered by test count."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests that use :data:`TRAINED`; the files of :data:`LONGEST_FILES` first, in that order, the others
    after them, as collected."""
    for item in items:
        if TRAINED.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.trained)
    rank = {path: place for place, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True)
def _mlflow_environment_restored() -> Iterator[None]:
    """MLflow keeps the URIs a test sets in ``MLFLOW_*`` variables (``set_registry_uri`` exports
    ``MLFLOW_REGISTRY_URI``), which the next test's sessions would inherit: each test starts from the same."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("MLFLOW_")}
    yield
    for name in [name for name in os.environ if name.startswith("MLFLOW_") and name not in saved]:
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory) -> None:
    """Derived data the project caches per machine (the corpus stage's Unicode tables) goes under the
    session's temporary folder, for this process and every one it starts, not the user's cache."""
    os.environ["TRAIN_DEPLOY_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> TokenizerInfo:
    """A SentencePiece tokenizer trained on the People's Daily slice, published as the corpus stage does."""
    from train_deploy.pipelines.corpus.nodes import plan_inputs, prepare_tokenizer

    return built_once(tmp_path_factory, "tokenizer",
                      lambda folder: publish(prepare_tokenizer(*plan_inputs(corpus_params())), folder / "tokenizer",
                                             TokenizerInfo),
                      lambda folder: published(folder / "tokenizer", TokenizerInfo))


@pytest.fixture(scope="session")
def tiny_token_files(tmp_path_factory, tiny_tokenizer) -> TokenManifest:
    """The People's Daily slice encoded with the tiny tokenizer (5% for validation), published as the stage does."""
    from train_deploy.pipelines.corpus.nodes import encode_tokens, plan_inputs

    config, plan = plan_inputs(corpus_params(encoding={"validation_fraction": 0.05}))
    return built_once(tmp_path_factory, "token_files",
                      lambda folder: publish(encode_tokens(config, plan, tiny_tokenizer), folder / "tokens",
                                             TokenManifest),
                      lambda folder: published(folder / "tokens", TokenManifest))


@pytest.fixture(scope="session")
def tiny_tokens(tiny_token_files) -> DataSpec:
    """A run's ``data``: the tiny token files (:func:`tiny_token_files`) and their tokenizer.

    A tiny run evaluates its first ``eval_batches × global_batch_size`` validation windows
    (``TrainingResult.eval_windows``; ``tests.training.conftest.TINY_EVAL_WINDOWS``).
    """
    return DataSpec.of(tiny_token_files)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_tokens) -> TrainingResult:
    """A 6-step tiny run through Paddle's launcher (one process), checkpoints at steps 3 and 6 (one per session,
    shared by the workers: ``tests.helpers.shared``)."""
    from tests.helpers.training import launch, result, training_params

    return built_once(tmp_path_factory, "tiny_run", lambda folder: launch(folder, tiny_tokens, training_params(1)),
                      result)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run) -> Path:
    """The last checkpoint of :func:`tiny_run`."""
    return Path(tiny_run.checkpoint)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A copy of the project's configuration in an empty folder, with its own SQLite MLflow store."""
    root = copy_project(tmp_path / "project")
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    bootstrap_project(root)
    return root


@pytest.fixture(scope="session")
def tiny_training_logs(tmp_path_factory, tiny_run):
    """``training_logs`` (a ``WorkFolder``) holding the metrics of :func:`tiny_run`."""
    from tests.helpers.export import training_logs

    return training_logs(tmp_path_factory.mktemp("training_logs"), tiny_run)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_checkpoint, tiny_tokenizer, tiny_token_files, tiny_run,
                tiny_training_logs) -> Path:
    """The tiny checkpoint exported through the export node and the catalog's versioned bundle dataset, with the
    training curves of its run: one export per session, shared by the export and registry tests."""
    from tests.helpers.export import export_params, selected
    from train_deploy.handoffs import Bundle
    from train_deploy.pipelines.export.nodes import export_model

    def build(folder: Path) -> None:
        work, _ = export_model(export_params(), selected(tiny_checkpoint), tiny_tokenizer, tiny_token_files, tiny_run,
                               tiny_training_logs)
        assert not publish(work, folder / "bundle", Bundle, versions=True).reused

    return Path(built_once(tmp_path_factory, "bundles", build,
                           lambda folder: published(folder / "bundle", Bundle, versions=True)).path)


@pytest.fixture
def seed_champion(tiny_bundle, tiny_run, tiny_token_files, tiny_tokenizer):
    """``seed(uri, **tags)``: the session's tiny bundle as a new version of the default registered model in the
    store at ``uri`` (the first becomes champion; the same bundle again is no improvement, so the gate rejects
    it), with ``tags`` beside its own and a small evaluation set that later runs reuse."""
    import mlflow

    from train_deploy.handoffs import Bundle
    from train_deploy.registry.config import RegistryConfig
    from train_deploy.registry.evalset import validation_texts
    from train_deploy.registry.gate import register_and_gate, version_tags

    def seed(uri: str, **tags: str) -> None:
        bundle = Bundle.read_folder(tiny_bundle)
        config = RegistryConfig.from_params({"eval_set": {"documents": 8, "max_chars": 60}, **NO_SERVING_CHECK})
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        with mlflow.start_run(experiment_id=mlflow.set_experiment("seed").experiment_id):
            register_and_gate(bundle, config, version_tags(bundle, tiny_token_files, tiny_run, "seed") | tags,
                              partial(validation_texts, tiny_token_files, tiny_tokenizer, 8, 60))

    return seed


@pytest.fixture(scope="session")
def model_store(tmp_path_factory):
    """An empty SQLite store for this session's models (``tests.helpers.registry.ModelStore``)."""
    from tests.helpers.registry import ModelStore

    return ModelStore(tmp_path_factory.mktemp("model_store"))


@pytest.fixture(scope="session")
def tiny_model(model_store, tiny_bundle):
    """The tiny bundle logged with the defaults and registered as a version of ``train_deploy_lm`` (its
    ``ModelInfo``): the registry's and the export's integrity tests share it."""
    from tests.helpers.registry import REGISTERED_MODEL

    return model_store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL)
