"""Corpus → tokens: streaming readers, cleaning, tokenizer training and parallel encoding into
PaddleNLP's memory-mapped ``.bin/.idx`` format. No Kedro imports here; the Kedro nodes live in
``train_deploy.pipelines.corpus``."""
