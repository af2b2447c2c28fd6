"""The inference graphs: a checkpoint's weights in a compact Llama forward pass with a KV cache, saved for
Paddle Inference and, in a portable variant, as the source of the ONNX models.

Training uses the auto-parallel ``LlamaForCausalLMNet``, which ``paddle.jit.save`` cannot trace. The
checkpoint is loaded into PaddleNLP's plain ``LlamaForCausalLM`` (``train_deploy.training.evaluation.load_model``;
same parameter names, same logits), and ``CompactLlama`` computes the same logits from its weights with
fewer and cheaper operators: at batch 1 on CPU a decode step costs more in operators than in arithmetic
(each executed operator costs Paddle Inference ~2-5 µs whatever it computes), and Paddle's CPU elementwise
kernels are ~25× slower when they broadcast over a middle axis than on equal shapes.

* RMSNorm scales are folded into the next matrix product, and ``1/sqrt(head_dim)`` into the query's;
  grouped key/value heads (GQA) stay grouped: the query heads of one key head are rows of one product, so
  the cache holds ``num_key_value_heads`` heads, not one per query head;
* one product per layer gives Q, K, V and the rotated halves of Q and K: ``rotate_half(x)`` is ``x @ R``
  for a small signed permutation ``R`` (exact), folded into the weights (``W R``); rotary embeddings are
  then ``x * cos + (x R) * sin``, one multiply and one sum over a ``(cos, sin)`` axis, with cos/sin (and 1/0
  for V) gathered once per pass at each row's positions and spread to the product's width by an exact 0/1
  product;
* the causal and padding masks become one additive bias per pass, expanded once, shared by every layer;
* gate and up are one product; a decode step (one position) reshapes queries, keys and values straight
  into the attention layout, without transposes;
* each layer's cache is its own input and output, so a step neither slices nor stacks the whole cache.

Two variants of the same computation are traced (``CompactLlama.portable``): the fused graph
(:data:`FUSED_DIR`), with Paddle's fused CPU kernels: RMSNorm with the residual add in one operator
(``fused_rms_norm``) and ``swiglu``; and the portable graph (:data:`PORTABLE_DIR`), with the operators
paddle2onnx 2.1 converts (it has no converter for either) and every CPU runs: ``x * rsqrt(mean(x * x) +
eps)`` and ``swish(gate) * up``. Both are saved for Paddle Inference, and the ONNX models are converted
from the portable one: Paddle 3.3.1's CPU ``fused_rms_norm`` runs AVX-512 instructions on any CPU, so the
fused graph only runs where ``probe.py`` finds that it does (or on GPU). The
embedding is stored halved and added to itself by the first norm (exact), since the fused norm needs a
residual. Both variants have the same two graphs (int64 ids and masks, dynamic batch and
sequence):

* ``model`` (prefill, and the full pass that scores): ``(input_ids, attention_mask) -> (logits, keys_0, …,
  values_0, …)``, each cache ``[batch, kv_heads, seq, head_dim]``;
* ``decode``: one new token per row, ``(input_ids [batch, 1], attention_mask [batch, past + 1], keys_0, …,
  values_0, …) -> (logits [batch, 1, vocab], keys_0, …, values_0, …)``, each cache grown by one position
  (:func:`cache_names`).

Positions are ``cumsum(attention_mask) - 1`` per row, so a left-padded batch computes each prompt as it is
alone. The cache grows (``concat`` per layer) rather than being a fixed-size buffer written at a position:
a fixed buffer needs an in-place scatter (``set_value``/``put_along_axis``), which paddle2onnx converts into
a ``ScatterND`` over the whole buffer and neither engine updates in place through its plain Python API (ONNX
Runtime returns new outputs without I/O binding, a Paddle Inference output is a new tensor), so it would copy
the whole context every step instead of the grown length, and attend over masked empty slots too. ONNX Runtime's
server decode step is written apart, from the same weights, with ``GroupQueryAttention`` over a buffer updated in
place through I/O binding (``inplace.py``).
Padded keys are masked with ``finfo.min`` as PaddleNLP does. Configurations it does not implement
(``_SUPPORTED``) are refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.export.probe import KERNELS
from train_deploy.training.checkpoint import STATE_FILE, CheckpointError, checkpoint_state
from train_deploy.training.evaluation import load_model

SERVER_MODEL = "model"  # Paddle Inference writes model.json + model.pdiparams: the prefill (full) pass
DECODE_MODEL = "decode"  # decode.json + decode.pdiparams: one token with the cache
FUSED_DIR, PORTABLE_DIR = "server", "server_portable"  # a bundle's folders of the two variants
FUSED_KERNELS = tuple(KERNELS)  # the fused CPU kernels the fused graph calls: what probe.py tries
_MASKED = float(np.finfo(np.float32).min)  # additive bias of a masked key, as PaddleNLP's
_SUPPORTED = {"alibi": False, "rope_scaling_type": None, "use_long_sequence_strategies": False,
              "hidden_act": "silu", "fuse_attention_qkv": False, "fuse_attention_ffn": False}
# configuration keys the compact graph implements only at these values (the fused projections are other weights)


def load_inference_model(checkpoint: Path):
    """The traced graph: :class:`CompactLlama` with ``checkpoint``'s weights."""
    config = checkpoint_state(checkpoint).model_config or {}
    for key, value in _SUPPORTED.items():
        if config.get(key, value) != value:
            raise CheckpointError(f"{Path(checkpoint) / STATE_FILE}: model_config.{key} = {config[key]!r} is not "
                                  f"supported by the export graph (only {value!r})")
    return compact_model(load_model(checkpoint))


def compact_model(reference):
    """:class:`CompactLlama` computing ``reference``'s logits (module docstring); its own weights, eval mode.

    Its ``forward`` is the prefill graph, ``(input_ids, attention_mask) -> (logits, keys_0, …, values_0, …)``;
    its ``decode`` method (saved through :func:`decode_model`) is the one-token step with the cache. Its
    ``portable`` attribute, read when a graph is traced, picks the operators (module docstring): False (Paddle's
    fused CPU kernels) for Paddle Inference, True (operators paddle2onnx converts) for ONNX.
    """
    import paddle

    config = reference.config
    weights = _compact_weights(reference)

    class CompactLlama(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.eps, self.layers, self.portable = config.rms_norm_eps, len(reference.llama.layers), False
            for name, value in weights.items():
                self.add_parameter(name, self.create_parameter(
                    list(value.shape), dtype="float32", default_initializer=paddle.nn.initializer.Assign(value)))

        def forward(self, input_ids, attention_mask):
            """Prefill: logits ``[batch, seq, vocab]``, then each layer's keys, then each layer's values
            ``[batch, kv_heads, seq, head_dim]``.

            Each row's positions count its unmasked tokens (``cumsum(mask) - 1``), so a left-padded prompt is
            computed as it is alone; right padding (scoring) is never attended to by the causal rows before it."""
            seq = paddle.shape(input_ids)[1]
            positions = (paddle.cumsum(attention_mask, axis=-1) - 1) * attention_mask
            step = paddle.arange(seq)
            keep = paddle.logical_and((step.unsqueeze(1) >= step.unsqueeze(0)).unsqueeze(0),
                                      attention_mask.unsqueeze(1).astype("bool"))  # [batch, query, key]
            bias = _attention_bias(self, paddle.where(keep, paddle.zeros([1], "float32"),
                                                      paddle.full([1], _MASKED, "float32")), seq)
            return _passes(self, input_ids, positions, bias, None)

        def decode(self, input_ids, attention_mask, *cache):
            """One new token per row: ``input_ids`` ``[batch, 1]``, ``attention_mask`` ``[batch, past + 1]`` (the
            cache's mask and the new token's), ``cache`` each layer's keys then each layer's values ``[batch,
            kv_heads, past, head_dim]``; returns the new token's logits ``[batch, 1, vocab]`` and the caches
            grown by its keys and values, in the same order."""
            positions = attention_mask.sum(-1, keepdim=True) - 1  # [batch, 1]
            # 1 -> 0 and 0 -> finfo.min in one operator: x * finfo.max + finfo.min is exact for both
            bias = paddle.scale(attention_mask.astype("float32"), scale=-_MASKED, bias=_MASKED)
            # [batch, kv, group, keys] with static sizes (-1: kept), so no shape is computed at run time
            bias = bias.unsqueeze([1, 2]).expand([-1, self.kv_heads, self.heads // self.kv_heads, -1])
            return _passes(self, input_ids, positions, bias, cache)

    model = CompactLlama()
    model.eval()
    return model


def _passes(model, input_ids, positions, bias, cache):
    """The layers over the embedded ``input_ids``: ``(logits, keys…, values…)``; ``cache`` is None (prefill) or the
    decode step's past keys then values, one per layer."""
    import paddle
    import paddle.nn.functional as F

    rope = paddle.matmul(F.embedding(positions, model.rope), model.rope_expand)
    rope = rope.reshape(_qkv_layout(model, cache is not None))
    # half the embedding, added to itself (exact) by the first norm: Paddle's fused norm needs a residual
    x = F.embedding(input_ids, model.embed_half)
    residual, keys, values = x, [], []
    for i in range(model.layers):
        past = None if cache is None else (cache[i], cache[model.layers + i])
        y, residual = _norm(model, x, residual)
        x, k, v = _attention(model, i, y, rope, bias, past)
        y, residual = _norm(model, x, residual)
        x = paddle.matmul(_swiglu(model, paddle.matmul(y, getattr(model, f"gate_up_{i}"))), getattr(model, f"down_{i}"))
        keys.append(k)
        values.append(v)
    y, _ = _norm(model, x, residual)
    return paddle.matmul(y, model.lm_head), *keys, *values


def _norm(model, x, residual):
    """RMSNorm of ``x + residual`` (scale folded into the next product) and that sum, the next residual."""
    import paddle

    if not model.portable:  # Paddle's fused kernel (fused_rms_norm_quant, CPU and GPU): add and norm in one
        from paddle.incubate.nn.functional import fused_rms_norm

        return fused_rms_norm(x, model.norm_ones, None, model.eps, 2, residual=residual)
    x = x + residual
    return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + model.eps), x


def _swiglu(model, gate_up):
    """``silu(gate) * up`` of the fused product ``[gate | up]``: Paddle's ``swiglu`` kernel, or for ONNX (no
    converter for it) ``swish`` times the other half."""
    import paddle
    import paddle.nn.functional as F

    if not model.portable:
        return F.swiglu(gate_up)
    gate, up = paddle.split(gate_up, 2, axis=-1)
    return F.swish(gate) * up


def _attention(model, i, y, rope, bias, past):
    """Attention of layer ``i`` on the normed ``y`` ``[batch, seq, hidden]``: its output projection, and the
    layer's keys and values ``[batch, kv_heads, seq, hd]`` (grown by ``past`` in a decode step).

    One product gives Q, K and V and their rotated halves (``W @ R``, exact); ``rope`` weighs them as
    ``x * cos + (x @ R) * sin`` (V by 1 and 0). Grouped attention without repeating keys: the ``group`` query
    heads of a key head are rows of one product."""
    import paddle
    import paddle.nn.functional as F

    heads, kv, hd = model.heads, model.kv_heads, model.head_dim
    qkv = paddle.matmul(y, getattr(model, f"qkv_{i}")).reshape(_qkv_layout(model, past is not None))
    if past is not None:  # one position: already [batch, heads, 1, hd], the attention layout, without a transpose
        q, k, v = paddle.split((qkv * rope).sum(1), [heads, kv, kv], axis=1)
        q = q if heads == kv else q.reshape([0, kv, heads // kv, hd])
        k, v = paddle.concat([past[0], k], axis=2), paddle.concat([past[1], v], axis=2)
    else:  # no arithmetic on shapes (-1 instead): ONNX shape inference turns an unknown dimension times 2 into -2
        q, k, v = paddle.split((qkv * rope).sum(2), [heads * hd, kv * hd, kv * hd], axis=-1)
        q = q.reshape([0, 0, heads, hd]).transpose([0, 2, 1, 3]).reshape([0, kv, -1, hd])
        k, v = (t.reshape([0, 0, kv, hd]).transpose([0, 2, 1, 3]) for t in (k, v))
    scores = paddle.matmul(q, k, transpose_y=True)
    scores = F.softmax(scores + bias, axis=-1)
    attended = paddle.matmul(scores, v)
    if past is not None:
        attended = attended.reshape([0, 1, heads * hd])
    else:
        attended = attended.reshape([0, heads, -1, hd]).transpose([0, 2, 1, 3]).reshape([0, 0, heads * hd])
    return paddle.matmul(attended, getattr(model, f"o_{i}")), k, v


def _qkv_layout(model, decode: bool) -> list[int]:
    """The shape of a layer's product ``[q, k, v, q R, k R, 0]`` (and of ``rope``) with its ``(cos, sin)`` axis:
    ``[batch, 2, heads + 2 kv, 1, hd]`` in a decode step, ``[batch, seq, 2, (heads + 2 kv) hd]`` otherwise."""
    width = model.heads + 2 * model.kv_heads
    return [0, 2, width, 1, model.head_dim] if decode else [0, 0, 2, width * model.head_dim]


def _attention_bias(model, bias, queries):
    """The prefill's additive ``bias`` ``[batch, queries, keys]`` expanded once per pass to the scores' shape,
    ``[batch, kv, group * queries, keys]``: same-shape adds are Paddle's fast kernels."""
    import paddle

    batch, keys = paddle.shape(bias)[0], paddle.shape(bias)[2]
    group = model.heads // model.kv_heads
    bias = bias.unsqueeze([1, 2]).expand([batch, model.kv_heads, group, queries, keys])
    return bias.reshape([0, 0, -1, keys])


def decode_model(model):
    """A layer whose ``forward`` is ``model.decode`` (sharing its parameters), for ``paddle.jit.save``."""
    import paddle

    class DecodeStep(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, keys, values):  # the caches: lists, one tensor per layer
            return self.model.decode(input_ids, attention_mask, *keys, *values)

    step = DecodeStep()
    step.eval()
    return step


def _compact_weights(reference) -> dict[str, np.ndarray]:
    """:class:`CompactLlama`'s parameters from ``reference``'s weights, norms and scales folded in (float32)."""
    config, llama = reference.config, reference.llama
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    rotate = _rotate_half_matrix(head_dim)
    weights = {"embed_half": _array(llama.embed_tokens.weight) / 2, "norm_ones": np.ones(config.hidden_size)}
    for i, layer in enumerate(llama.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q = _array(attn.q_proj.weight) / math.sqrt(head_dim)
        k, v = _array(attn.k_proj.weight), _array(attn.v_proj.weight)  # kv_heads wide: grouped in attention
        qk = np.concatenate([q, k], 1)
        turned = (qk.reshape(len(qk), heads + kv, head_dim) @ rotate).reshape(qk.shape)  # rotate_half per head
        norm = _array(layer.input_layernorm.weight)[:, None]
        weights[f"qkv_{i}"] = norm * np.concatenate([qk, v, turned, np.zeros_like(v)], 1)
        weights[f"o_{i}"] = _array(attn.o_proj.weight)
        norm = _array(layer.post_attention_layernorm.weight)[:, None]
        weights[f"gate_up_{i}"] = norm * np.concatenate([_array(mlp.gate_proj.weight), _array(mlp.up_proj.weight)], 1)
        weights[f"down_{i}"] = _array(mlp.down_proj.weight)
    head = _array(reference.lm_head.weight)
    head = head.T if reference.lm_head.transpose_y else head  # tied to the embedding: [vocab, hidden]
    weights["lm_head"] = _array(llama.norm.weight)[:, None] * head
    cos, sin = _rotary_tables(config.max_position_embeddings, head_dim, config.rope_theta)
    weights["rope"] = np.concatenate([cos, sin, np.ones((len(cos), 1))], 1)  # gathered by position
    weights["rope_expand"] = _rope_expansion(head_dim, heads + kv, kv)
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in weights.items()}


def _rope_expansion(head_dim: int, rotated: int, plain: int) -> np.ndarray:
    """``E`` with ``[cos, sin, 1] @ E`` = the weights of one layer's product ``[q, k, v, q R, k R, 0]``: cos (then
    sin) for each of the ``rotated`` heads, 1 (then 0) for the ``plain`` (value) heads. Each output is one
    input times 1, so the product is exact."""
    width = (rotated + plain) * head_dim
    expand = np.zeros((2 * head_dim + 1, 2 * width), np.float32)
    for part in range(2):
        for head in range(rotated):
            columns = part * width + head * head_dim + np.arange(head_dim)
            expand[part * head_dim + np.arange(head_dim), columns] = 1.0
    expand[2 * head_dim, rotated * head_dim:width] = 1.0
    return expand


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


def save_server_model(model, folder: Path, *, portable: bool = False) -> Path:
    """Trace ``model``'s prefill and decode graphs with dynamic batch and sequence axes and save them for Paddle
    Inference (:data:`SERVER_MODEL`, :data:`DECODE_MODEL`); return the prefill's prefix. ``portable``: with the
    operators paddle2onnx converts (the source of the ONNX models), not Paddle's fused kernels."""
    import paddle

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / SERVER_MODEL
    model.portable = portable
    try:
        spec = [paddle.static.InputSpec([None, None], "int64", "input_ids"),
                paddle.static.InputSpec([None, None], "int64", "attention_mask")]
        paddle.jit.save(model, str(prefix), input_spec=spec)
        shape, names = [None, model.kv_heads, None, model.head_dim], cache_names(model.layers)
        cache = [paddle.static.InputSpec(shape, "float32", name) for name in names]
        spec = [paddle.static.InputSpec([None, 1], "int64", "input_ids"),
                paddle.static.InputSpec([None, None], "int64", "attention_mask"),
                cache[:model.layers], cache[model.layers:]]
        paddle.jit.save(decode_model(model), str(folder / DECODE_MODEL), input_spec=spec)
    finally:
        model.portable = False
    return prefix


def cache_names(layers: int) -> list[str]:
    """Names of the decode graph's cache inputs (and of the caches both graphs return, in this order)."""
    return [f"keys_{i}" for i in range(layers)] + [f"values_{i}" for i in range(layers)]


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
