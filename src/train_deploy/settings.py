"""Kedro project settings."""

from kedro.config import OmegaConfigLoader
from omegaconf.resolvers import oc

from train_deploy.console import quiet_third_party

quiet_third_party()  # before the hooks import MLflow, Paddle and PaddleNLP

from train_deploy.hooks import LineageTags, RunLife, ShowResults  # noqa: E402


def _artifact_location(tracking_uri: str) -> str | None:
    """Local stores keep artifacts in the project's mlartifacts/ (recorded absolute, as MLflow does:
    hooks.tracking.settle_artifact_location; `train-deploy relocate` after a move); a tracking server chooses its
    own (with --serve-artifacts it proxies them), or every client would write the run's artifacts to its own disk."""
    return "mlartifacts" if tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri else None


# RunLife owns a run's life from start to end (train_deploy.hooks.life); the other two are independent of it and of
# each other. No hook depends on the order they are listed in (tests/hooks/test_life.py runs them reversed).
HOOKS = (RunLife(), LineageTags(), ShowResults())

# kedro-telemetry is a dependency of kedro itself; its hooks never run in this project.
DISABLE_HOOKS_FOR_PLUGINS = ("kedro-telemetry", "kedro-viz")

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # `${oc.env:VAR,default}` lets MLFLOW_TRACKING_URI override conf/base/mlflow.yml.
    "custom_resolvers": {"oc.env": oc.env, "artifact_location": _artifact_location},
    "config_patterns": {"mlflow": ["mlflow*", "mlflow*/**"]},
    # conf/<env> changes only the keys it names (conf/local/parameters_corpus.yml holding corpus.reader.source
    # keeps the rest of conf/base's corpus block); Kedro's default replaces whole top-level blocks.
    "merge_strategy": {"parameters": "soft", "mlflow": "soft"},
}
