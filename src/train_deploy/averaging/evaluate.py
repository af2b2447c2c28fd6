"""Validation loss of a unified checkpoint on fixed samples of the validation split."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.training.checkpoint import load_weights, read_state
from train_deploy.training.data import TokenWindows


def load_model(folder: Path):
    """The model of a checkpoint, weights loaded (safetensors, no pickle), in eval mode."""
    from paddlenlp.transformers import LlamaConfig
    from paddlenlp.transformers.llama.modeling_network import LlamaForCausalLMNet

    state = read_state(folder)
    model = LlamaForCausalLMNet(LlamaConfig.from_dict(state["model_config"]))
    load_weights(model, folder)
    model.eval()
    return model


def evaluation_windows(data: dict[str, Any], seq_length: int, count: int) -> np.ndarray:
    """The first ``count`` windows of the validation split: the same samples for every checkpoint."""
    return TokenWindows(Path(data["valid_prefix"]), seq_length, 0, data["dtype"]).in_file_order(count)


def validation_loss(model, windows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over ``windows``, every token weighted equally."""
    import paddle

    total, tokens = 0.0, 0
    with paddle.no_grad():
        for first in range(0, len(windows), batch_size):
            batch = paddle.to_tensor(windows[first : first + batch_size])
            logits = model(input_ids=batch[:, :-1]).astype("float32")
            loss = paddle.nn.functional.cross_entropy(logits, batch[:, 1:].unsqueeze(-1), reduction="sum")
            total += float(loss)
            tokens += int(batch[:, 1:].size)
    return total / tokens


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
