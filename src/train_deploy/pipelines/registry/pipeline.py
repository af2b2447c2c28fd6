"""Registry: the bundle as a new version of the registered MLflow model, promoted to `champion` when better."""

from kedro.pipeline import Node, Pipeline

from .nodes import register_bundle


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(register_bundle, ["params:registry", "export_bundle", "export_metrics", "token_files", "tokenizer",
                              "training_result"],
             ["registry_decision", "registry_history"], name="register_bundle"),
    ])
