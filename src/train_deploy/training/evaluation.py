"""Validation loss on fixed windows of the validation split, and the model of a checkpoint.

There is one definition of the number every stage reports: the mean next-token cross-entropy over the
first windows of the validation split, every token weighted equally (:func:`mean_token_loss`). It walks
the windows in batches and asks a :data:`BatchLoss` for each batch's summed loss and token count, so the
same reduction serves a whole model in this process (:func:`validation_loss`: averaging, export) and the
training workers, whose batch loss is a sharded forward of each data-parallel rank's share that already
spans every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from train_deploy.training.checkpoint import load_weights, read_state
from train_deploy.training.data import TokenWindows

BatchLoss = Callable[[np.ndarray], tuple[float, int]]
"""Given a batch of windows ``[rows, seq_length + 1]``: its summed next-token loss and its token count."""


def validation_windows(valid_prefix: str | Path, dtype: str, seq_length: int, count: int) -> np.ndarray:
    """The first ``count`` windows of the validation split in file order: the same samples for every model.

    Fewer when the split holds fewer; raises ``CorpusError`` (naming the file and what to change) when it
    cannot fill one window.
    """
    return TokenWindows(Path(valid_prefix), seq_length, 0, dtype).in_file_order(count)


# How the training run executed the model, not what the model computes: a checkpoint trained on GPU records
# flash attention and fused kernels (which refuse float32 on GPU, and some of which do not exist on CPU) and
# its parallel layout. Every model rebuilt from a checkpoint here runs with these instead, whatever the
# training flags were; the keys that change the weights' layout (fuse_attention_qkv, …) are kept.
PORTABLE_SETTINGS: dict[str, object] = {
    "use_flash_attention": False, "use_flash_attention_for_generation": False, "use_fused_rms_norm": False,
    "use_fused_rope": False, "use_fused_linear": False, "use_fused_dropout_add": False,
    "use_fused_linear_cross_entropy": False, "sequence_parallel": False, "fuse_sequence_parallel_allreduce": False,
    "tensor_parallel_degree": 1, "tensor_parallel_rank": 0, "pipeline_parallel_degree": 1,
    "sep_parallel_degree": 1, "context_parallel_degree": 1, "recompute": False, "use_cache": False,
    "dtype": "float32",
}


def portable_model_config(model_config: dict) -> dict:
    """A checkpoint's ``model_config`` with the training run's execution settings replaced by
    :data:`PORTABLE_SETTINGS`: two configurations that compute the same model are then equal."""
    return {**model_config, **PORTABLE_SETTINGS}


def load_model(checkpoint: Path):
    """PaddleNLP's ``LlamaForCausalLM`` with ``checkpoint``'s weights in float32, in eval mode.

    The checkpoint's training model (``LlamaForCausalLMNet``) has the same parameter names and logits; this
    one has portable attention and kernels (:data:`PORTABLE_SETTINGS`, whatever the checkpoint's
    ``model_config`` says), so it computes the same numbers on CPU and GPU and exports. Averaging's
    evaluation and export (its graph and its parity reference) build every model through here.
    """
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(portable_model_config(read_state(checkpoint)["model_config"]))
    for key, value in PORTABLE_SETTINGS.items():  # also over what the constructor derived from the originals
        setattr(config, key, value)
    model = LlamaForCausalLM(config)
    load_weights(model, checkpoint)  # cast to float32, the dtype the model was built with
    model.eval()
    return model


def next_token_loss(logits, labels, reduction: str = "mean"):
    """Cross-entropy of ``labels`` (``[rows, seq]`` ids) under ``logits`` (``[rows, seq, vocab]``), in float32."""
    import paddle

    return paddle.nn.functional.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1), reduction=reduction)


def model_batch_loss(model) -> BatchLoss:
    """The :data:`BatchLoss` of a whole model in this process."""
    import paddle

    def batch_loss(windows: np.ndarray) -> tuple[float, int]:
        ids = paddle.to_tensor(windows)
        out = model(input_ids=ids[:, :-1])
        logits = out[0] if isinstance(out, tuple | list) else out  # LlamaForCausalLM returns a tuple
        return float(next_token_loss(logits, ids[:, 1:], reduction="sum")), int(windows[:, 1:].size)

    return batch_loss


def validation_loss(model, windows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy of a whole model in this process over ``windows``."""
    return mean_token_loss(windows, model_batch_loss(model), batch_size)


def mean_token_loss(windows: np.ndarray, batch_loss: BatchLoss, batch_size: int) -> float:
    """Mean next-token cross-entropy over ``windows``, every token weighted equally.

    ``batch_loss`` gets ``batch_size`` windows at a time (the last batch may hold fewer), without gradients.
    """
    import paddle

    total, tokens = 0.0, 0
    with paddle.no_grad():
        for first in range(0, len(windows), batch_size):
            loss, count = batch_loss(windows[first : first + batch_size])
            total, tokens = total + loss, tokens + count
    if tokens == 0:
        raise ValueError("no validation windows to evaluate")
    return total / tokens


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped at ``exp(50)`` so that a diverged loss still reports a finite number."""
    return math.exp(min(loss, 50.0))
