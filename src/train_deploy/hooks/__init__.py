"""Project hooks (registered in ``train_deploy.settings``), by concern:

- :mod:`.runs`: one run at a time, settings checked before the first node, skipped when nothing changed, its MLflow
  run ended ``FINISHED``, ``FAILED`` or ``KILLED``;
- :mod:`.tracking`: the local MLflow store and what a run is tagged with;
- :mod:`.alerts`: one message per run outcome to the ``notify`` receivers;
- :mod:`.display`: the console and log file, and the bundle and registry decision printed at the end.
"""

from train_deploy.hooks.alerts import RunAlerts
from train_deploy.hooks.display import ConsoleLogging, ShowBundle, ShowRegistryDecision
from train_deploy.hooks.runs import (
    CheckConfiguration,
    CloseMlflowRun,
    EndStoppedRun,
    OuterRunAware,
    ProjectRunLock,
    SkipUnchanged,
    end_mlflow_runs,
)
from train_deploy.hooks.tracking import (
    GateOnOwnCorpus,
    LineageTags,
    LocalMlflowStore,
    RelativeArtifactLocation,
    TagTrigger,
)

__all__ = ["CheckConfiguration", "CloseMlflowRun", "ConsoleLogging", "EndStoppedRun", "GateOnOwnCorpus",
           "LineageTags", "LocalMlflowStore", "OuterRunAware", "ProjectRunLock", "RelativeArtifactLocation",
           "RunAlerts", "ShowBundle", "ShowRegistryDecision", "SkipUnchanged", "TagTrigger", "end_mlflow_runs"]
