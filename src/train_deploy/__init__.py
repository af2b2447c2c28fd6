"""train_deploy: a Kedro train-to-deploy framework for Chinese causal language models on PaddlePaddle."""

__version__ = "0.1.0"
