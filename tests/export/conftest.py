"""The tiny checkpoint exported once per session, with quick parity and latency settings."""

from __future__ import annotations

from pathlib import Path

import pytest

# Quick proofs: few windows, one timed call per form.
TEST_EXPORT = {"parity": {"samples": 4}, "latency": {"batch_sizes": [1, 2], "seq_length": 16, "warmup": 0,
                                                       "repeats": 1}}


def export_params(output_dir: Path, **blocks) -> dict:
    params = {"output_dir": str(output_dir), **{k: dict(v) for k, v in TEST_EXPORT.items()}}
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values} if isinstance(values, dict) else values
    return params


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_checkpoint, tiny_tokenizer) -> Path:
    from train_deploy.corpus.tokenizer import TokenizerInfo
    from train_deploy.export.bundle import export_bundle
    from train_deploy.export.config import ExportConfig

    config = ExportConfig.from_params(export_params(tmp_path_factory.mktemp("bundles")))
    folder, reused = export_bundle(tiny_checkpoint, TokenizerInfo(**tiny_tokenizer), config, "tiny",
                                   {"selection": "last: test"})
    assert not reused
    return folder
