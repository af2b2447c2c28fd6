"""Validation: tonight's corpus statistics against the champion's, before any training. In ``train_deploy`` the
training stage takes ``validated_token_files`` (``train_deploy.pipeline_registry``), so it waits for this gate: the
token files themselves, or with ``validation.screening: drop`` their copy in ``screened_token_files`` without the
training documents the champion finds far outside the corpus."""

from kedro.pipeline import Node, Pipeline

from .nodes import validate_corpus


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline([
        Node(validate_corpus, ["params:validation", "params:retrain", "params:registry", "token_files", "tokenizer",
                               "params:training", "screened_token_files"], "validated_token_files",
             name="validate_corpus"),
    ])
