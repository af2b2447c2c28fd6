"""The decode step for ONNX Runtime with its key/value cache updated in place.

The decode graph converted from Paddle (``graph.py``) takes each layer's cache and returns it grown by one
position: every step reads and writes the whole cache (a ``Concat`` per layer, 32% of a 16-sequence step at 224
cached positions, docs/benchmarks.md). ONNX Runtime GenAI avoids the copy with ``GroupQueryAttention`` (a
``com.microsoft`` operator) over one preallocated buffer per layer that is both the past and the present: bound
as the same memory through I/O binding, the operator writes the new token's key and value at each row's length and
attends over that row's own positions only. This module writes that graph from the same folded weights as the
compact graph (:func:`inplace_decode_model`), with the same operators around the attention, so its logits are
those of the converted decode graph to rounding.

Inputs: ``input_ids`` ``[batch, 1]`` int64; ``past_lengths`` ``[batch]`` int32, each row's cached positions
(its new token's position, and where its key and value are written); ``total_length`` int32, the largest past
length plus one; ``keys_<i>`` and ``values_<i>`` ``[batch, kv_heads, capacity, head_dim]``, each row's positions
from 0 (no padding: rows are not left-aligned as in the growing cache). Outputs: ``logits`` ``[batch, 1, vocab]``
and ``present_keys_<i>``/``present_values_<i>``, bound to the same buffers (``kv_cache.SlotCache``).

Paddle Inference has no such step: a predictor copies every fed tensor before an in-place operator
(``put_along_axis_``) writes it (checked with Paddle 3.3.1, ``share_external_data`` too), so the Paddle graphs keep
the growing cache. The query is pre-scaled by ``1/sqrt(head_dim)`` in the weights, so the operator's scale is 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

INPLACE_DECODE = "decode_inplace"
"""The graph's file stem in ``edge/``: ``decode_inplace.onnx`` and, int8, ``decode_inplace.int8.onnx``."""
_MS = "com.microsoft"


def inplace_decode_model(weights: dict[str, np.ndarray], *, heads: int, kv_heads: int, eps: float) -> Any:
    """The in-place decode graph (module docstring) of ``CompactLlama``'s folded ``weights`` (``graph.py``)."""
    import onnx
    from onnx import TensorProto, helper

    layers = sum(1 for name in weights if name.startswith("qkv_"))
    hidden, vocab = weights["embed_half"].shape[1], weights["lm_head"].shape[1]
    head_dim = hidden // heads
    width = (heads + 2 * kv_heads) * head_dim
    g = _Graph()
    for name in ["embed_half", "norm_ones", "lm_head", "rope", "rope_expand",
                 *(f"{part}_{i}" for i in range(layers) for part in ("qkv", "o", "gate_up", "down"))]:
        g.constant(name, weights[name])
    g.constant("rope_shape", np.array([0, 2, width], np.int64))
    g.constant("axis_1", np.array([1], np.int64))
    g.constant("split_qkv", np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))
    positions = g.op("Unsqueeze", [g.op("Cast", ["past_lengths"], to=TensorProto.INT64), "axis_1"])
    rope = g.op("Reshape", [g.op("MatMul", [g.op("Gather", ["rope", positions]), "rope_expand"]), "rope_shape"])
    x = residual = g.op("Gather", ["embed_half", "input_ids"])  # half the embedding, added to itself by the first norm
    for i in range(layers):
        y, residual = g.norm(x, residual, eps)
        qkv = g.op("Reshape", [g.op("MatMul", [y, f"qkv_{i}"]), "rope_shape"])
        turned = g.op("ReduceSum", [g.op("Mul", [qkv, rope]), "axis_1"], keepdims=1)  # [batch, 1, width]
        q, k, v = g.op("Split", [turned, "split_qkv"], outputs=3, axis=2)
        attended = g.op("GroupQueryAttention", [q, k, v, f"keys_{i}", f"values_{i}", "past_lengths", "total_length"],
                        outputs=[g.name("attended"), f"present_keys_{i}", f"present_values_{i}"], domain=_MS,
                        num_heads=heads, kv_num_heads=kv_heads, scale=1.0)[0]
        x = g.op("MatMul", [attended, f"o_{i}"])
        y, residual = g.norm(x, residual, eps)
        gate, up = g.op("Split", [g.op("MatMul", [y, f"gate_up_{i}"])], outputs=2, axis=2, num_outputs=2)
        x = g.op("MatMul", [g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up]), f"down_{i}"])
    y, _ = g.norm(x, residual, eps)
    g.op("MatMul", [y, "lm_head"], outputs=["logits"])
    cache = ["batch", kv_heads, "capacity", head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 1]),
              helper.make_tensor_value_info("past_lengths", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_length", TensorProto.INT32, []),
              *(helper.make_tensor_value_info(f"{part}_{i}", TensorProto.FLOAT, cache)
                for part in ("keys", "values") for i in range(layers))]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, vocab]),
               *(helper.make_tensor_value_info(f"present_{part}_{i}", TensorProto.FLOAT, cache)
                 for part in ("keys", "values") for i in range(layers))]
    graph = helper.make_graph(g.nodes, "decode_inplace", inputs, outputs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(_MS, 1)],
                              producer_name="train_deploy")
    onnx.checker.check_model(model)
    return model


def save_inplace_decode(model: Any, path: Path) -> Path:
    """Write ``model``'s (``CompactLlama``) in-place decode graph to ``path`` (weights in ``<path>.data`` beside it
    when they pass protobuf's 2 GB)."""
    import onnx

    from train_deploy.export.edge import external_data

    weights = {name: np.asarray(value.numpy(), np.float32) for name, value in model.state_dict().items()}
    proto = inplace_decode_model(weights, heads=model.heads, kv_heads=model.kv_heads, eps=model.eps)
    external = sum(value.nbytes for value in weights.values()) > 1 << 30
    onnx.save_model(proto, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=external_data(path).name)
    return path


class _Graph:
    """Nodes and constants, each output named once."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def constant(self, name: str, value: np.ndarray) -> None:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))

    def op(self, kind: str, inputs: list[str], *, outputs: int | list[str] = 1, domain: str = "",
           **attributes: Any) -> Any:
        """Add a ``kind`` node; its output name, or the list of them when ``outputs`` is not 1."""
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [self.name(kind.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, names, name=self.name(kind), domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def norm(self, x: str, residual: str, eps: float) -> tuple[str, str]:
        """RMSNorm of ``x + residual`` (its scale folded into the next product) and that sum, in one fused node."""
        out, total = self.name("normed"), self.name("residual")
        self.nodes.append(_node("SkipSimplifiedLayerNormalization", [x, residual, "norm_ones"],
                                [out, "", "", total], self.name("Norm"), epsilon=eps))
        return out, total


def _node(kind: str, inputs: list[str], outputs: list[str], name: str, **attributes: Any) -> Any:
    from onnx import helper

    return helper.make_node(kind, inputs, outputs, name=name, domain=_MS, **attributes)
