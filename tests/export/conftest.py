"""The tiny checkpoint exported once per session, with quick parity and latency settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import publish
from train_deploy.atomic import atomic_folder
from train_deploy.export.bundle import export_bundle
from train_deploy.export.config import ExportConfig
from train_deploy.handoffs import Bundle, CheckpointRef, SelectedCheckpoint, TokenizerInfo, TokenManifest

# Quick proofs: few windows, one timed call per form.
TEST_EXPORT = {"parity": {"samples": 4}, "latency": {"batch_sizes": [1, 2], "seq_length": 16, "warmup": 0,
                                                       "repeats": 1}}


def export_params(**blocks) -> dict:
    params = {k: dict(v) for k, v in TEST_EXPORT.items()}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values} if isinstance(values, dict) else values
    return params


def selected(checkpoint: Path) -> SelectedCheckpoint:
    """``checkpoint`` as the averaging stage hands it to export."""
    return SelectedCheckpoint(checkpoint=CheckpointRef.read_folder(checkpoint), which="last", reason="last: test",
                              validation_loss=3.0, evaluated_on_windows=4)


def export_into(folder: Path, checkpoint: Path, tokenizer: TokenizerInfo, tokens: TokenManifest,
                **blocks) -> Bundle:
    """``export_bundle`` into a staging folder that becomes ``folder`` on success, as the catalog publishes it."""
    config = ExportConfig.from_params(export_params(**blocks))
    with atomic_folder(folder) as staging:
        return export_bundle(checkpoint, tokenizer, tokens, config, {"selection": "last: test"}, staging)


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_checkpoint, tiny_tokenizer, tiny_token_files) -> Path:
    """The tiny checkpoint exported through the export node and the catalog's versioned bundle dataset."""
    from train_deploy.pipelines.export.nodes import export_model

    work = export_model(export_params(), selected(tiny_checkpoint), tiny_tokenizer, tiny_token_files)
    bundle = publish(work, tmp_path_factory.mktemp("bundles") / "bundle", Bundle, versions=True)
    assert not bundle.reused
    return Path(bundle.path)
