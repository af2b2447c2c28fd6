"""The run description the training node writes as ``run.json`` and every worker (and ``train-deploy-join``) reads.

It holds the stage's validated :class:`~train_deploy.training.config.TrainingConfig` and resolved
:class:`~train_deploy.training.config.Layout`: a worker only deserialises them (``read_json``), it validates and
resolves nothing again. It lives beside the configuration rather than in ``train_deploy.handoffs``, which is below
every stage and may not import one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import with_config

from train_deploy.handoffs import DESCRIPTION, METRICS_FILE, DataSpec, InitSource
from train_deploy.training.config import Layout, TrainingConfig, resolve_layout


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class RunSpec:
    """Everything a worker needs: written by the training node as ``run.json``, read by every rank."""

    run_name: str
    """Corpus and configuration digest naming the checkpoint and log folders of this run."""
    training: TrainingConfig
    """The ``training`` block as the training stage's configure node validated it (a warm start's shape applied)."""
    layout: Layout
    """The parallel layout the node resolved for ``training.launch``'s world size and the tokenizer."""
    data: DataSpec
    checkpoints: str
    """The folder of this run's checkpoints (``step_*``), shared by a resumed run."""
    logs: str
    """The launcher's log folder (``node<R>/workerlog.<rank>``), the metrics and the result; readable by its
    owner only. Nothing here names the MLflow run: the training node sends the metrics there itself."""
    init: InitSource | None = None
    """The weights every rank loads before parallelising (None or no ``path``: from scratch); a resumed run's own
    checkpoint wins over them."""

    @property
    def metrics_path(self) -> Path:
        return Path(self.logs) / METRICS_FILE

    @property
    def result_path(self) -> Path:
        return Path(self.logs) / "result.json"


def run_spec(folder: Path, data: DataSpec, params: dict) -> RunSpec:
    """A run of the ``training`` block ``params`` in ``folder`` (``checkpoints/``, ``logs/``), validated and resolved
    as the training stage's configure node does, for runs outside the pipeline (benchmarks, tests); from scratch."""
    import copy

    config, folder = TrainingConfig.from_params(copy.deepcopy(params)), Path(folder)
    return RunSpec(run_name=folder.name, training=config, data=data, checkpoints=str(folder / "checkpoints"),
                   layout=resolve_layout(config, config.world_size, data.vocab_size), logs=str(folder / "logs"))
