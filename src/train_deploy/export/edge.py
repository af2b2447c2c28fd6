"""ONNX for edge devices: paddle2onnx conversion of the server graph, then dynamic int8 quantisation.

paddle2onnx aborts the whole process (SIGABRT) on an operator it cannot convert, and prints no name
for it, so the operators are checked against its registry first (the check below follows paddle2onnx's
own ``convert_pir_op_name``) and the conversion itself runs in a child process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from train_deploy.export.config import EdgeConfig
from train_deploy.export.graph import operator_names

logger = logging.getLogger(__name__)

ONNX_FILE, INT8_FILE = "model.onnx", "model.int8.onnx"
_TIMEOUT = EdgeConfig().convert_timeout

# Structural operators paddle2onnx handles itself, and its renames of PIR operators to its mapper names.
_STRUCTURAL = {"pd_op.data", "pd_op.fetch", "pd_op.if", "pd_op.while", "builtin.parameter", "builtin.combine",
               "builtin.split", "builtin.slice", "builtin.constant", "builtin.shadow_output", "cf.yield",
               "cf.tuple_push", "cf.tuple_pop", "cf.stack_create", "cf.has_elements"}
_RENAMED = {"matmul": "matmul_v2", "batch_norm_": "batch_norm", "topk": "top_k_v2",
            "repeat_interleave_with_tensor_index": "repeat_interleave", "expand": "expand_v2",
            "assign_value_": "assign_value", "flatten": "flatten_contiguous_range", "unsqueeze": "unsqueeze2",
            "arange": "range", "argmax": "arg_max", "floor_divide": "elementwise_floordiv",
            "subtract": "elementwise_sub", "multiply": "elementwise_mul", "divide": "elementwise_div",
            "remainder": "elementwise_mod", "minimum": "elementwise_min", "maximum": "elementwise_max",
            "min": "reduce_min", "max": "reduce_max", "mean": "reduce_mean", "sum": "reduce_sum",
            "prod": "reduce_prod", "any": "reduce_any", "all": "reduce_all", "numel": "size",
            "hardswish": "hard_swish", "hardsigmoid": "hard_sigmoid", "add": "elementwise_add", "add_n": "sum",
            "grid_sample": "grid_sampler", "nonzero": "where_index"}


class ConversionError(RuntimeError):
    """The graph cannot be converted to ONNX; the message names the operator or the conversion's error."""


def unsupported_operators(prefix: Path) -> list[str]:
    """Operators of the saved Paddle graph that paddle2onnx has no converter for."""
    from paddle2onnx.paddle2onnx_cpp2py_export import get_all_supported_operators_pir

    supported = set(get_all_supported_operators_pir())
    missing = []
    for name in sorted(operator_names(prefix) - _STRUCTURAL):
        short = name.split(".", 1)[1] if name.startswith(("pd_op.", "builtin.")) else name
        if short not in supported and _RENAMED.get(short) not in supported:
            missing.append(name)
    return missing


def convert_to_onnx(prefix: Path, output: Path, opset: int, timeout: float = _TIMEOUT) -> Path:
    """Convert the Paddle Inference model at ``prefix`` to ONNX file ``output`` (in a child process).

    Past protobuf's 2 GB limit paddle2onnx writes the weights beside it to ``<output>.data``. A conversion
    still running after ``timeout`` seconds is killed (:class:`ConversionError`, nothing left at ``output``).
    """
    import paddle2onnx

    model_file = prefix.with_suffix(".json")
    missing = unsupported_operators(prefix)
    if missing:
        raise ConversionError(f"{model_file}: paddle2onnx {paddle2onnx.__version__} cannot convert operator "
                              f"{', '.join(missing)}; rewrite it with supported operators before export")
    params = prefix.with_suffix(".pdiparams")
    command = [sys.executable, "-m", "train_deploy.export.edge", str(model_file), str(params), str(output),
               str(opset), str(external_data(output))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "GLOG_minloglevel": "2"},
                              timeout=timeout)
    except subprocess.TimeoutExpired:  # run() has killed the child and reaped it
        for partial in (output, external_data(output)):
            partial.unlink(missing_ok=True)
        raise ConversionError(f"{model_file}: paddle2onnx did not finish within {timeout:g} s and was stopped "
                              "(export.edge.convert_timeout)") from None
    if done.returncode != 0 or not output.is_file():
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        # paddle2onnx says why on its own lines, then aborts with a C++ trace that says nothing
        said = [line for line in lines if line.startswith(("[Paddle2ONNX]", "[ERROR]")) and "Start parsing" not in line]
        raise ConversionError(f"{model_file}: paddle2onnx failed (exit {done.returncode}): "
                              f"{' | '.join(said or lines[-6:])}")
    return output


def quantize_int8(source: Path, output: Path, per_channel: bool) -> Path:
    """Dynamically quantise the weights of ``source`` to int8 (activations stay float, scaled at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # onnxruntime's quantiser logs on the root logger: a line per tensor, and advice to pre-process the graph
    # for static quantisation (dynamic quantisation of MatMul/Gather weights does not need it).
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(max(level, logging.ERROR))
    try:
        quantize_dynamic(str(source), str(output), weight_type=QuantType.QInt8, per_channel=per_channel,
                         use_external_data_format=external_data(source).exists())
    finally:
        quiet.setLevel(level)
    return output


def external_data(model: Path) -> Path:
    """Where the weights of an ONNX model too large for one protobuf live (location stored relative)."""
    return model.with_name(model.name + ".data")


def _convert(model_file: str, params: str, output: str, opset: str, external: str) -> None:
    import paddle2onnx

    paddle2onnx.export(model_file, params, output, opset_version=int(opset), auto_upgrade_opset=False,
                       enable_onnx_checker=True, external_file=external)


if __name__ == "__main__":
    _convert(*sys.argv[1:6])
