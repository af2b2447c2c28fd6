"""Distributed hybrid-parallel training of a PaddleNLP Llama-family causal LM (no Kedro imports here).

``config`` validates the ``training`` block, ``data`` samples fixed-length windows from the ``.bin``
token files, ``parallelize`` applies dp/mp/pp/sharding in one place, ``checkpoint`` writes unified
safetensors checkpoints and restores them into any layout, ``metrics`` measures and reports from rank 0,
``worker`` is the training loop that ``launch`` starts with Paddle's launcher.
"""
