"""The project for tests: its folder, a copy of its configuration, tiny parameter blocks, publishing a node's folder."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from train_deploy.datasets import ArtifactFolderDataset, FolderWork

REPO = Path(__file__).resolve().parents[2]


# The smallest tokenizer SentencePiece accepts on a 200 KB People's Daily slice at 98% character coverage.
TINY_TOKENIZER = {"vocab_size": 2000, "character_coverage": 0.98}


TINY_SLICE = 200_000


def corpus_params(**blocks: dict) -> dict:
    """A `corpus` parameter block for the tiny slice, with ``blocks`` merged over each sub-block."""
    params = {
        "reader": {"max_bytes": TINY_SLICE, "chunk_bytes": 32 * 1024},
        "cleaning": {},
        "tokenizer": dict(TINY_TOKENIZER),
        "encoding": {"workers": 1, "progress": False},
    }
    for name, values in blocks.items():
        params[name] = {**params[name], **values}
    return params


def publish(work: FolderWork, folder: Path, description: type, **dataset: Any) -> Any:
    """Save a node's :class:`FolderWork` at ``folder`` through the catalog's folder dataset; return its load."""
    target = ArtifactFolderDataset(path=str(folder), description=f"{description.__module__}.{description.__name__}",
                                   **dataset)
    target.save(work)
    return target.load()


def published(folder: Path, description: type, **dataset: Any) -> Any:
    """What :func:`publish` returned, loaded again from ``folder`` (in another process)."""
    return ArtifactFolderDataset(path=str(folder), description=f"{description.__module__}.{description.__name__}",
                                 **dataset).load()


def copy_project(root: Path) -> Path:
    """The project's configuration (without conf/local, as a fresh checkout has it) in the new folder ``root``,
    which Kedro then runs as the project: its own data/, logs and run lock."""
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    for name in ("pyproject.toml", ".telemetry"):
        shutil.copy(REPO / name, root / name)
    (root / "src").mkdir()  # kedro checks that a source folder exists; the package itself is installed
    return root


def tiny_runtime_params() -> dict:
    """What `kedro run --params` would override for a quick run (nested, as the CLI builds it)."""
    return {"corpus": {
        "reader": {"max_bytes": TINY_SLICE, "chunk_bytes": 65536},
        "tokenizer": TINY_TOKENIZER,
        "encoding": {"workers": 2, "progress": False},
    }}


def cli_params(params: dict, prefix: str = "") -> list[str]:
    """Nested parameters as `kedro run --params` items (``corpus.reader.max_bytes=…``)."""
    items = []
    for key, value in params.items():
        if isinstance(value, dict):
            items += cli_params(value, f"{prefix}{key}.")
        else:
            items.append(f"{prefix}{key}={value}")
    return items


NO_SERVING_CHECK = {"serving_check": {"enabled": False}, "require_beats": "none"}
"""``registry`` keys for tests of a tiny model: no serving check before promotion (a server start per promotion;
the gate tests run it: tests/registry/test_gate.py, test_infra.py) and no baseline rule (a tiny model a few steps
old predicts worse than a unigram, so registry.require_beats' default would refuse every version; tests of the rule
set ``require_beats`` back)."""


def tiny_train_deploy_params(nproc: int = 1, **blocks: dict) -> dict:
    """A quick whole `train_deploy` (tiny model, 4 steps on ``nproc`` processes, light proofs), with ``blocks``
    merged over its blocks."""
    params = tiny_runtime_params()
    params["corpus"]["encoding"]["validation_fraction"] = 0.05
    params["training"] = {
        "model": {"preset": "tiny"},
        "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
        "schedule": {"max_steps": 4, "log_every": 1, "eval_every": 2, "checkpoint_every": 2},
        "launch": {"nproc_per_node": nproc},
    }
    # one timed call and one round of 4 generated tokens per form: the engine choice still has its numbers
    params["export"] = {"parity": {"samples": 2}, "latency": {"batch_sizes": [1], "repeats": 1, "warmup": 0,
                                                              "rounds": 1, "generate_tokens": 4}}
    params["registry"] = dict(NO_SERVING_CHECK)
    for name, values in blocks.items():
        params[name] = {**params.get(name, {}), **values}
    return params
