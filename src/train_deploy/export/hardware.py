"""Hardware tuning of the engines: MKL's code path on CPUs it misjudges, float32 (not TF32) on GPU, a Paddle
Inference GPU config, and the TensorRT conversion of a server graph.

:func:`prefer_mkl_avx2` runs when this module is imported (with ``train_deploy.export``), before Paddle Inference
makes its first product.
"""

from __future__ import annotations

import os
from pathlib import Path

from train_deploy.environment import first_cpu, mkl_cpu_type
from train_deploy.export.config import ServerConfig
from train_deploy.export.errors import BundleError


def prefer_mkl_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Set ``MKL_DEBUG_CPU_TYPE`` where this CPU's MKL needs it (:func:`~train_deploy.environment.mkl_cpu_type`)
    unless the environment sets it; True if set now. Run when ``train_deploy.export`` is imported, before Paddle
    Inference makes its first product (4-6x faster products on an AMD EPYC); it changes nothing after that."""
    cpu_type = mkl_cpu_type(first_cpu(cpuinfo))
    if "MKL_DEBUG_CPU_TYPE" in os.environ or cpu_type is None:
        return False
    os.environ["MKL_DEBUG_CPU_TYPE"] = cpu_type
    return True


prefer_mkl_avx2()


def configure_gpu(config, server: ServerConfig) -> None:
    """Set a Paddle Inference ``config`` to run on GPU 0 at ``server``'s precision and memory settings."""
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
