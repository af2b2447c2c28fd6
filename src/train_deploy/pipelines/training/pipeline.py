"""Training: launch the distributed workers on the token files of the corpus stage."""

from kedro.pipeline import Node, Pipeline

from .nodes import train_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(train_model, ["params:training", "token_files", "checkpoints", "training_logs", "init_source"],
             "training_result", name="train_model"),
    ])
