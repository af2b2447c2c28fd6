"""Export parameters and inputs for tests: the tiny bundle's settings, a selected checkpoint, training logs, an
older bundle's records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from train_deploy.atomic import atomic_folder
from train_deploy.export.bundle import export_bundle
from train_deploy.export.config import ExportConfig
from train_deploy.export.plots import TrainingCurves
from train_deploy.handoffs import (
    BUNDLE_FILE,
    Bundle,
    CheckpointRef,
    SelectedCheckpoint,
    TokenizerInfo,
    TokenManifest,
    TrainingResult,
    WorkFolder,
)

NO_CURVES = TrainingCurves(missing="not part of this test")


# Quick proofs: few windows, one timed call per form.
TEST_EXPORT = {"parity": {"samples": 4}, "latency": {"batch_sizes": [1, 2], "seq_length": 16, "warmup": 0,
                                                       "repeats": 1}}


def fused_here() -> bool:
    """Whether this machine runs Paddle's fused CPU kernels (the kernel probe): where it does not (no AVX-512),
    the tests that would run the fused graph take the portable one, and the bundle ships that alone."""
    from train_deploy.export.probe import fused_kernels

    return fused_kernels().runs


def export_params(**blocks) -> dict:
    params = {k: dict(v) for k, v in TEST_EXPORT.items()}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values} if isinstance(values, dict) else values
    return params


def selected(checkpoint: Path) -> SelectedCheckpoint:
    """``checkpoint`` (of :func:`tests.conftest.tiny_run`) as the averaging stage hands it to export: with the
    validation loss its run measured on its evaluation windows."""
    from tests.helpers.training import TINY_EVAL_WINDOWS

    ref = CheckpointRef.read_folder(checkpoint)
    return SelectedCheckpoint(checkpoint=ref, which="last", reason="last: test", validation_loss=ref.val_loss,
                              evaluated_on_windows=TINY_EVAL_WINDOWS)


def training_logs(folder: Path, run: TrainingResult) -> WorkFolder:
    """The catalog's ``training_logs`` as the training node lays it out (``<folder>/<run name>/metrics.jsonl``),
    holding a copy of ``run``'s metrics (a test run keeps them in ``<run folder>/logs``)."""
    logs = Path(folder) / run.run_name
    logs.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(run.checkpoints).parent / "logs" / "metrics.jsonl", logs / "metrics.jsonl")
    return WorkFolder(path=str(folder))


def export_into(folder: Path, checkpoint: Path, tokenizer: TokenizerInfo, tokens: TokenManifest,
                curves: TrainingCurves = NO_CURVES, **blocks) -> Bundle:
    """``export_bundle`` into a staging folder that becomes ``folder`` on success, as the catalog publishes it."""
    config = ExportConfig.from_params(export_params(**blocks))
    with atomic_folder(folder) as staging:
        return export_bundle(checkpoint, tokenizer, tokens, config, {"selection": "last: test"}, curves, staging)


SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 32}


def reference_llama(seed: int, **overrides):
    """PaddleNLP's LlamaForCausalLM with every weight random, RMSNorm scales included (folded by the graph)."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, **overrides}, use_flash_attention=False, use_fused_rms_norm=False,
                         use_fused_rope=False, dtype="float32")
    paddle.seed(seed)
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    for name, param in model.named_parameters():
        base = 1.0 if "norm" in name else 0.0
        param.set_value((base + 0.2 * rng.standard_normal(param.shape)).astype(np.float32))
    model.eval()
    return model


def as_older_bundle(folder: Path, format: int) -> None:
    """Make the bundle copy ``folder`` look exported before file hashes (format 7: no ``graphs`` either): its
    ``bundle.json`` records the sizes of the files it holds, as a format 8 export did."""
    meta = json.loads((Path(folder) / BUNDLE_FILE).read_text(encoding="utf-8"))
    meta["files"] = {path.relative_to(folder).as_posix(): path.stat().st_size
                     for path in sorted(Path(folder).rglob("*")) if path.is_file()}
    if format < 8:
        del meta["graphs"]
    (Path(folder) / BUNDLE_FILE).write_text(json.dumps({**meta, "format": format}), encoding="utf-8")
