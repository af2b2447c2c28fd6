"""ONNX for edge devices: paddle2onnx conversion of the server graph, then int8 weights for ONNX Runtime.

paddle2onnx aborts the whole process (SIGABRT) on an operator it cannot convert, and prints no name
for it, so the operators are checked against its registry first (the check below follows paddle2onnx's
own ``convert_pir_op_name``) and the conversion itself runs in a child process.

The int8 model (:func:`quantize_int8`) must answer alike on every CPU, whatever the batch and the thread count.
onnxruntime's ``quantize_dynamic`` (MatMulInteger with one activation scale per call) did neither: the scale is
taken over the whole input tensor, so a prompt's logits depend on the other prompts and the padding of its batch
(greedy text differed between a batch and the same prompts one by one, on every CPU), and its U8S8 kernels
saturate on AVX2 without VNNI (ONNX Runtime's quantization guide), where the tiny model's perplexity moved 8.8%
from fp32's. So weights are quantised to int8 in blocks of 32 along the input axis of each output column
(symmetric: one float scale per block, zero point 128) into ``com.microsoft.MatMulNBits`` (bits 8,
``accuracy_level`` 4): ONNX Runtime quantises the activations per row and per block at run time and multiplies in
int8 where the CPU has a kernel for it (a product whose pairs of int8 products were all at their extremes came out
exact on AVX2 under the emulator: nothing saturates). Each row is computed alone: the same prompt gives the same
logits in any batch, on any number of threads. Embedding tables (``Gather`` of a constant) become int8 rows with one
float scale per row. Measured on the tiny
test model against fp32 over 64 People's Daily sentences: perplexity within 0.02% on an AVX-512/VNNI EPYC and
under ``qemu-x86_64 -cpu max`` (AVX2, no AVX-512), greedy text identical alone, in batches of 2 and 8, reversed,
on 1, 2 and 4 threads (``tests/export/test_int8_determinism.py``). The price is speed on CPUs with VNNI: 15
products by 768x2048 weights on that EPYC (one thread, a loaded machine) took ~6 ms for one row against ~4-6 ms with
``quantize_dynamic`` and ~14 ms in fp32, and for 64 rows ~40-60 ms against ~18-29 ms and ~60-100 ms.
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

    Past protobuf's 2 GB limit paddle2onnx writes the weights beside it to ``<output>.data``. The symbolic
    dimensions get fixed names (:func:`name_dimensions`), so the same graph gives the same file. A conversion
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


def quantize_int8(source: Path, output: Path, per_channel: bool = False) -> Path:
    """Write ``source`` with int8 weights to ``output`` (module docstring): every ``MatMul`` by a constant matrix
    becomes ``MatMulNBits`` (8 bits, blocks of :data:`BLOCK` inputs; ``per_channel``: one block per output column,
    smaller and a little less accurate), every ``Gather`` from a constant table gathers int8 rows and their scales.
    Weights stay beside the model in ``<output>.data`` when ``source`` keeps them outside."""
    import onnx

    model = onnx.load(str(source))
    graph = model.graph
    tables = {tensor.name: tensor for tensor in graph.initializer}
    nodes = []
    for node in graph.node:
        weight = tables.get(node.input[1] if node.op_type == "MatMul" else node.input[0]) \
            if node.op_type in ("MatMul", "Gather") else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT or \
                any(a.name == "axis" and a.i != 0 for a in node.attribute):
            nodes.append(node)
        elif node.op_type == "MatMul":
            nodes.append(_matmul_nbits(node, weight, graph, per_channel))
        else:
            nodes.extend(_int8_gather(node, weight, graph))
    used = {name for node in nodes for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:], graph.node[:]
    graph.initializer.extend(kept)
    graph.node.extend(nodes)
    if not any(opset.domain == _MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(_MS_DOMAIN, 1))
    blocks = "one per output column" if per_channel else f"{BLOCK} inputs"
    onnx.helper.set_model_props(model, {"train_deploy.int8": f"MatMulNBits bits=8, blocks of {blocks}, symmetric, "
                                        "accuracy_level=4; Gather: int8 rows, a scale per row"})
    external = external_data(source).exists()
    output.unlink(missing_ok=True)
    external_data(output).unlink(missing_ok=True)
    onnx.save_model(model, str(output), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=external_data(output).name)
    return output


BLOCK = 32  # inputs per int8 block and scale: ONNX Runtime's int8 kernels take 16 to 256
_MS_DOMAIN = "com.microsoft"


def _matmul_nbits(node, weight, graph, per_channel: bool):
    """``node`` (``A @ weight``, weight ``[K, N]``) as MatMulNBits with int8 blocks of ``weight``'s columns."""
    import numpy as np
    import onnx

    matrix = onnx.numpy_helper.to_array(weight).astype(np.float32)
    k, n = matrix.shape
    block = max(16, 1 << (k - 1).bit_length()) if per_channel else BLOCK
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = matrix
    columns = padded.T.reshape(n, blocks, block)
    scales = np.abs(columns).max(axis=2) / 127
    scales[scales == 0] = 1
    quantised = (np.clip(np.rint(columns / scales[..., None]), -127, 127) + 128).astype(np.uint8)  # zero point 128
    names = [f"{weight.name}_int8", f"{weight.name}_int8_scales"]
    graph.initializer.extend([onnx.numpy_helper.from_array(quantised, names[0]),
                              onnx.numpy_helper.from_array(scales.astype(np.float32), names[1])])
    return onnx.helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output),
                                 name=f"{node.output[0]}_int8", domain=_MS_DOMAIN, K=k, N=n, bits=8, block_size=block,
                                 accuracy_level=4)


def _int8_gather(node, weight, graph) -> list:
    """``node`` (rows of the table ``weight``) as a gather of int8 rows times a gather of their float scales."""
    import numpy as np
    import onnx

    table = onnx.numpy_helper.to_array(weight).astype(np.float32)
    scales = np.abs(table).max(axis=1, keepdims=True) / 127
    scales[scales == 0] = 1
    names = [f"{weight.name}_int8", f"{weight.name}_int8_scales"]
    graph.initializer.extend([onnx.numpy_helper.from_array(np.rint(table / scales).astype(np.int8), names[0]),
                              onnx.numpy_helper.from_array(scales.astype(np.float32), names[1])])
    out, indices = node.output[0], node.input[1]
    make = onnx.helper.make_node
    return [make("Gather", [names[0], indices], [f"{out}_int8"], name=f"{out}_int8"),
            make("Gather", [names[1], indices], [f"{out}_int8_scale"], name=f"{out}_int8_scale"),
            make("Cast", [f"{out}_int8"], [f"{out}_int8_float"], name=f"{out}_int8_cast",
                 to=onnx.TensorProto.FLOAT),
            make("Mul", [f"{out}_int8_float", f"{out}_int8_scale"], [out], name=f"{out}_int8_mul")]


def external_data(model: Path) -> Path:
    """Where the weights of an ONNX model too large for one protobuf live (location stored relative)."""
    return model.with_name(model.name + ".data")


def name_dimensions(model) -> dict[str, str]:
    """Rename every symbolic dimension (``dim_param``) of the ONNX ``model`` in place, by first appearance in the
    graph's inputs, outputs and ``value_info`` (sub-graphs after), and return the old name → new name map.

    paddle2onnx numbers them in an order that changes from one conversion to the next (``DynamicDimension.3``, then
    ``.7``: the same graph gave three files), so the file would differ between two exports of the same inputs. A
    graph input's or output's axis 0 is ``batch``, axis 2 of a cache input (``keys_<i>``, ``values_<i>``) is
    ``past_seq``, axis 1 of the other inputs and of the first output and axis 2 of the other outputs are ``seq``;
    a second distinct dimension of one role gets ``_1``, … and one first seen inside the graph ``dim_<n>``. Distinct
    dimensions stay distinct and equal ones equal, so ONNX Runtime runs the model as before."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    graph = model.graph
    first_output = graph.output[0].name if len(graph.output) else None
    for value, is_input in (*((v, True) for v in graph.input), *((v, False) for v in graph.output)):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param not in names:
                names[dim.dim_param] = _numbered(_role(value.name, axis, is_input, first_output), counts)
    _rename_dimensions(graph, names, counts)
    return names


def _role(tensor: str, axis: int, is_input: bool, first_output: str | None) -> str:
    """What axis ``axis`` of a graph input or output of the exported graphs (``graph.py``) counts."""
    if axis == 0:
        return "batch"
    if is_input and axis == 2 and tensor.startswith(("keys_", "values_")):
        return "past_seq"
    if axis == 1 and (is_input or tensor == first_output) or axis == 2 and not is_input:
        return "seq"
    return "dim"


def _numbered(role: str, counts: dict[str, int]) -> str:
    seen = counts[role] = counts.get(role, -1) + 1
    return f"dim_{seen}" if role == "dim" else role if seen == 0 else f"{role}_{seen}"


def _rename_dimensions(graph, names: dict[str, str], counts: dict[str, int]) -> None:
    """Apply ``names`` to ``graph``'s inputs, outputs and ``value_info``, then to its sub-graphs (``If``, ``Loop``),
    naming a dimension not seen yet ``dim_<n>``."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                if dim.dim_param not in names:
                    names[dim.dim_param] = _numbered("dim", counts)
                dim.dim_param = names[dim.dim_param]
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                _rename_dimensions(subgraph, names, counts)


def drop_output_copies(graph) -> int:
    """Make each graph output that is an ``Identity`` of a tensor a node computes that tensor itself, in place, and
    return how many ``Identity`` nodes went.

    paddle2onnx writes every fetched tensor as ``Identity(x)``, and ONNX Runtime keeps an ``Identity`` whose output
    is a graph output: each decode step copied every layer's whole key/value cache once more after concatenating
    it (22% of the node time of a 16-sequence step with 224 cached positions, ``benchmarks/bench_decode_step.py``).
    ``x`` may feed other nodes as well (the attention reads the concatenated cache), so ``x`` takes the output's
    name. A graph with sub-graphs (``If``, ``Loop``), which could name ``x`` from inside, is left as it is."""
    if any(a.HasField("g") or len(a.graphs) for node in graph.node for a in node.attribute):
        return 0
    computed = {name for node in graph.node for name in node.output}
    outputs = {value.name for value in graph.output}
    renamed: dict[str, str] = {}
    copies = []
    for node in graph.node:
        source = node.input[0] if node.op_type == "Identity" else None
        if source in computed and source not in outputs and source not in renamed and node.output[0] in outputs:
            renamed[source] = node.output[0]
            copies.append(node)
    for node in copies:
        graph.node.remove(node)
    for node in graph.node:
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                names[i] = renamed.get(name, name)
    kept = [value for value in graph.value_info if value.name not in renamed]  # the output carries its own type
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(copies)


def _convert(model_file: str, params: str, output: str, opset: str, external: str) -> None:
    import onnx
    import paddle2onnx

    paddle2onnx.export(model_file, params, output, opset_version=int(opset), auto_upgrade_opset=False,
                       enable_onnx_checker=True, external_file=external)
    model = onnx.load(output, load_external_data=False)  # the weights beside it, if any, stay as they are
    name_dimensions(model)
    drop_output_copies(model.graph)
    onnx.save_model(model, output)
    onnx.checker.check_model(output)  # the rewired graph, as paddle2onnx checked its own


if __name__ == "__main__":
    _convert(*sys.argv[1:6])
