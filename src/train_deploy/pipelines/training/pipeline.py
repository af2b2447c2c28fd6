"""Training: validate the configuration once, then launch the distributed workers on the corpus stage's token
files."""

from kedro.pipeline import Node, Pipeline

from .nodes import configure_training, train_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(configure_training, ["params:training", "token_files", "init_source"], "training_config",
             name="configure_training"),
        Node(train_model, ["training_config", "token_files", "checkpoints", "training_logs", "init_source"],
             "training_result", name="train_model"),
    ])
