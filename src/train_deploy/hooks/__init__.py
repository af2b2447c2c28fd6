"""Project hooks (registered in ``train_deploy.settings``), none depending on the order they are registered in:

- :mod:`.life`: :class:`RunLife`, the one owner of a run's life (lock, MLflow run, signals, preflight, skip
  decision, alerts), reading top to bottom; it calls the steps in :mod:`.runs`, :mod:`.tracking` and :mod:`.alerts`;
- :mod:`.tracking`: :class:`LineageTags`, what the datasets a run reads and writes tag its MLflow run with;
- :mod:`.display`: :class:`ShowResults`, the bundle and registry decision printed at the end.
"""

from train_deploy.hooks.display import ShowResults
from train_deploy.hooks.life import RunLife
from train_deploy.hooks.runs import end_mlflow_runs
from train_deploy.hooks.tracking import LineageTags

__all__ = ["LineageTags", "RunLife", "ShowResults", "end_mlflow_runs"]
