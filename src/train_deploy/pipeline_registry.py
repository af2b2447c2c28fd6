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
    # In the chain, training takes the token files the data gate passed, so it starts only once the gate has;
    # alone (`--pipelines training`) it takes them from the catalog, ungated.
    gated = {**pipelines, "training": pipeline(pipelines["training"], inputs={"token_files": "validated_token_files"})}
    pipelines["train_deploy"] = sum(gated.values(), Pipeline([]))
    pipelines["__default__"] = pipelines["train_deploy"]
    return pipelines
