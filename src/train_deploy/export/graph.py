"""The inference graph: a checkpoint's weights in a compact Llama forward pass, saved for Paddle Inference.

Training uses the auto-parallel ``LlamaForCausalLMNet``, which ``paddle.jit.save`` cannot trace. The
checkpoint is loaded into PaddleNLP's plain ``LlamaForCausalLM`` (``train_deploy.evaluation.load_model``;
same parameter names, same logits), and ``CompactLlama`` computes the same logits from its weights with
fewer and cheaper operators: at batch 1 on CPU an inference pass costs more in small operators than in
arithmetic, and Paddle's CPU elementwise kernels are ~25× slower when they broadcast over a middle axis
than on equal shapes.

* RMSNorm scales are folded into the next matrix product, and ``1/sqrt(head_dim)`` into the query's;
  Q, K and V come from one product (grouped key/value heads are repeated in the weights);
* rotary embeddings: ``rotate_half(x)`` is ``x @ R`` for a small signed permutation ``R`` (exact), applied
  to queries and keys together; cos/sin are expanded once per pass to the full shape, so there is no
  gather, slice, concat or broadcasting multiply per layer;
* the causal and padding masks become one additive bias per pass, expanded once, shared by every layer;
* ``silu(gate) * up`` uses the portable ``swish`` kernel (paddle2onnx has no converter for the fused
  ``swiglu``; fusing gate and up into one product measured 0.8 ms slower) and RMSNorm squares with
  ``x * x`` (``pow`` is a slow generic kernel on CPU).

The same graph is converted to ONNX. It takes ``input_ids`` and ``attention_mask`` (int64, dynamic
batch and sequence) and returns float32 logits, without a KV cache; padded keys are masked with
``finfo.min`` as PaddleNLP does. Configurations it does not implement (``_SUPPORTED``) are refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.evaluation import load_model
from train_deploy.training.checkpoint import STATE_FILE, CheckpointError, read_state

SERVER_MODEL = "model"  # Paddle Inference writes model.json + model.pdiparams
_SUPPORTED = {"alibi": False, "rope_scaling_type": None, "use_long_sequence_strategies": False,
              "hidden_act": "silu", "fuse_attention_qkv": False, "fuse_attention_ffn": False}
# configuration keys the compact graph implements only at these values (the fused projections are other weights)


def load_inference_model(checkpoint: Path):
    """The traced graph: :class:`CompactLlama` with ``checkpoint``'s weights."""
    config = read_state(checkpoint)["model_config"]
    for key, value in _SUPPORTED.items():
        if config.get(key, value) != value:
            raise CheckpointError(f"{Path(checkpoint) / STATE_FILE}: model_config.{key} = {config[key]!r} is not "
                                  f"supported by the export graph (only {value!r})")
    return compact_model(load_model(checkpoint))


def compact_model(reference):
    """:class:`CompactLlama` computing ``reference``'s logits (module docstring); its own weights, eval mode."""
    import paddle
    import paddle.nn.functional as F

    config = reference.config
    weights = _compact_weights(reference)

    class CompactLlama(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.heads = config.num_attention_heads
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.eps, self.layers = config.rms_norm_eps, len(reference.llama.layers)
            for name, value in weights.items():
                self.add_parameter(name, self.create_parameter(
                    list(value.shape), dtype="float32", default_initializer=paddle.nn.initializer.Assign(value)))

        def _norm(self, x):
            return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)

        def forward(self, input_ids, attention_mask):
            batch, seq = paddle.shape(input_ids)[0], paddle.shape(input_ids)[1]
            heads, head_dim, width = self.heads, self.head_dim, self.heads * self.head_dim
            position = paddle.arange(seq)
            keep = paddle.logical_and((position.unsqueeze(1) >= position.unsqueeze(0)).unsqueeze(0),
                                      attention_mask.unsqueeze(1).astype("bool"))  # [batch, query, key]
            bias = paddle.where(keep, paddle.zeros([1], "float32"),
                                paddle.full([1], float(np.finfo(np.float32).min), "float32"))
            bias = bias.unsqueeze(1).expand([batch, heads, seq, seq])  # same-shape adds are the fast kernels
            cos = self.cos[:seq].unsqueeze(0).expand([batch, seq, 2 * heads, head_dim])  # queries and keys
            sin = self.sin[:seq].unsqueeze(0).expand([batch, seq, 2 * heads, head_dim])

            x = F.embedding(input_ids, self.embed)
            for i in range(self.layers):
                qkv = paddle.matmul(self._norm(x), getattr(self, f"qkv_{i}"))
                qk = qkv[:, :, :2 * width].reshape([0, 0, 2 * heads, head_dim])
                qk = qk * cos + paddle.matmul(qk, self.rotate_half) * sin
                q, k = qk.reshape([0, 0, 2, heads, head_dim]).transpose([2, 0, 3, 1, 4]).unbind(0)
                v = qkv[:, :, 2 * width:].reshape([0, 0, heads, head_dim]).transpose([0, 2, 1, 3])
                scores = F.softmax(paddle.matmul(q, k, transpose_y=True) + bias, axis=-1)
                attended = paddle.matmul(scores, v).transpose([0, 2, 1, 3]).reshape([0, 0, width])
                x = x + paddle.matmul(attended, getattr(self, f"o_{i}"))
                y = self._norm(x)
                gate, up = paddle.matmul(y, getattr(self, f"gate_{i}")), paddle.matmul(y, getattr(self, f"up_{i}"))
                x = x + paddle.matmul(F.swish(gate) * up, getattr(self, f"down_{i}"))
            return paddle.matmul(self._norm(x), self.lm_head)

    model = CompactLlama()
    model.eval()
    return model


def _compact_weights(reference) -> dict[str, np.ndarray]:
    """:class:`CompactLlama`'s parameters from ``reference``'s weights, norms and scales folded in (float32)."""
    config, llama = reference.config, reference.llama
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    weights = {"embed": _array(llama.embed_tokens.weight)}
    for i, layer in enumerate(llama.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q = _array(attn.q_proj.weight) / math.sqrt(head_dim)
        k = _repeat_heads(_array(attn.k_proj.weight), config.num_key_value_heads, heads)
        v = _repeat_heads(_array(attn.v_proj.weight), config.num_key_value_heads, heads)
        norm = _array(layer.input_layernorm.weight)[:, None]
        weights[f"qkv_{i}"] = norm * np.concatenate([q, k, v], 1)
        weights[f"o_{i}"] = _array(attn.o_proj.weight)
        norm = _array(layer.post_attention_layernorm.weight)[:, None]
        weights[f"gate_{i}"] = norm * _array(mlp.gate_proj.weight)
        weights[f"up_{i}"] = norm * _array(mlp.up_proj.weight)
        weights[f"down_{i}"] = _array(mlp.down_proj.weight)
    head = _array(reference.lm_head.weight)
    head = head.T if reference.lm_head.transpose_y else head  # tied to the embedding: [vocab, hidden]
    weights["lm_head"] = _array(llama.norm.weight)[:, None] * head
    cos, sin = _rotary_tables(config.max_position_embeddings, head_dim, config.rope_theta)
    weights["cos"], weights["sin"] = cos[:, None, :], sin[:, None, :]  # [position, 1, head_dim]
    weights["rotate_half"] = _rotate_half_matrix(head_dim)
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in weights.items()}


def _array(parameter) -> np.ndarray:
    return parameter.numpy().astype(np.float32)


def _rotate_half_matrix(head_dim: int) -> np.ndarray:
    """``R`` with ``x @ R == rotate_half(x) == concat(-x[half:], x[:half])``: a signed permutation, exact."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


def _repeat_heads(w: np.ndarray, kv_heads: int, heads: int) -> np.ndarray:
    """Grouped key/value heads repeated to one per query head, as PaddleNLP's ``repeat_kv`` does at run time."""
    rows = w.shape[0]
    return np.repeat(w.reshape(rows, kv_heads, 1, -1), heads // kv_heads, axis=2).reshape(rows, -1)


def _rotary_tables(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """PaddleNLP's ``LlamaRotaryEmbedding`` cos/sin tables ``[positions, head_dim]`` (computed in float32)."""
    import paddle

    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2).astype("float32") / head_dim))
    freqs = paddle.einsum("i,j->ij", paddle.arange(positions, dtype="float32"), inv_freq)
    emb = paddle.concat([freqs, freqs], axis=-1)
    return emb.cos().numpy(), emb.sin().numpy()


def save_server_model(model, folder: Path) -> Path:
    """Trace ``model`` with dynamic batch and sequence axes and save it for Paddle Inference; return the prefix."""
    import paddle

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / SERVER_MODEL
    spec = [paddle.static.InputSpec([None, None], "int64", "input_ids"),
            paddle.static.InputSpec([None, None], "int64", "attention_mask")]
    paddle.jit.save(model, str(prefix), input_spec=spec)
    return prefix


def operator_names(prefix: Path) -> set[str]:
    """Names of every operator in a saved inference program (``pd_op.matmul``, …), sub-blocks included."""
    import paddle

    names: set[str] = set()

    def walk(block) -> None:
        for op in block.ops:
            names.add(op.name())
            for sub in op.blocks():
                walk(sub)

    with paddle.pir_utils.IrGuard():
        paddle.enable_static()
        try:
            program, _, _ = paddle.static.load_inference_model(str(prefix), paddle.static.Executor(paddle.CPUPlace()))
            walk(program.global_block())
        finally:
            paddle.disable_static()
    return names


def eager_logits(model, input_ids, attention_mask=None) -> Any:
    """Logits of an eager model (``LlamaForCausalLM`` or the training ``LlamaForCausalLMNet``) as numpy."""
    import paddle

    with paddle.no_grad():
        ids = paddle.to_tensor(input_ids)
        kwargs = {} if attention_mask is None else {"attention_mask": paddle.to_tensor(attention_mask)}
        out = model(input_ids=ids, **kwargs)
        logits = out[0] if isinstance(out, tuple | list) else out
        return logits.astype("float32").numpy()
