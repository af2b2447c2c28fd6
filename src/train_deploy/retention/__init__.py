"""Retention: what the project keeps on disk and in MLflow, removed by plan (``train-deploy gc``), and the disk
budget a run is checked against before its first node.

- :mod:`.config`: the ``retention`` parameter block;
- :mod:`.plan`: the project's folders (from the catalog) and what of them goes;
- :mod:`.store`: what the versions holding an alias need, and the rejected versions' MLflow artifacts;
- :mod:`.collect`: decide, remove, log and record, under the run lock;
- :mod:`.disk`: disk use, and the budget check.

Nothing a version holding an alias (``champion``, ``previous``) of any registered model of the project needs is ever
in a plan, nor a run a model's tags name (its evaluation set's). See docs/operations.md.
"""

from train_deploy.retention.collect import NothingToCollect, Plan, apply, collect_project, make_plan, read_records
from train_deploy.retention.config import RetentionConfig, parse_size
from train_deploy.retention.disk import OverBudget, check_budget, human, usage
from train_deploy.retention.plan import Kept, Layout, Removal, last_run_bytes

__all__ = ["Kept", "Layout", "NothingToCollect", "OverBudget", "Plan", "Removal", "RetentionConfig", "apply",
           "check_budget", "collect_project", "human", "last_run_bytes", "make_plan", "parse_size", "read_records",
           "usage"]
