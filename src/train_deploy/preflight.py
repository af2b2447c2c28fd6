"""A run's configuration checked before any node runs: every stage's block, and what one stage needs of another.

The Kedro hook :class:`train_deploy.hooks.CheckConfiguration` calls :func:`check_run`, so that a bad value
stops ``kedro run`` at once with one line naming the key, not hours later inside a worker. Nodes still
validate their own block: each can also be called alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from train_deploy.averaging.config import AveragingConfig
from train_deploy.config import check
from train_deploy.corpus.config import CorpusConfig
from train_deploy.export.config import ExportConfig
from train_deploy.registry.config import RegistryConfig
from train_deploy.training.config import TrainingConfig

# Parameter block → the class whose ``from_params`` validates it (``conf/base/parameters_<block>.yml``).
STAGE_CONFIGS: dict[str, type] = {
    "corpus": CorpusConfig,
    "training": TrainingConfig,
    "averaging": AveragingConfig,
    "export": ExportConfig,
    "registry": RegistryConfig,
}


def check_run(params: Mapping[str, Any], stages: Collection[str]) -> dict[str, Any]:
    """Validate every stage block of ``params`` (a missing one has its defaults), then what the ``stages`` the
    run contains need of each other; return the typed configurations by block name."""
    configs = {name: cls.from_params(params.get(name)) for name, cls in STAGE_CONFIGS.items()}
    check_validation_split(configs["corpus"], configs["averaging"] if "averaging" in stages else None,
                           configs["export"] if "export" in stages else None)
    return configs


def check_validation_split(corpus: CorpusConfig, averaging: AveragingConfig | None,
                           export: ExportConfig | None) -> None:
    """Averaging compares checkpoints on the validation split and export checks parity on it: with either in
    the run (not None), the corpus stage must write one."""
    needs = [why for config, why in ((averaging, "averaging compares checkpoints on it"),
                                     (export, "export checks parity on it")) if config is not None]
    check(not needs or corpus.encoding.validation_fraction > 0, "corpus.encoding.validation_fraction",
          f"0 writes no validation split, but {' and '.join(needs)}; set it above 0 (e.g. 0.01)")
