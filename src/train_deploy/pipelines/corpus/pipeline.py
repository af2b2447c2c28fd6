"""Corpus → tokens: plan the inputs, prepare the tokenizer, encode into `.bin/.idx` with a manifest."""

from kedro.pipeline import Node, Pipeline

from .nodes import corpus_metrics, encode_tokens, plan_inputs, prepare_tokenizer


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(plan_inputs, "params:corpus", "corpus_plan", name="plan_corpus_inputs"),
            Node(prepare_tokenizer, "corpus_plan", "tokenizer", name="prepare_tokenizer"),
            Node(encode_tokens, ["corpus_plan", "tokenizer"], "token_manifest", name="encode_corpus"),
            Node(corpus_metrics, "token_manifest", "corpus_metrics", name="log_corpus_metrics"),
        ]
    )
