"""The inference graph: a checkpoint loaded into PaddleNLP's ``LlamaForCausalLM`` and saved for Paddle Inference.

Training uses the auto-parallel ``LlamaForCausalLMNet``, which ``paddle.jit.save`` cannot trace; the
plain ``LlamaForCausalLM`` has the same parameter names and computes the same logits. Two of its
operators are rewritten into equivalent portable ones before tracing: the fused ``swiglu`` kernel
(paddle2onnx has no converter for it) becomes ``silu(gate) * up``, and RMSNorm's ``pow(x, 2)`` (a slow
generic kernel on CPU) becomes ``x * x``. The graph takes ``input_ids`` and ``attention_mask`` (int64,
dynamic batch and sequence) and returns float32 logits, without a KV cache.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from train_deploy.training.checkpoint import load_weights, read_state

SERVER_MODEL = "model"  # Paddle Inference writes model.json + model.pdiparams


def load_inference_model(checkpoint: Path):
    """``LlamaForCausalLM`` with the checkpoint's weights in float32, portable operators, eval mode."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    state = read_state(checkpoint)
    config = LlamaConfig.from_dict(state["model_config"])
    config.use_flash_attention = False  # portable attention: the same graph on CPU, GPU and ONNX
    config.use_fused_rms_norm = config.use_fused_rope = False
    config.use_cache, config.recompute, config.tensor_parallel_degree = False, False, 1
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    load_weights(model, checkpoint)  # float32: the model was built with dtype float32
    _portable_operators(model)
    model.eval()
    return model


def logits_module(model):
    """The traced module: ``(input_ids, attention_mask) -> logits`` in float32."""
    import paddle

    class Logits(paddle.nn.Layer):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False)
            logits = out[0] if isinstance(out, tuple | list) else out
            return logits.astype("float32")

    module = Logits(model)
    module.eval()
    return module


def save_server_model(model, folder: Path) -> Path:
    """Trace ``model`` with dynamic batch and sequence axes and save it for Paddle Inference; return the prefix."""
    import paddle

    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / SERVER_MODEL
    spec = [paddle.static.InputSpec([None, None], "int64", "input_ids"),
            paddle.static.InputSpec([None, None], "int64", "attention_mask")]
    paddle.jit.save(logits_module(model), str(prefix), input_spec=spec)
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


def _portable_operators(model) -> None:
    from paddlenlp.transformers.llama.modeling import LlamaMLP, LlamaRMSNorm

    for layer in model.sublayers():
        if isinstance(layer, LlamaMLP):
            layer.forward = types.MethodType(_mlp_forward, layer)
        elif isinstance(layer, LlamaRMSNorm):
            layer.forward = types.MethodType(_rms_norm_forward, layer)


def _mlp_forward(self, x):
    import paddle.nn.functional as F

    if self.fuse_attention_ffn:
        gate, up = self.gate_up_fused_proj(x).chunk(2, axis=-1)
    else:
        gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(F.silu(gate) * up)


def _rms_norm_forward(self, hidden_states):
    import paddle

    hidden_states = hidden_states.astype("float32")
    variance = (hidden_states * hidden_states).mean(-1, keepdim=True)
    return paddle.rsqrt(variance + self.variance_epsilon) * hidden_states * self.weight
