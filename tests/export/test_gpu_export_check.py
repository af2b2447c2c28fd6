"""benchmarks/gpu_export_check.py's engine rows: an engine that fails prints its error, the others still print."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.export import fused_here
from train_deploy.export.config import LatencyConfig, ServerConfig
from train_deploy.training.checkpoint import write_checkpoint
from train_deploy.training.config import TrainingConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_export_check.py"
VOCAB = 64


@pytest.fixture(scope="module")
def gpu_export_check():
    spec = importlib.util.spec_from_file_location("gpu_export_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random checkpoint and its saved server graph, as the GPU check builds the small preset."""
    import paddle

    from train_deploy.export.graph import load_inference_model, save_server_model
    from train_deploy.training.model import build_model

    folder = tmp_path_factory.mktemp("gpu_check")
    paddle.seed(0)
    model = build_model(TrainingConfig.from_params({"model": {"preset": "tiny"}}), vocab_size=VOCAB, eos_id=2)
    checkpoint = write_checkpoint(folder / "checkpoints", 1, dict(model.named_parameters()), {},
                                  {"step": 1, "model_config": model.config.to_dict()}, keep_last=1)
    return checkpoint, save_server_model(load_inference_model(checkpoint), folder / "server", portable=not fused_here())


def test_a_failing_engine_prints_its_error_and_the_working_engine_its_numbers(gpu_export_check, tiny_server):
    from train_deploy.export.backends import PaddleInferenceBackend
    from train_deploy.export.graph import eager_logits
    from train_deploy.training.evaluation import load_model

    checkpoint, prefix = tiny_server
    trained = load_model(checkpoint)
    reference = lambda ids, mask: eager_logits(trained, ids)  # noqa: E731
    windows = np.random.default_rng(0).integers(3, VOCAB, size=(2, 17), dtype=np.int64)
    timing = LatencyConfig(batch_sizes=[1, 8], seq_length=16, warmup=0, repeats=1, rounds=1)
    engines = [("TensorRT", "tensorrt_fp16", lambda: PaddleInferenceBackend(
                   prefix, ServerConfig(device="gpu", tensorrt=True), 128)),  # the CPU wheel has no GPU
               ("Paddle Inference CPU", "fp32", lambda: PaddleInferenceBackend(prefix, ServerConfig(), 128)),
               ("breaks when run", "fp16", lambda: _crashes)]
    rows = [gpu_export_check.engine_row(name, precision, make, reference, windows, VOCAB, latency=timing)
            for name, precision, make in engines]

    (failed, trt), (passed, cpu), (broken, run_error) = rows
    assert not failed and trt.startswith("| TensorRT | tensorrt_fp16 | error: BundleError: export.server.device: "
                                         "gpu needs the paddlepaddle-gpu wheel |")
    cells = [cell.strip() for cell in cpu.strip().strip("|").split("|")]
    assert passed and cells[:3] == ["Paddle Inference CPU", "fp32", "pass"]
    assert float(cells[3]) <= 1e-4 and float(cells[5]) > 0 and float(cells[6]) > 0  # diff, batch 1 and 8 p50
    assert not broken and run_error.startswith("| breaks when run | fp16 | error: RuntimeError: CUDA error: an "
                                               "illegal memory access was encountered |")
    assert all(row.endswith("|\n") and "\n" not in row[:-1] for _, row in rows)  # one table row each


def _crashes(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    raise RuntimeError("CUDA error: an illegal memory access was encountered\n  [Hint: …]")
