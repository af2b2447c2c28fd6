"""Distributed hybrid-parallel training of a PaddleNLP Llama-family causal LM (no Kedro imports here).

``config`` validates the ``training`` block, ``data`` samples fixed-length windows from the ``.bin``
token files, ``parallelize`` applies dp/mp/pp/sharding in one place, ``checkpoint`` writes unified
safetensors checkpoints, ``worker`` is the training loop that ``launch`` starts with Paddle's launcher.
"""
