"""The two engines a bundle runs on: Paddle Inference (the server graphs) and ONNX Runtime (the edge graphs).

Each is called for logits (``(input_ids, attention_mask) -> logits``, :data:`Logits`) and has ``prefill`` and
``decode`` with the KV cache (``graph.py``), returning a :class:`Step`. Which one a host runs is chosen in
``engines.py``; the settings that tune them to the hardware are in ``hardware.py``.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train_deploy.export.config import ServerConfig
from train_deploy.export.errors import BundleError
from train_deploy.export.graph import DECODE_MODEL, SERVER_MODEL, cache_names
from train_deploy.export.hardware import configure_gpu, tensorrt_program
from train_deploy.export.inplace import INPLACE_DECODE
from train_deploy.export.kv_cache import GrowingCache, SlotCache

Logits = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""An engine called for logits: ``(input_ids, attention_mask) -> logits [batch, seq, vocab]``."""


class PaddleInferenceBackend:
    """The bundle's two graphs (``graph.py``) on Paddle Inference predictors: ``(input_ids, attention_mask) ->
    logits`` when called, :meth:`prefill` and :meth:`decode` with the KV cache for generation.

    Predictors are run with Paddle tensors (``predictor.run(tensors)``): the caches a pass returns stay Paddle
    tensors and are fed to the next step as they are, never copied out and back in; only logits become numpy.
    A predictor keeps each output's buffer and writes the next run's output into it when it is large enough,
    even while that buffer is an input of the run (after a larger batch, a decode step's concat would overwrite
    the keys it reads). So after every run each output is pointed at a one-element placeholder
    (``share_external_data``): the next run allocates its outputs afresh and every returned step stays valid.

    On GPU it computes in float32 with TF32 off (:func:`disable_tf32`), in fp16 through Paddle Inference's
    mixed-precision pass, or with TensorRT engines in the program that :func:`tensorrt_program` converts
    when the model is loaded (``server.form_precision`` says which; the decode graph, whose cache inputs the
    TensorRT profile does not describe, runs on the plain GPU predictor).
    """

    def __init__(self, prefix: Path, server: ServerConfig, context: int = 2048) -> None:
        import paddle

        self._paddle = paddle
        self._converted: tempfile.TemporaryDirectory | None = None  # the TensorRT program, while the predictor lives
        self._full = self._predictor(prefix, server, context)
        decode = prefix.with_name(DECODE_MODEL)
        self._decode = self._predictor(decode, dataclasses.replace(server, tensorrt=False), context) \
            if decode.with_suffix(".json").is_file() else None
        self._place = paddle.CPUPlace() if server.device == "cpu" else paddle.CUDAPlace(0)  # the predictors' device
        self._placeholder = paddle.to_tensor(np.zeros(1, np.float32), place=self._place)

    def _predictor(self, prefix: Path, server: ServerConfig, context: int):
        import paddle
        from paddle import inference

        model, params = prefix.with_suffix(".json"), prefix.with_suffix(".pdiparams")
        if not model.is_file() or not params.is_file():
            raise BundleError(f"{prefix.parent}: no Paddle Inference model ({model.name}, {params.name})")
        if server.device == "gpu":
            if not paddle.device.is_compiled_with_cuda():
                raise BundleError("export.server.device: gpu needs the paddlepaddle-gpu wheel")
            if server.tensorrt:
                self._converted = tempfile.TemporaryDirectory(prefix="train_deploy-tensorrt-")
                model, params = tensorrt_program(prefix, Path(self._converted.name) / SERVER_MODEL, server, context)
            config = inference.Config(str(model), str(params))
            configure_gpu(config, server)
        else:
            if server.tensorrt or server.precision != "fp32":
                raise BundleError("export.server: tensorrt and precision fp16 need device: gpu")
            config = inference.Config(str(model), str(params))
            config.disable_gpu()
            config.set_cpu_math_library_num_threads(server.cpu_threads)
            config.enable_mkldnn() if server.onednn else config.disable_mkldnn()
        config.disable_glog_info()
        paddle.set_flags({"FLAGS_eager_delete_tensor_gb": server.gc_batch_mb / 1024})  # read at the first run
        predictor = inference.create_predictor(config)
        outputs = [predictor.get_output_handle(name) for name in predictor.get_output_names()]
        return predictor, predictor.get_input_names(), outputs

    def _run(self, graph, feed: dict[str, Any]) -> list:
        """The graph's outputs (Paddle tensors) for ``feed`` (numpy arrays or Paddle tensors by input name)."""
        predictor, names, outputs = graph
        result = predictor.run([self._tensor(feed[name]) for name in names])
        for handle in outputs:  # the next run must not write into a buffer returned now (class docstring)
            handle.share_external_data(self._placeholder)
        return result

    def _tensor(self, value):
        if not isinstance(value, self._paddle.Tensor):
            return self._paddle.to_tensor(np.ascontiguousarray(value), place=self._place)
        # a predictor reads a tensor's buffer as dense: a view (a slice of the cache) must be made contiguous
        return value if value.is_contiguous() else value.contiguous()

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self._run(self._full, _ids(input_ids, attention_mask))[0].numpy()

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Step:
        return _step(self._run(self._full, _ids(input_ids, attention_mask)), lambda logits: logits.numpy())

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, keys: Sequence[Any],
               values: Sequence[Any]) -> Step:
        if self._decode is None:
            raise BundleError("server/: no decode graph (decode.json); re-export the bundle")
        return _step(self._run(self._decode, _cache_feed(input_ids, attention_mask, keys, values)),
                     lambda logits: logits.numpy())

    def new_cache(self) -> GrowingCache:
        """An empty cache for a batch's decode steps: the growing one (a predictor copies what it is fed, so no
        graph can write a cache in place, ``inplace.py``)."""
        return GrowingCache(self.decode)


def _ids(input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": np.asarray(input_ids, dtype=np.int64), "attention_mask": np.asarray(attention_mask,
                                                                                            dtype=np.int64)}


def _cache_feed(input_ids: np.ndarray, attention_mask: np.ndarray, keys: Sequence[Any],
                values: Sequence[Any]) -> dict[str, Any]:
    """A decode step's inputs by name (``graph.cache_names``)."""
    return {**_ids(input_ids, attention_mask), **dict(zip(cache_names(len(keys)), [*keys, *values], strict=True))}


def _step(outputs: Sequence[Any], logits: Callable[[Any], np.ndarray] = np.asarray) -> Step:
    """A pass's outputs ``(logits, keys…, values…)`` as a :class:`Step`."""
    layers = (len(outputs) - 1) // 2
    return Step(logits(outputs[0]), list(outputs[1:1 + layers]), list(outputs[1 + layers:]))


@dataclass(frozen=True, slots=True)
class Step:
    """What a prefill or decode pass returns: logits ``[batch, seq, vocab]`` and each layer's cache ``[batch,
    kv_heads, cached positions, head_dim]`` (numpy arrays, or Paddle tensors on Paddle Inference), fed back as
    they are to the next decode step."""

    logits: np.ndarray
    keys: list[Any]
    values: list[Any]


class OnnxRuntimeBackend:
    """The bundle's ONNX graphs (``model.onnx`` or ``model.int8.onnx`` and the ``decode`` graphs beside it) on
    ONNX Runtime CPU sessions; called, prefilled and decoded as :class:`PaddleInferenceBackend`.

    Where the bundle has the in-place decode graph (``decode_inplace``, ``inplace.py``) and ``in_place`` is True,
    :meth:`new_cache` gives a :class:`SlotCache` that it updates through I/O binding; otherwise the growing cache
    of the converted ``decode`` graph (bundles before format 11, and the mobile check, which compares the ``.ort``
    files with the graphs they were converted from)."""

    def __init__(self, path: Path, threads: int, *, in_place: bool = True) -> None:
        self._threads = threads
        self._full = self._session(path)
        decode = path.with_name(path.name.replace("model", DECODE_MODEL, 1))
        self._decode = self._session(decode) if decode.is_file() else None
        inplace = path.with_name(path.name.replace("model", INPLACE_DECODE, 1))
        self._inplace = self._session(inplace) if in_place and inplace.is_file() else None
        self._bindings = threading.local()  # the in-place graph's I/O binding per thread (_run_in_place)

    def _session(self, path: Path):
        import onnxruntime as ort

        if not path.is_file():
            raise BundleError(f"{path}: no ONNX model")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = self._threads, 1
        # Idle pool threads sleep instead of spinning: on a busy host the spinners took the cores the next step
        # needed (one 16-sequence decode step at load 9.6: 27.8 ms spinning, 4.1 ms not; docs/benchmarks.md).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return session, [output.name for output in session.get_outputs()]

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        session, outputs = self._full
        return session.run(outputs[:1], _ids(input_ids, attention_mask))[0]

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Step:
        session, outputs = self._full
        return _step(session.run(outputs, _ids(input_ids, attention_mask)))

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, keys: Sequence[np.ndarray],
               values: Sequence[np.ndarray]) -> Step:
        if self._decode is None:
            raise BundleError("edge/: no decode graph (decode.onnx); re-export the bundle")
        session, outputs = self._decode
        return _step(session.run(outputs, _cache_feed(input_ids, attention_mask, keys, values)))

    def new_cache(self) -> GrowingCache | SlotCache:
        """An empty cache for a batch's decode steps (class docstring)."""
        if self._inplace is None:
            return GrowingCache(self.decode)
        keys = self._inplace[0].get_inputs()[3]  # keys_0: [batch, kv_heads, capacity, head_dim]
        return SlotCache(self._run_in_place, (len(self._inplace[1]) - 1) // 2, keys.shape[1], keys.shape[3])

    def _run_in_place(self, input_ids: np.ndarray, past_lengths: np.ndarray, total_length: int,
                      keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> np.ndarray:
        """One step of the in-place graph: each cache is bound as its input and its output (the same memory).

        Binding the caches costs more than a small step runs (110 µs of a 325 µs step at one sequence of the
        default model, docs/benchmarks.md), so each thread keeps its binding while the buffers it points at are
        the same (addresses and shapes) and binds only the ids and lengths again."""
        session, _ = self._inplace  # type: ignore[misc]
        caches = [*keys, *values]
        layout = tuple((cache.ctypes.data, cache.shape) for cache in caches)
        binding = getattr(self._bindings, "binding", None)
        if binding is None or self._bindings.layout != layout:
            binding = session.io_binding()
            binding.bind_output("logits", "cpu")
            for i, cache in enumerate(caches):
                name = f"{'keys' if i < len(keys) else 'values'}_{i % len(keys)}"
                binding.bind_input(name, "cpu", 0, np.float32, cache.shape, cache.ctypes.data)
                binding.bind_output(f"present_{name}", "cpu", 0, np.float32, cache.shape, cache.ctypes.data)
            self._bindings.binding, self._bindings.layout = binding, layout
        # bound by address, not copied: each array must live until the run is done
        small = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                 "past_lengths": np.ascontiguousarray(past_lengths, dtype=np.int32),
                 "total_length": np.array(total_length, np.int32)}
        for name, value in small.items():
            binding.bind_cpu_input(name, value)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().copy()  # a view of the output the next run writes again
