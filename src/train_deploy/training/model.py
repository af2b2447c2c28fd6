"""The model: PaddleNLP's auto-parallel Llama (``LlamaForCausalLMNet``) built from a preset."""

from __future__ import annotations

from typing import Any

from train_deploy.training.config import TrainingConfig, check_vocabulary


def llama_config(config: TrainingConfig, vocab_size: int, eos_id: int):
    """The ``LlamaConfig`` of the preset with the tokenizer's vocabulary and special ids."""
    from paddlenlp.transformers import LlamaConfig

    shape: dict[str, Any] = {"vocab_size": vocab_size, **config.model.shape()}
    check_vocabulary(vocab_size, shape["vocab_size"])
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
    return model


def flops_per_token(shape: dict[str, Any], parameters: int, embedding: int, seq_length: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter (forward + backward) plus attention."""
    attention = 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq_length
    return 6 * (parameters - embedding) + attention
