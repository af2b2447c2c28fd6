"""Corpus → tokens: plan the inputs, validate the training block once (this stage reads its ``init_from`` and
``batch``), resolve where training starts (``training.init_from``: its tokenizer), prepare the tokenizer, read the
registered model's evaluation set, encode into `.bin/.idx` with a manifest (validation documents that near-duplicate
training ones, and training documents that hold an evaluation text, left out; refused when a split cannot fill one
window of training's ``seq_length``), and report what the cleaning kept and dropped."""

from kedro.pipeline import Node, Pipeline

from .nodes import (
    configure_corpus_training,
    encode_tokens,
    evaluation_set_texts,
    plan_inputs,
    prepare_tokenizer,
    report_corpus,
    report_corpus_quality,
    resolve_init,
)


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(plan_inputs, "params:corpus", ["corpus_config", "corpus_plan"], name="plan_corpus_inputs"),
            Node(configure_corpus_training, "params:training", "corpus_training_config",
                 name="configure_corpus_training"),
            Node(resolve_init, ["corpus_training_config", "params:registry", "corpus_config", "init_cache"],
                 "init_source", name="resolve_init_source"),
            Node(prepare_tokenizer, ["corpus_config", "corpus_plan", "init_source"], "tokenizer",
                 name="prepare_tokenizer"),
            Node(evaluation_set_texts, "params:registry", "corpus_eval_texts", name="read_evaluation_set"),
            Node(encode_tokens, ["corpus_config", "corpus_plan", "tokenizer", "corpus_training_config",
                                 "corpus_eval_texts"], "token_files", name="encode_corpus"),
            Node(report_corpus, "token_files", ["corpus_metrics", "token_manifest"], name="report_corpus"),
            Node(report_corpus_quality, "token_files", ["corpus_report", "corpus_examples"],
                 name="report_corpus_quality"),
        ]
    )
