"""MLflow models of the tiny bundle, in SQLite stores of the test session's own, and fresh processes to use them.

``tiny_bundle``, ``model_store`` and ``tiny_model`` come from ``tests/conftest.py``; ``step_bundles`` are
bundles of three qualities (``tests.helpers.registry.GateProcess`` runs the gate in a process of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def step_bundles(tmp_path_factory, tiny_run, tiny_tokens, tiny_tokenizer, tiny_token_files, tiny_bundle) -> dict:
    """Bundles of the tiny model after 1, 3 and 6 training steps (``Bundle`` by step): worse, then better, on any
    held-out text (about 6.276, 6.244 and 6.208 nats per character on the gate tests' set)."""
    from tests.helpers.export import export_into
    from tests.helpers.training import launch, training_params
    from train_deploy.handoffs import Bundle

    one_step = launch(tmp_path_factory.mktemp("one_step"), tiny_tokens,
                      training_params(1, schedule={"max_steps": 1, "eval_every": 1, "checkpoint_every": 1}))
    bundles = {6: Bundle.read_folder(tiny_bundle)}
    for step, checkpoint in ((3, Path(tiny_run.checkpoints) / "step_00000003"), (1, Path(one_step.checkpoint))):
        folder = tmp_path_factory.mktemp(f"bundle_step{step}") / "bundle"
        export_into(folder, checkpoint, tiny_tokenizer, tiny_token_files)
        bundles[step] = Bundle.read_folder(folder)
    return bundles


