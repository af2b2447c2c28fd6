"""Typed configuration of the export stage (``conf/base/parameters_export.yml``, block ``export``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from train_deploy.config import block, check, from_mapping, setting, to_dict

# Threads of one predictor or session: more is a typo, not a machine.
_MAX_THREADS = 1024


@block
class ServerConfig:
    """Paddle Inference: how the bundle's ``server/`` model is run by :class:`LanguageModel`."""

    device: Literal["cpu", "gpu"] = "cpu"
    """Device of the Paddle Inference predictor; gpu needs the paddlepaddle-gpu wheel."""
    cpu_threads: int = Field(2, ge=1, le=_MAX_THREADS)
    """Math-library threads per predictor on CPU (1 to 1024)."""
    onednn: bool = False
    """oneDNN (MKL-DNN) kernels on CPU. Off by default: with the compact graph, Paddle's own CPU kernels are
    ~30% faster at batch 1 and within 5% at batch 8 (docs/benchmarks.md)."""
    gc_batch_mb: float = Field(16, ge=0)
    """Paddle Inference frees finished activations in batches of this many MB (Paddle's process-wide flag
    ``FLAGS_eager_delete_tensor_gb``) instead of handing every tensor to its collector thread one by one:
    ~15% faster at batch 1 on a 2-core CPU, for at most this much memory held; 0 frees each at once."""
    gpu_memory_mb: int = Field(1024, ge=1)
    """Initial GPU memory pool of the predictor."""
    precision: Literal["fp32", "fp16"] = "fp32"
    """GPU without TensorRT: fp32 runs with TF32 off (cuBLAS and cuDNN, Paddle's ``set_cublas_switch`` and
    ``set_cudnn_switch``), so parity holds to ``parity.max_logit_diff``; fp16 runs Paddle Inference's
    mixed-precision pass (``enable_use_gpu(…, PrecisionType.Half)``; ids in, float32 logits out) and is judged
    by the fp16 rule (``parity.max_fp16_perplexity_increase``). fp16 needs device gpu."""
    memory_optim: bool = False
    """GPU: Paddle Inference's legacy memory-reuse pass. Paddle 3's PIR executor frees activations by itself,
    and the pass fails on PIR programs on CPU ("Not find predictor_id … memory_optimize_pass"); off by default."""
    tensorrt: bool = False
    """GPU: convert the bundle's PIR program with ``paddle.tensorrt`` when the model is loaded (TensorRT
    subgraphs as ``tensorrt_engine`` operators) and run the converted program; needs device gpu and a Paddle
    wheel built with TensorRT. TensorRT forms are judged by the fp16 rule whatever their precision: Paddle's
    converter leaves TensorRT's TF32 on."""
    tensorrt_precision: Literal["fp16", "fp32"] = "fp16"
    """Precision of the TensorRT engines."""
    tensorrt_max_batch: int = Field(8, ge=1)
    """Largest batch of the TensorRT dynamic-shape profile (sequence: 1 to the model's context)."""

    @property
    def form_precision(self) -> str:
        """What the predictor computes in: ``fp32``, ``fp16``, ``tensorrt_fp16`` or ``tensorrt_fp32`` (parity's
        rule for the form; only ``fp32`` is held to ``max_logit_diff``)."""
        if self.device == "cpu":
            return "fp32"
        return f"tensorrt_{self.tensorrt_precision}" if self.tensorrt else self.precision


@block
class EdgeConfig:
    """ONNX for edge devices: paddle2onnx, then onnxruntime's dynamic int8 quantisation."""

    opset: int = Field(17, ge=13, le=21)
    """ONNX opset of the conversion, 13 to 21 (paddle2onnx converts the graphs' sums only from opset 13)."""
    int8: bool = True
    """Also write an int8 model (dynamic quantisation of the weights) beside the fp32 ONNX model."""
    per_channel: bool = False
    """Per-output-channel weight scales (a little more accurate, a little larger)."""
    threads: int = Field(2, ge=1, le=_MAX_THREADS)
    """ONNX Runtime intra-op threads used for parity and latency (1 to 1024)."""
    convert_timeout: float = setting(1800, gt=0, note="seconds")
    """Seconds the paddle2onnx conversion may take (positive); past it the conversion is killed and the export
    fails naming the model file."""


@block
class ParityConfig:
    """Proof that every exported form computes what the trained model computes."""

    samples: int = Field(8, ge=1)
    """Validation windows (the first ones of the validation split: fixed for every export)."""
    seq_length: int | None = Field(None, ge=2)
    """Tokens per window; null = the training sequence length (capped by the context)."""
    max_logit_diff: float = Field(1e-4, gt=0)
    """Largest allowed |logit| difference of every float32 form (Paddle Inference on CPU, or on GPU in fp32
    with TF32 off; ONNX fp32) against the trained model."""
    max_fp16_logit_diff: float = Field(0.1, gt=0)
    """Expected |logit| difference of fp16 and TensorRT forms against the trained model (half precision keeps
    ~3 significant digits of logits of magnitude ~10). Reported, not enforced: beyond it, parity.json and
    the log carry a warning; such a form passes or fails on ``max_fp16_perplexity_increase``."""
    max_fp16_perplexity_increase: float = Field(0.01, ge=0)
    """Allowed relative perplexity increase of an fp16 or TensorRT form over the trained model's (float32)
    perplexity on the parity windows (0.01 = +1%)."""
    max_int8_perplexity_increase: float = Field(0.03, ge=0)
    """Allowed relative perplexity increase of the int8 model over ONNX fp32 (0.03 = +3%)."""


@block
class LatencyConfig:
    """Latency measured into the bundle's latency.json (benchmarks/bench_export.py compares in depth)."""

    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8], min_length=1)
    """Batch sizes timed, each at least 1."""
    seq_length: int = Field(128, ge=1)
    """Capped by the model's context."""
    warmup: int = Field(2, ge=0)
    """Untimed calls per form and batch size before timing."""
    repeats: int = Field(10, ge=1)
    """Timed calls per form and batch size."""
    rounds: int = Field(2, ge=1)
    """The repeats are split into this many rounds, each timing every form in turn (fair under drift)."""
    generate_tokens: int = Field(32, ge=0)
    """New tokens of a greedy generation at batch 1 (a ``seq_length`` prompt, the KV cache) timed per form, as
    milliseconds per new token: the figure ``LanguageModel.load`` compares when no backend is pinned, to run
    the fastest engine the host can run (0: not measured; the forward pass's p50 is compared instead)."""


@block
class ExportConfig:
    too_long: Literal["raise", "truncate"] = "raise"
    """A prompt or text longer than the model's context: an error, or keep its last tokens."""
    reuse: bool = True
    """Reuse the newest bundle exported from the same checkpoint, tokenizer and configuration."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """The Paddle Inference form (`export.server`)."""
    edge: EdgeConfig = Field(default_factory=EdgeConfig)
    """The ONNX forms (`export.edge`)."""
    parity: ParityConfig = Field(default_factory=ParityConfig)
    """Checks that every form matches the trained model (`export.parity`)."""
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    """The latency measurement (`export.latency`)."""

    def __post_init__(self) -> None:  # rules across keys; each key's own range is its field's
        server = self.server
        check(server.device == "gpu" or server.precision == "fp32", "export.server.precision",
              f"{server.precision} needs device: gpu (the CPU predictor runs float32)")
        check(server.device == "gpu" or not server.tensorrt, "export.server.tensorrt", "true needs device: gpu")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ExportConfig:
        return from_mapping(cls, params, "export")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)
