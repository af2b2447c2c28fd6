"""The parameter blocks and their dataclasses (conf/base against the code)."""

from __future__ import annotations

from train_deploy.averaging.config import AveragingConfig
from train_deploy.corpus.config import CorpusConfig
from train_deploy.export.config import ExportConfig
from train_deploy.registry.config import RegistryConfig
from train_deploy.retention import RetentionConfig
from train_deploy.run_control.lock import RunConfig
from train_deploy.run_control.notify import NotifyConfig
from train_deploy.run_control.retrain import RetrainConfig
from train_deploy.training.config import TrainingConfig
from train_deploy.validation.config import ValidationConfig

# Parameter block → the dataclass that validates it; conf/base/parameters_<block>.yml holds the block.
BLOCKS: dict[str, type] = {
    "corpus": CorpusConfig,
    "training": TrainingConfig,
    "averaging": AveragingConfig,
    "export": ExportConfig,
    "registry": RegistryConfig,
    "run": RunConfig,
    "retrain": RetrainConfig,
    "notify": NotifyConfig,
    "validation": ValidationConfig,
    "retention": RetentionConfig,
}
