"""Validation: tonight's corpus statistics against the champion's, before any training. In ``train_deploy`` the
training stage takes ``validated_token_files`` (``train_deploy.pipeline_registry``), so it waits for this gate."""

from kedro.pipeline import Node, Pipeline

from .nodes import validate_corpus


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(validate_corpus, ["params:validation", "params:retrain", "params:registry", "token_files", "tokenizer"],
             "validated_token_files", name="validate_corpus"),
    ])
