"""Load an exported bundle and use it: ``score(texts)`` and ``generate(prompt, …)``.

>>> from train_deploy.export import LanguageModel
>>> model = LanguageModel.load("data/07_model_output/bundle/<version>/bundle")           # Paddle Inference
>>> edge = LanguageModel.load("…/<version>", backend="onnx", int8=True)                   # ONNX Runtime, int8
>>> model.score(["今天天气很好。"])[0].perplexity
>>> model.generate("中国", max_new_tokens=20, temperature=0)                               # greedy

Texts are scored after the end-of-document id, the context every training document was seen in.
Every text and prompt is first normalised with the policy the bundle's tokenizer records (``zh``: full-width
Latin, digits and spaces folded, Chinese punctuation kept), as the training corpus was; a bundle whose tokenizer
records none (saved before the record, or a tokenizer loaded from elsewhere) takes texts as given, and says
so in the log when loaded.
The exported graph has no KV cache: each new token re-reads the whole window (fine for small models
and short outputs; the graph stays one portable function of ``input_ids`` and ``attention_mask``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from train_deploy.export.config import ServerConfig
from train_deploy.export.edge import INT8_FILE, ONNX_FILE
from train_deploy.export.graph import SERVER_MODEL
from train_deploy.handoffs import BUNDLE_FILE, TokenizerInfo, from_json

logger = logging.getLogger(__name__)

# The weights file of each exported form, relative to the bundle.
FORM_FILES = {"paddle_inference": f"server/{SERVER_MODEL}.pdiparams", "onnx_fp32": f"edge/{ONNX_FILE}",
              "onnx_int8": f"edge/{INT8_FILE}"}
Logits = Callable[[np.ndarray, np.ndarray], np.ndarray]


class BundleError(ValueError):
    """A bundle or a request to it is unusable; the message names the file or the value."""


class PaddleInferenceBackend:
    """``(input_ids, attention_mask) -> logits`` with a Paddle Inference predictor.

    On GPU it computes in float32 with TF32 off (:func:`disable_tf32`), in fp16 through Paddle Inference's
    mixed-precision pass, or with TensorRT engines in the program that :func:`tensorrt_program` converts
    when the model is loaded (``server.form_precision`` says which).
    """

    def __init__(self, prefix: Path, server: ServerConfig, context: int = 2048) -> None:
        import paddle
        from paddle import inference

        model, params = prefix.with_suffix(".json"), prefix.with_suffix(".pdiparams")
        if not model.is_file() or not params.is_file():
            raise BundleError(f"{prefix.parent}: no Paddle Inference model ({model.name}, {params.name})")
        self._converted: tempfile.TemporaryDirectory | None = None  # the TensorRT program, while the predictor lives
        if server.device == "gpu":
            if not paddle.device.is_compiled_with_cuda():
                raise BundleError("export.server.device: gpu needs the paddlepaddle-gpu wheel")
            if server.tensorrt:
                self._converted = tempfile.TemporaryDirectory(prefix="train_deploy-tensorrt-")
                model, params = tensorrt_program(prefix, Path(self._converted.name) / SERVER_MODEL, server, context)
            config = inference.Config(str(model), str(params))
            _configure_gpu(config, server)
        else:
            if server.tensorrt or server.precision != "fp32":
                raise BundleError("export.server: tensorrt and precision fp16 need device: gpu")
            config = inference.Config(str(model), str(params))
            config.disable_gpu()
            config.set_cpu_math_library_num_threads(server.cpu_threads)
            config.enable_mkldnn() if server.onednn else config.disable_mkldnn()
        config.disable_glog_info()
        paddle.set_flags({"FLAGS_eager_delete_tensor_gb": server.gc_batch_mb / 1024})  # read at the first run
        self._predictor = inference.create_predictor(config)
        self._inputs = [self._predictor.get_input_handle(n) for n in self._predictor.get_input_names()]
        self._output = self._predictor.get_output_handle(self._predictor.get_output_names()[0])

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        for handle, value in zip(self._inputs, (input_ids, attention_mask), strict=True):
            handle.reshape(value.shape)
            handle.copy_from_cpu(np.ascontiguousarray(value, dtype=np.int64))
        self._predictor.run()
        return self._output.copy_to_cpu()


def _configure_gpu(config, server: ServerConfig) -> None:
    from paddle import inference

    half = server.precision == "fp16" and not server.tensorrt
    # PIR programs: enable_use_gpu's precision Half adds the auto-mixed-precision pass
    # (AnalysisPredictor::OptimizeInferencePirProgram, enable_gpu_mixed_); inputs and outputs keep their dtypes.
    config.enable_use_gpu(server.gpu_memory_mb, 0,
                          inference.PrecisionType.Half if half else inference.PrecisionType.Float32)
    if not half:
        disable_tf32()
    if server.memory_optim:
        config.enable_memory_optim()


def disable_tf32() -> None:
    """Float32 matrix products and convolutions on GPU in float32, not TF32 (process-wide).

    Paddle's switches of cuBLAS's and cuDNN's TF32 tensor-core math, ``paddle.base.core.set_cublas_switch`` and
    ``set_cudnn_switch`` (bound to ``phi::SetAllowTF32Cublas``/``SetAllowTF32Cudnn`` in Paddle's
    ``paddle/fluid/pybind/pybind.cc``; on by default in CUDA wheels). Every GPU context, a predictor's too,
    picks its TF32 cuBLAS handle only while ``phi::AllowTF32Cublas()`` holds. Nothing to do on a CPU wheel.
    """
    from paddle.base import core

    for switch in ("set_cublas_switch", "set_cudnn_switch"):
        if hasattr(core, switch):
            getattr(core, switch)(False)


def tensorrt_program(prefix: Path, target: Path, server: ServerConfig, context: int) -> tuple[Path, Path]:
    """Convert the PIR program at ``prefix`` for TensorRT into ``target`` (a prefix); return its two files.

    Paddle 3's documented route for PIR (``.json``) models, "GPU TensorRT 加速推理" in the Paddle Inference 3.0
    guide (paddlepaddle.org.cn/inference/v3.0/guides/nv_gpu_infer/gpu_trt_infer.html) and
    ``python/paddle/tensorrt/export.py``: ``paddle.tensorrt.export.convert`` with a ``TensorRTConfig`` of one
    ``Input`` (min/optimal/max shape) per feed writes a program whose TensorRT subgraphs are
    ``tensorrt_engine`` operators, which a plain GPU predictor runs. ``Config.enable_tensorrt_engine`` does not
    apply to PIR programs: ``AnalysisPredictor::PreparePirProgram`` runs no TensorRT subgraph pass.
    Raises :class:`BundleError` on a wheel without TensorRT or when the conversion fails.
    """
    import paddle

    try:
        from paddle.tensorrt.export import Input, PrecisionMode, TensorRTConfig, convert
    except ImportError as exc:
        raise BundleError(f"export.server.tensorrt: this Paddle wheel cannot convert for TensorRT ({exc}); use a "
                          "paddlepaddle-gpu wheel built with TensorRT, with the tensorrt package installed") from None
    shapes = {"min_input_shape": (1, 1), "optim_input_shape": (1, context),
              "max_input_shape": (server.tensorrt_max_batch, context), "input_data_type": "int64"}
    inputs = [Input(**shapes, input_range=(3, 10), name="input_ids"),
              Input(**shapes, input_range=(1, 1), name="attention_mask")]  # warm-up data: no padding
    precision = PrecisionMode.FP16 if server.tensorrt_precision == "fp16" else PrecisionMode.FP32
    config = TensorRTConfig(inputs=inputs, precision_mode=precision, save_model_dir=str(target))
    with paddle.pir_utils.IrGuard():  # as Paddle's test/tensorrt/test_export.py converts a saved model
        paddle.enable_static()
        try:
            convert(str(prefix), config)
        except Exception as exc:  # the converter raises whatever TensorRT or a missing converter raised
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BundleError(f"{prefix.with_suffix('.json')}: TensorRT conversion failed ({reason})") from exc
        finally:
            paddle.disable_static()
    return target.with_suffix(".json"), target.with_suffix(".pdiparams")


class OnnxRuntimeBackend:
    """``(input_ids, attention_mask) -> logits`` with an ONNX Runtime CPU session."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        if not path.is_file():
            raise BundleError(f"{path}: no ONNX model")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64)}
        return self._session.run(None, feed)[0]


@dataclass(frozen=True, slots=True)
class TextScore:
    text: str
    tokens: list[int]
    """Ids of the text (after truncation, if any)."""
    log_probs: list[float]
    """Natural-log probability of each token given the ones before it."""
    perplexity: float


class LanguageModel:
    """A deployed bundle: its tokenizer and one backend (Paddle Inference or ONNX Runtime)."""

    def __init__(self, logits: Logits, tokenizer, *, context: int, eos_id: int,
                 too_long: Literal["raise", "truncate"] = "raise") -> None:
        self._logits, self.tokenizer = logits, tokenizer
        self.context, self.eos_id, self.too_long = context, eos_id, too_long
        self.normalization = getattr(tokenizer, "normalization", None)
        """The tokenizer's recorded normalisation policy, applied to every input (None: texts as given)."""

    def normalize(self, text: str) -> str:
        """``text`` as the corpus was normalised (unchanged when the tokenizer records no policy)."""
        from train_deploy.corpus.cleaning import normalize

        return text if self.normalization is None else normalize(text, self.normalization)

    @classmethod
    def load(cls, bundle: str | Path, backend: Literal["paddle", "onnx"] = "paddle", *, int8: bool = False,
             server: ServerConfig | None = None, threads: int | None = None,
             too_long: Literal["raise", "truncate"] | None = None) -> LanguageModel:
        """Open ``bundle`` with ``backend``; ``int8`` picks the quantised ONNX model; ``server`` and ``threads``
        override the settings recorded at export."""
        folder = Path(bundle)
        meta = read_bundle(folder)
        if backend == "paddle":
            if int8:
                raise BundleError("int8: the int8 model is ONNX; load it with backend='onnx'")
            server = server or ServerConfig(**meta["server"])
            if threads is not None:
                server = dataclasses.replace(server, cpu_threads=threads)
            logits: Logits = PaddleInferenceBackend(folder / "server" / SERVER_MODEL, server, meta["model"]["context"])
        elif backend == "onnx":
            logits = OnnxRuntimeBackend(folder / "edge" / (INT8_FILE if int8 else ONNX_FILE),
                                        threads or meta["edge"]["threads"])
        else:
            raise BundleError(f"backend: {backend!r} is not one of 'paddle', 'onnx'")
        model = cls(logits, bundle_tokenizer(folder, meta), context=meta["model"]["context"],
                    eos_id=meta["model"]["eos_id"], too_long=too_long or meta["too_long"])
        if model.normalization is None:
            logger.info("%s: the tokenizer records no normalisation policy (saved before train_deploy recorded one, "
                        "or not trained by train_deploy): texts are tokenized as given", folder)
        return model

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Raw logits ``[batch, sequence, vocabulary]`` (float32)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        return self._logits(ids, np.ones_like(ids) if attention_mask is None else attention_mask)

    def score(self, texts: Sequence[str], batch_size: int = 8) -> list[TextScore]:
        """Per-token log-probabilities and perplexity of each text."""
        encoded = [self._fit([self.eos_id, *ids], what=f"text {i}") for i, ids in
                   enumerate(self.tokenizer.encode([self.normalize(text) for text in texts]))]
        scores = []
        for first in range(0, len(encoded), batch_size):
            batch = encoded[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            ids = np.zeros((len(batch), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, sequence in enumerate(batch):  # right padding: causal attention never looks at it
                ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
            log_probs = log_softmax(self.logits(ids, mask))
            for row, sequence in enumerate(batch):
                steps = np.arange(len(sequence) - 1)
                token_lp = log_probs[row, steps, sequence[1:]].astype(np.float64)
                ppl = math.exp(-token_lp.mean()) if len(token_lp) else float("nan")
                scores.append(TextScore(texts[first + row], sequence[1:], token_lp.tolist(), ppl))
        return scores

    def generate(self, prompt: str, max_new_tokens: int = 32, temperature: float = 1.0, top_k: int = 50,
                 seed: int | None = None) -> str:
        """Continue ``prompt``; ``temperature <= 0`` (or ``top_k == 1``) decodes greedily. Stops at end of document.

        When prompt and output outgrow the context, the window slides: the oldest tokens are dropped.
        """
        if max_new_tokens < 0:
            raise BundleError(f"max_new_tokens: {max_new_tokens} is negative")
        ids = self._fit([self.eos_id, *self.tokenizer.encode([self.normalize(prompt)])[0]], what="prompt")
        rng = np.random.default_rng(seed)
        new: list[int] = []
        for _ in range(max_new_tokens):
            window = np.asarray([(ids + new)[-self.context :]], dtype=np.int64)
            last = self.logits(window)[0, -1].astype(np.float64)
            token = _sample(last, temperature, top_k, rng)
            if token == self.eos_id:
                break
            new.append(token)
        return self.tokenizer.decode(new)

    def _fit(self, ids: list[int], what: str) -> list[int]:
        if len(ids) <= self.context:
            return ids
        if self.too_long == "truncate":
            return [self.eos_id, *ids[-(self.context - 1) :]]
        raise BundleError(f"{what}: {len(ids) - 1} tokens exceed the model's context of {self.context - 1} "
                          "(plus the document separator); shorten it or load with too_long='truncate'")


def read_bundle(folder: Path) -> dict[str, Any]:
    path = Path(folder) / BUNDLE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path}: missing; is {folder} an exported bundle?") from None
    except ValueError as exc:
        raise BundleError(f"{path}: unreadable ({exc})") from None


def bundle_tokenizer(folder: Path, meta: dict[str, Any]):
    from train_deploy.corpus.tokenizer import TokenEncoder

    where = str(Path(folder) / BUNDLE_FILE)
    return TokenEncoder(from_json(TokenizerInfo, {**meta["tokenizer"], "path": str(Path(folder) / "tokenizer")}, where))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _sample(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature <= 0 or top_k == 1:
        return int(np.argmax(logits))
    scaled = logits / temperature
    if 0 < top_k < len(scaled):
        cutoff = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= cutoff, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))
