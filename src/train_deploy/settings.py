"""Kedro project settings."""

from kedro.config import OmegaConfigLoader
from omegaconf.resolvers import oc

from train_deploy.hooks import CloseMlflowRun, ShowBundle

HOOKS = (CloseMlflowRun(), ShowBundle())

# kedro-telemetry is a dependency of kedro itself; its hooks never run in this project.
DISABLE_HOOKS_FOR_PLUGINS = ("kedro-telemetry",)

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # `${oc.env:VAR,default}` lets MLFLOW_TRACKING_URI override conf/base/mlflow.yml.
    "custom_resolvers": {"oc.env": oc.env},
    "config_patterns": {"mlflow": ["mlflow*", "mlflow*/**"]},
}
