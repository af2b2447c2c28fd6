"""The model: PaddleNLP's auto-parallel Llama (``LlamaForCausalLMNet``) built from a preset."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from train_deploy.training.config import TrainingConfig


def llama_config(config: TrainingConfig, vocab_size: int, eos_id: int):
    """The ``LlamaConfig`` of the preset with the tokenizer's vocabulary and special ids (the training stage's
    configure node has checked that the model has an embedding for each of them: ``check_vocabulary``)."""
    from paddlenlp.transformers import LlamaConfig

    shape: dict[str, Any] = {"vocab_size": vocab_size, **config.model.shape()}
    return LlamaConfig(
        **shape,
        bos_token_id=1,
        eos_token_id=eos_id,
        pad_token_id=0,
        # GPU training uses flash attention and fused RoPE (the same function, faster; they change no weights);
        # evaluation and export rebuild the model with portable kernels whatever these say
        # (evaluation.load_model), since flash attention has no float32 and neither runs on CPU.
        use_fused_rms_norm=False,
        use_fused_rope=config.device.type == "gpu",
        use_flash_attention=config.device.type == "gpu",
        recompute=config.precision.recompute,
        tensor_parallel_degree=1,  # tensor parallelism is applied by paddle.distributed.parallelize
        dtype="float32",
    )


def build_model(config: TrainingConfig, vocab_size: int, eos_id: int):
    from paddlenlp.transformers.llama.modeling_network import LlamaForCausalLMNet

    model = LlamaForCausalLMNet(llama_config(config, vocab_size, eos_id))
    # PaddleNLP's Trainer switches this on; whole decoder layers are recomputed in the backward pass.
    model.llama.enable_recompute = config.precision.recompute
    if config.device.type == "cpu":
        use_cpu_forms(model)
    return model


# --- the same functions in forms Paddle's CPU kernels run faster -----------------------------------------


def use_cpu_forms(model) -> None:
    """Compute ``model``'s RMS norms and rotary embeddings in forms that Paddle's CPU kernels run faster. They are
    the same functions (equal to float rounding; no weight or checkpoint changes), and they cut ~20% off a
    ``small`` step on one core (docs/benchmarks.md, "Training"):

    - the norm squares by multiplying: Paddle's CPU ``pow`` is a generic power, ~1 ms forward and again backward
      for a 4 × 128 × 128 activation, nine times a step;
    - rotate-half (``[-x2, x1]``) is a matmul by a fixed ±1 matrix instead of two slices and a concat: slice's
      gradient fills a zero tensor and copies into it, ~0.7 ms each, sixteen a step.

    The rotary form replaces ``apply_rotary_pos_emb`` in PaddleNLP's auto-parallel module, which only the training
    model (``LlamaForCausalLMNet``) uses; the exported ``LlamaForCausalLM`` keeps its own.
    """
    from types import MethodType

    from paddlenlp.transformers.llama import modeling_network

    modeling_network.apply_rotary_pos_emb = _apply_rotary_pos_emb
    for layer in model.sublayers():
        if isinstance(layer, modeling_network.LlamaRMSNormNet):
            layer.forward = MethodType(_rms_norm, layer)


def _rms_norm(self, hidden_states):
    """``LlamaRMSNormNet.forward`` with ``x * x`` for ``x.pow(2)``."""
    import paddle

    with paddle.amp.auto_cast(False):
        hidden = hidden_states.astype("float32")
        hidden_states = paddle.rsqrt((hidden * hidden).mean(-1, keepdim=True) + self.variance_epsilon) * hidden_states
    if self.weight.dtype in (paddle.float16, paddle.bfloat16):
        hidden_states = paddle.cast(hidden_states, self.weight.dtype)
    return hidden_states * self.weight


def _apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """PaddleNLP's ``apply_rotary_pos_emb`` with rotate-half as a matmul by :func:`_half_rotation`."""
    if position_ids is None:
        cos, sin = cos[:, : q.shape[1], :, :], sin[:, : q.shape[1], :, :]  # [1, seq_len, 1, dim]
    else:
        cos = cos.squeeze(axis=[0, 2])[position_ids].unsqueeze(2)  # [bs, seq_len, 1, dim]
        sin = sin.squeeze(axis=[0, 2])[position_ids].unsqueeze(2)
    rotation = _half_rotation(q.shape[-1], str(q.dtype))
    return q * cos + q.matmul(rotation) * sin, k * cos + k.matmul(rotation) * sin


@lru_cache(maxsize=8)
def _half_rotation(dim: int, dtype: str):
    """The ``[dim, dim]`` matrix ``R`` with ``x @ R == concat([-x[dim/2:], x[:dim/2]])``."""
    import paddle

    half = dim // 2
    rotation = np.zeros((dim, dim), dtype=np.float32)
    rotation[np.arange(half) + half, np.arange(half)] = -1.0
    rotation[np.arange(half), np.arange(half) + half] = 1.0
    return paddle.to_tensor(rotation).astype(dtype.removeprefix("paddle."))


def flops_per_token(shape: dict[str, Any], parameters: int, embedding: int, seq_length: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter (forward + backward) plus attention."""
    attention = 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq_length
    return 6 * (parameters - embedding) + attention
