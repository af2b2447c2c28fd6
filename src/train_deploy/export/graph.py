"""The inference graphs: a checkpoint's weights in a compact Llama forward pass with a KV cache, saved for
Paddle Inference.

Training uses the auto-parallel ``LlamaForCausalLMNet``, which ``paddle.jit.save`` cannot trace. The
checkpoint is loaded into PaddleNLP's plain ``LlamaForCausalLM`` (``train_deploy.evaluation.load_model``;
same parameter names, same logits), and ``CompactLlama`` computes the same logits from its weights with
fewer and cheaper operators: at batch 1 on CPU an inference pass costs more in small operators than in
arithmetic, and Paddle's CPU elementwise kernels are ~25× slower when they broadcast over a middle axis
than on equal shapes.

* RMSNorm scales are folded into the next matrix product, and ``1/sqrt(head_dim)`` into the query's;
  Q, K and V come from one product; grouped key/value heads (GQA) stay grouped: the query heads of one key
  head are rows of one product, so the cache holds ``num_key_value_heads`` heads, not one per query head;
* rotary embeddings: ``rotate_half(x)`` is ``x @ R`` for a small signed permutation ``R`` (exact), applied
  to queries and keys together; cos/sin are gathered once per pass at each row's positions and expanded to
  the full shape, so there is no slice, concat or broadcasting multiply per layer;
* the causal and padding masks become one additive bias per pass, expanded once, shared by every layer;
* ``silu(gate) * up`` uses the portable ``swish`` kernel (paddle2onnx has no converter for the fused
  ``swiglu``; fusing gate and up into one product measured 0.8 ms slower) and RMSNorm squares with
  ``x * x`` (``pow`` is a slow generic kernel on CPU).

Two graphs are saved, and converted to ONNX alike (int64 ids and masks, dynamic batch and sequence):

* ``model`` (prefill, and the full pass that scores): ``(input_ids, attention_mask) -> (logits, keys,
  values)``, the caches ``[layers, batch, kv_heads, seq, head_dim]``;
* ``decode``: one new token per row, ``(input_ids [batch, 1], attention_mask [batch, past + 1], keys,
  values) -> (logits [batch, 1, vocab], keys, values)`` with the caches grown by one position.

Positions are ``cumsum(attention_mask) - 1`` per row, so a left-padded batch computes each prompt as it is
alone. The cache grows (``concat`` per layer) rather than being a fixed-size buffer written at a position:
a fixed buffer needs an in-place scatter (``set_value``/``put_along_axis``), which paddle2onnx converts into
a ``ScatterND`` over the whole buffer and neither engine updates in place through its plain Python API (ONNX
Runtime returns new outputs without I/O binding, a Paddle Inference output is copied out), so it would copy
the whole context every step instead of the grown length, and attend over masked empty slots too.
Padded keys are masked with ``finfo.min`` as PaddleNLP does. Configurations it does not implement
(``_SUPPORTED``) are refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.evaluation import load_model
from train_deploy.training.checkpoint import STATE_FILE, CheckpointError, read_state

SERVER_MODEL = "model"  # Paddle Inference writes model.json + model.pdiparams: the prefill (full) pass
DECODE_MODEL = "decode"  # decode.json + decode.pdiparams: one token with the cache
_MASKED = float(np.finfo(np.float32).min)  # additive bias of a masked key, as PaddleNLP's
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
    """:class:`CompactLlama` computing ``reference``'s logits (module docstring); its own weights, eval mode.

    Its ``forward`` is the prefill graph, ``(input_ids, attention_mask) -> (logits, keys, values)``; its
    ``decode`` method (saved through :func:`decode_model`) is the one-token step with the cache.
    """
    import paddle
    import paddle.nn.functional as F

    config = reference.config
    weights = _compact_weights(reference)

    class CompactLlama(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.eps, self.layers = config.rms_norm_eps, len(reference.llama.layers)
            for name, value in weights.items():
                self.add_parameter(name, self.create_parameter(
                    list(value.shape), dtype="float32", default_initializer=paddle.nn.initializer.Assign(value)))

        def _norm(self, x):
            return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)

        def _layer(self, i, x, rope, bias, past_k=None, past_v=None):
            qkv = paddle.matmul(self._norm(x), getattr(self, f"qkv_{i}"))
            q, k, v = _rotated(self, qkv, rope)
            if past_k is not None:
                k, v = paddle.concat([past_k, k], axis=2), paddle.concat([past_v, v], axis=2)
            x = x + paddle.matmul(_attend(self, q, k, v, bias), getattr(self, f"o_{i}"))
            y = self._norm(x)
            gate, up = paddle.matmul(y, getattr(self, f"gate_{i}")), paddle.matmul(y, getattr(self, f"up_{i}"))
            return x + paddle.matmul(F.swish(gate) * up, getattr(self, f"down_{i}")), k, v

        def forward(self, input_ids, attention_mask):
            """Prefill: logits ``[batch, seq, vocab]``, keys and values ``[layers, batch, kv_heads, seq, hd]``.

            Each row's positions count its unmasked tokens (``cumsum(mask) - 1``), so a left-padded prompt is
            computed as it is alone; right padding (scoring) is never attended to by the causal rows before it."""
            seq = paddle.shape(input_ids)[1]
            positions = (paddle.cumsum(attention_mask, axis=-1) - 1) * attention_mask
            step = paddle.arange(seq)
            keep = paddle.logical_and((step.unsqueeze(1) >= step.unsqueeze(0)).unsqueeze(0),
                                      attention_mask.unsqueeze(1).astype("bool"))  # [batch, query, key]
            bias, rope = _attention_bias(self, keep, seq), _rope(self, positions)
            x, keys, values = F.embedding(input_ids, self.embed), [], []
            for i in range(self.layers):
                x, k, v = self._layer(i, x, rope, bias)
                keys.append(k)
                values.append(v)
            return paddle.matmul(self._norm(x), self.lm_head), paddle.stack(keys), paddle.stack(values)

        def decode(self, input_ids, attention_mask, keys, values):
            """One new token per row: ``input_ids`` ``[batch, 1]``, ``attention_mask`` ``[batch, past + 1]`` (the
            cache's mask and the new token's), ``keys``/``values`` ``[layers, batch, kv_heads, past, hd]``; returns
            the new token's logits ``[batch, 1, vocab]`` and the caches grown by its keys and values."""
            positions = attention_mask.sum(-1, keepdim=True) - 1  # [batch, 1]
            bias, rope = _attention_bias(self, attention_mask.unsqueeze(1).astype("bool"), 1), _rope(self, positions)
            x, new_keys, new_values = F.embedding(input_ids, self.embed), [], []
            for i in range(self.layers):
                x, k, v = self._layer(i, x, rope, bias, keys[i], values[i])
                new_keys.append(k)
                new_values.append(v)
            return paddle.matmul(self._norm(x), self.lm_head), paddle.stack(new_keys), paddle.stack(new_values)

    model = CompactLlama()
    model.eval()
    return model


def _rope(model, positions):
    """cos and sin at ``positions`` ``[batch, seq]``, expanded once per pass to the shape of queries and keys
    together, ``[batch, seq, heads + kv_heads, hd]`` (``expand``, not ``expand_as``: the latter leaves -1
    dimensions in the ONNX graph)."""
    import paddle
    import paddle.nn.functional as F

    shape = [paddle.shape(positions)[0], paddle.shape(positions)[1], model.heads + model.kv_heads, model.head_dim]
    return (F.embedding(positions, model.cos).unsqueeze(2).expand(shape),
            F.embedding(positions, model.sin).unsqueeze(2).expand(shape))


def _rotated(model, qkv, rope):
    """Queries ``[batch, seq, heads, hd]``, keys and values ``[batch, kv_heads, seq, hd]`` of ``model``'s layer
    output ``qkv``, rotated by ``rope`` (:func:`_rope`) as ``x * cos + (x @ R) * sin``."""
    import paddle

    heads, kv, hd = model.heads, model.kv_heads, model.head_dim
    qk = qkv[:, :, :(heads + kv) * hd].reshape([0, 0, heads + kv, hd])
    qk = qk * rope[0] + paddle.matmul(qk, model.rotate_half) * rope[1]
    v = qkv[:, :, (heads + kv) * hd:].reshape([0, 0, kv, hd]).transpose([0, 2, 1, 3])
    return qk[:, :, :heads], qk[:, :, heads:].transpose([0, 2, 1, 3]), v


def _attend(model, q, k, v, bias):
    """Grouped attention without repeating keys: the ``group`` query heads of a key head are rows of one
    product. ``q`` ``[batch, seq, heads, hd]``, ``bias`` ``[batch, kv, group * seq, keys]``."""
    import paddle
    import paddle.nn.functional as F

    # no arithmetic on shapes (-1 instead): ONNX shape inference turns an unknown dimension times 2 into -2
    q = q.transpose([0, 2, 1, 3]).reshape([0, model.kv_heads, -1, model.head_dim])
    scores = F.softmax(paddle.matmul(q, k, transpose_y=True) + bias, axis=-1)
    attended = paddle.matmul(scores, v).reshape([0, model.heads, -1, model.head_dim])
    return attended.transpose([0, 2, 1, 3]).reshape([0, 0, model.heads * model.head_dim])


def _attention_bias(model, keep, queries):
    """``keep`` ``[batch, queries, keys]`` as an additive bias ``[batch, kv, group * queries, keys]``."""
    import paddle

    batch, keys = paddle.shape(keep)[0], paddle.shape(keep)[2]
    group = model.heads // model.kv_heads
    bias = paddle.where(keep, paddle.zeros([1], "float32"), paddle.full([1], _MASKED, "float32"))
    bias = bias.unsqueeze([1, 2]).expand([batch, model.kv_heads, group, queries, keys])
    return bias.reshape([0, 0, -1, keys])  # same-shape adds: fast kernels


def decode_model(model):
    """A layer whose ``forward`` is ``model.decode`` (sharing its parameters), for ``paddle.jit.save``."""
    import paddle

    class DecodeStep(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, keys, values):
            return self.model.decode(input_ids, attention_mask, keys, values)

    step = DecodeStep()
    step.eval()
    return step


def _compact_weights(reference) -> dict[str, np.ndarray]:
    """:class:`CompactLlama`'s parameters from ``reference``'s weights, norms and scales folded in (float32)."""
    config, llama = reference.config, reference.llama
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    weights = {"embed": _array(llama.embed_tokens.weight)}
    for i, layer in enumerate(llama.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q = _array(attn.q_proj.weight) / math.sqrt(head_dim)
        k, v = _array(attn.k_proj.weight), _array(attn.v_proj.weight)  # kv_heads wide: grouped in attention
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
    weights["cos"], weights["sin"] = cos, sin  # [position, head_dim], gathered by position
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


def _rotary_tables(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """PaddleNLP's ``LlamaRotaryEmbedding`` cos/sin tables ``[positions, head_dim]`` (computed in float32)."""
    import paddle

    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2).astype("float32") / head_dim))
    freqs = paddle.einsum("i,j->ij", paddle.arange(positions, dtype="float32"), inv_freq)
    emb = paddle.concat([freqs, freqs], axis=-1)
    return emb.cos().numpy(), emb.sin().numpy()


def save_server_model(model, folder: Path) -> Path:
    """Trace ``model``'s prefill and decode graphs with dynamic batch and sequence axes and save them for Paddle
    Inference (:data:`SERVER_MODEL`, :data:`DECODE_MODEL`); return the prefill's prefix."""
    import paddle

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / SERVER_MODEL
    spec = [paddle.static.InputSpec([None, None], "int64", "input_ids"),
            paddle.static.InputSpec([None, None], "int64", "attention_mask")]
    paddle.jit.save(model, str(prefix), input_spec=spec)
    cache = [model.layers, None, model.kv_heads, None, model.head_dim]
    spec = [paddle.static.InputSpec([None, 1], "int64", "input_ids"),
            paddle.static.InputSpec([None, None], "int64", "attention_mask"),
            paddle.static.InputSpec(cache, "float32", "keys"), paddle.static.InputSpec(cache, "float32", "values")]
    paddle.jit.save(decode_model(model), str(folder / DECODE_MODEL), input_spec=spec)
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
