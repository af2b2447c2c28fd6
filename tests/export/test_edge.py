"""ONNX conversion: unsupported operators are named, large weights go to external data, a stuck conversion
is stopped, the symbolic dimensions have fixed names."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.helpers.export import fused_here
from train_deploy.export.backends import OnnxRuntimeBackend
from train_deploy.export.edge import (
    ConversionError,
    convert_to_onnx,
    drop_output_copies,
    external_data,
    name_dimensions,
    quantize_int8,
    unsupported_operators,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def portable_prefix(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint's portable graphs (the ones its ONNX models are converted from); the prefill's prefix."""
    from train_deploy.export.graph import load_inference_model, save_server_model

    return save_server_model(load_inference_model(tiny_checkpoint), tmp_path_factory.mktemp("portable"), portable=True)


def test_the_server_graphs_use_fused_kernels_and_onnx_is_made_from_portable_ones(tiny_bundle, portable_prefix):
    from train_deploy.export.graph import DECODE_MODEL, operator_names

    for name in ("model", DECODE_MODEL):
        if fused_here():  # a CPU without the fused kernels ships the portable graph alone (bundle.py)
            assert {"pd_op.fused_rms_norm_quant", "pd_op.swiglu"} <= operator_names(tiny_bundle / "server" / name)
            assert "pd_op.swiglu" in unsupported_operators(tiny_bundle / "server" / name)  # no paddle2onnx converter
        assert unsupported_operators(portable_prefix.with_name(name)) == []


def test_an_operator_paddle2onnx_cannot_convert_is_named(tmp_path):
    import paddle
    import paddle.nn.functional as F

    class FusedSwiGLU(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.linear = paddle.nn.Linear(8, 16)

        def forward(self, x):
            return F.swiglu(self.linear(x))

    paddle.jit.save(FusedSwiGLU(), str(tmp_path / "model"), input_spec=[paddle.static.InputSpec([None, 8], "float32")])
    with pytest.raises(ConversionError, match=r"model.json: paddle2onnx \S+ cannot convert operator pd_op.swiglu;"):
        convert_to_onnx(tmp_path / "model", tmp_path / "model.onnx", opset=17)
    assert not (tmp_path / "model.onnx").exists()


def test_models_with_external_weights_quantise_and_run(tmp_path, tiny_bundle):
    import onnx

    model = onnx.load(str(tiny_bundle / "edge" / "model.onnx"))
    onnx.save_model(model, str(tmp_path / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=external_data(tmp_path / "model.onnx").name)
    assert external_data(tmp_path / "model.onnx").stat().st_size > (tmp_path / "model.onnx").stat().st_size
    ids = np.random.default_rng(0).integers(3, 100, size=(2, 9))
    mask = np.ones_like(ids)
    inline = OnnxRuntimeBackend(tiny_bundle / "edge" / "model.onnx", threads=1)(ids, mask)
    np.testing.assert_allclose(OnnxRuntimeBackend(tmp_path / "model.onnx", threads=1)(ids, mask), inline, atol=1e-6)
    quantised = quantize_int8(tmp_path / "model.onnx", tmp_path / "model.int8.onnx", per_channel=True)
    assert external_data(quantised).is_file()
    int8 = OnnxRuntimeBackend(quantised, threads=1)(ids, mask)
    assert int8.shape == inline.shape and np.abs(int8 - inline).max() < 1.0


def test_paddle2onnx_s_own_reason_is_kept_when_it_aborts(tmp_path, portable_prefix):
    prefix = portable_prefix
    with pytest.raises(ConversionError, match=r"model.json: paddle2onnx failed \(exit -6\): .*"
                                              r"Please set the opset_version to 13"):
        convert_to_onnx(prefix, tmp_path / "model.onnx", opset=9)  # below what the config allows
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("opset", [13, 21])
def test_both_ends_of_the_allowed_opset_range_convert_and_compute_the_same_logits(tmp_path, tiny_bundle,
                                                                                  portable_prefix, opset):
    from train_deploy.export.backends import PaddleInferenceBackend
    from train_deploy.export.config import ServerConfig

    prefix = tiny_bundle / ("server" if fused_here() else "server_portable") / "model"  # ONNX: from the portable one
    ids = np.random.default_rng(opset).integers(3, 100, size=(2, 9))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    expected = PaddleInferenceBackend(prefix, ServerConfig())(ids, mask)
    got = OnnxRuntimeBackend(convert_to_onnx(portable_prefix, tmp_path / "model.onnx", opset=opset), threads=1)(ids,
                                                                                                           mask)
    np.testing.assert_allclose(got[:, 3:], expected[:, 3:], atol=1e-4)


def test_a_conversion_running_past_its_timeout_is_killed_and_names_the_model(tmp_path, portable_prefix):
    import psutil

    prefix = portable_prefix
    started = time.monotonic()
    with pytest.raises(ConversionError) as exc:
        convert_to_onnx(prefix, tmp_path / "model.onnx", opset=17, timeout=0.2)  # less than the child's imports
    assert str(exc.value) == (f"{prefix.with_suffix('.json')}: paddle2onnx did not finish within 0.2 s and was "
                              "stopped (export.edge.convert_timeout)")
    assert time.monotonic() - started < 30
    assert not any("train_deploy.export.edge" in " ".join(child.cmdline()) for child in psutil.Process().children())
    assert list(tmp_path.iterdir()) == []


def test_the_conversion_timeout_is_configured_and_must_be_positive():
    from train_deploy.config import ConfigError
    from train_deploy.export.config import ExportConfig

    assert ExportConfig.from_params({}).edge.convert_timeout == 1800
    assert ExportConfig.from_params({"edge": {"convert_timeout": 60}}).edge.convert_timeout == 60
    with pytest.raises(ConfigError, match=r"^export\.edge\.convert_timeout: must be positive \(got 0\); seconds$"):
        ExportConfig.from_params({"edge": {"convert_timeout": 0}})


@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_weights_are_blocks_of_int8_and_embedding_rows_are_int8(tmp_path, tiny_bundle, per_channel):
    import onnx

    source = tiny_bundle / "edge" / "model.onnx"
    fp32 = onnx.load(str(source))
    constant = {tensor.name for tensor in fp32.graph.initializer if len(tensor.dims) == 2}
    quantised = onnx.load(str(quantize_int8(source, tmp_path / "model.int8.onnx", per_channel=per_channel)))
    nodes = quantised.graph.node
    assert not [n for n in nodes if n.op_type in ("MatMul", "Gather") and set(n.input) & constant]  # all replaced
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert len(nbits) == sum(n.op_type == "MatMul" and n.input[1] in constant for n in fp32.graph.node) > 0
    attributes = [{a.name: a.i for a in n.attribute} for n in nbits]
    assert {(a["bits"], a["accuracy_level"]) for a in attributes} == {(8, 4)}
    assert all(a["block_size"] >= a["K"] if per_channel else a["block_size"] == 32 for a in attributes)
    matrices = [t for t in quantised.graph.initializer if len(t.dims) >= 2]
    assert {t.data_type for t in matrices} <= {onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.FLOAT}
    weights = sum(np.prod(t.dims) for t in matrices if t.data_type != onnx.TensorProto.FLOAT)
    assert weights >= sum(np.prod(t.dims) for t in fp32.graph.initializer if t.name in constant)  # all int8
    ids = np.random.default_rng(0).integers(3, 100, size=(2, 9))
    mask = np.ones_like(ids)
    expected = OnnxRuntimeBackend(source, threads=1)(ids, mask)
    got = OnnxRuntimeBackend(tmp_path / "model.int8.onnx", threads=1)(ids, mask)
    assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()


@pytest.mark.parametrize("name", ["model", "decode"])
def test_symbolic_dimensions_get_the_same_names_whatever_paddle2onnx_numbered_them(tiny_bundle, name):
    """paddle2onnx numbers them differently on each conversion of one graph (``DynamicDimension.3``, then ``.7``):
    any numbering gives the bundle's bytes back. Two whole exports compared file by file: the report of 2026-12-02."""
    import onnx

    exported = onnx.load(str(tiny_bundle / "edge" / f"{name}.onnx"), load_external_data=False)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(exported)
    symbols = sorted({d.dim_param for v in (*renamed.graph.input, *renamed.graph.output, *renamed.graph.value_info)
                      for d in v.type.tensor_type.shape.dim if d.HasField("dim_param")})
    numbers = np.random.default_rng(0).permutation(len(symbols))
    shuffled = {symbol: f"DynamicDimension.{n}" for symbol, n in zip(symbols, numbers, strict=True)}
    for value in (*renamed.graph.input, *renamed.graph.output, *renamed.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = shuffled[dim.dim_param]
    assert renamed.SerializeToString() != exported.SerializeToString()
    assert name_dimensions(renamed) == {numbered: symbol for symbol, numbered in shuffled.items()}
    assert renamed.SerializeToString() == exported.SerializeToString()
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in exported.graph.input}
    if name == "decode":  # one batch throughout, the mask's length, each cache's own past length
        assert shapes["input_ids"] == ["batch", 1] and shapes["attention_mask"] == ["batch", "seq"]
        assert shapes["keys_0"][::2] == ["batch", "past_seq"] and shapes["keys_1"][::2] == ["batch", "past_seq_1"]
    else:  # paddle2onnx gives each input its own symbols
        assert shapes == {"input_ids": ["batch", "seq"], "attention_mask": ["batch_1", "seq_1"]}
    int8 = onnx.load(str(tiny_bundle / "edge" / f"{name}.int8.onnx"), load_external_data=False)
    assert list(int8.graph.input) == list(exported.graph.input)  # quantised after the renaming


def _copying_graph():
    """x -> Concat(x, x) = c -> Relu(c) = r; outputs Identity(c) (c also feeds Relu), Identity(r), Identity(x) (a
    graph input: kept) and a second Identity(c)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Concat", ["x", "x"], ["c"], axis=1), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Identity", ["c"], ["out_c"]), helper.make_node("Identity", ["r"], ["out_r"]),
             helper.make_node("Identity", ["x"], ["out_x"]), helper.make_node("Identity", ["c"], ["out_c2"])]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "copies", [value("x", TensorProto.FLOAT, [2, 3])],
                              [value(name, TensorProto.FLOAT, shape) for name, shape in
                               (("out_c", [2, 6]), ("out_r", [2, 6]), ("out_x", [2, 3]), ("out_c2", [2, 6]))],
                              value_info=[value("c", TensorProto.FLOAT, [2, 6])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, x):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_an_output_that_copies_a_computed_tensor_becomes_that_tensor():
    """The decode graph's caches: Identity(Concat) as an output is the Concat itself, which still feeds the nodes
    it fed; an output copying a graph input, and a second copy of the same tensor, stay Identity; the answers are
    the same."""
    import onnx

    model = _copying_graph()
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    before = _run(model, x)
    assert drop_output_copies(model.graph) == 2
    onnx.checker.check_model(model, full_check=True)
    nodes = {node.output[0]: (node.op_type, list(node.input)) for node in model.graph.node}
    assert nodes == {"out_c": ("Concat", ["x", "x"]), "out_r": ("Relu", ["out_c"]),
                     "out_x": ("Identity", ["x"]), "out_c2": ("Identity", ["out_c"])}
    assert [v.name for v in model.graph.value_info] == []
    for got, expected in zip(_run(model, x), before, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_the_exported_graphs_return_their_caches_without_a_copy(tiny_bundle):
    """No output of the bundle's ONNX graphs (prefill and decode, fp32 and int8) is an Identity of a node's output."""
    import onnx

    for path in sorted((tiny_bundle / "edge").glob("*.onnx")):
        graph = onnx.load(path, load_external_data=False).graph
        outputs = {value.name for value in graph.output}
        computed = {name for node in graph.node for name in node.output}
        copies = [n.output[0] for n in graph.node if n.op_type == "Identity" and n.output[0] in outputs
                  and n.input[0] in computed]
        assert copies == [], path.name
