"""Project pipelines: one per stage, and `train_deploy` chaining the stages in order."""

import importlib

from kedro.pipeline import Pipeline, pipeline

# Stages in the order `train_deploy` runs them; each is also a pipeline of its own (`--pipelines corpus`).
STAGES = ("corpus", "validation", "training", "averaging", "export", "registry")


def register_pipelines() -> dict[str, Pipeline]:
    """Return every stage pipeline, `train_deploy` (all stages) and `__default__`."""
    # Not kedro's find_pipelines: with `kedro run --pipeline train_deploy` it filters the stage folders by
    # the requested name and finds none, since `train_deploy` is a composition, not a folder.
    pipelines = {name: importlib.import_module(f"train_deploy.pipelines.{name}").create_pipeline() for name in STAGES}
    # In the chain, training takes the token files the data gate passed, so it starts only once the gate has, and
    # averaging and export check the checkpoints against the same files (with `validation.screening: drop`, a copy
    # without the dropped documents, under its own fingerprint); alone (`--pipelines training`) each takes them from
    # the catalog, ungated. The registry records the corpus as it came: what the next night's gate compares with.
    gated = {**pipelines, **{stage: pipeline(pipelines[stage], inputs={"token_files": "validated_token_files"})
                             for stage in ("training", "averaging", "export")}}
    pipelines["train_deploy"] = sum(gated.values(), Pipeline([]))
    pipelines["__default__"] = pipelines["train_deploy"]
    return pipelines
