"""The ``retention`` parameter block (``conf/base/parameters_retention.yml``): what ``train-deploy gc`` keeps, and the
disk budget a run is checked against before its first node."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field

from train_deploy.config import ConfigError, block, check, from_mapping

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | float | str | None, key: str) -> int | None:
    """Bytes of ``value``: a number of bytes, or a text such as ``"20GiB"``, ``"500 MB"`` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected bytes or a size such as '20GiB', got {value!r}")
    if isinstance(value, int | float):
        check(value >= 0, key, f"must not be negative (got {value!r})")
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"{key}: {value!r} is not a size (bytes, or a number with B, KB, MB, GB, TB, KiB, MiB, "
                          "GiB or TiB, e.g. '20GiB')")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


@block
class CheckpointRetention:
    """How many training runs' checkpoint folders to keep (``retention.checkpoints``)."""

    keep_runs: int = Field(2, ge=0)
    """The newest runs' folders kept (by last change) among runs that registered a version (of any project model,
    any decision; failed runs only fill places left), plus the newest of all (the run a retry resumes) and those of
    versions holding an alias; 0 keeps all. Within a run, ``training.schedule.keep_last`` still applies."""


@block
class LogRetention:
    """How many training runs' log folders to keep (``retention.training_logs``)."""

    keep_runs: int = Field(10, ge=0)
    """The newest runs' log folders kept (by last change), counted as ``checkpoints.keep_runs`` counts them;
    0 keeps all."""


@block
class BundleRetention:
    """Which bundle versions under the ``export_bundle`` entry (``data/07_model_output/bundle/<time>/``) stay."""

    keep_last: int = Field(3, ge=0)
    """The newest versions a registered version came from kept (others fill places left), plus the newest of all
    and the ones versions holding an alias were exported as; 0 keeps all."""


@block
class MlflowRetention:
    """What happens to the MLflow copies (the run's ``export/bundle`` and the logged model) of versions the gate
    did not promote."""

    delete_rejected: bool = True
    """Mark the runs and logged models of versions decided ``rejected`` (or whose gate ``failed``) deleted once
    ``grace_days`` have passed, then remove them for good with ``mlflow gc``; the version and its tags stay."""
    decisions: list[Literal["rejected", "failed", "undecided", "promoted", "first", "forced"]] = field(
        default_factory=lambda: ["rejected", "undecided", "failed"])
    """The gate decisions (``gate.decision``) whose versions' artifacts go (``undecided``: candidates the gate could
    not tell from the champion, which never hold an alias either); add ``promoted``, ``first`` and ``forced`` to
    remove retired champions' too (versions that hold no alias any more; rollback needs only ``previous``)."""
    unregistered: bool = True
    """Also remove, after ``grace_days``, what in the project's experiment no version was registered from: runs that
    ended ``FAILED`` or ``KILLED`` without a version, with their logged models (a night killed in the export or
    registry stage leaves the bundle's two copies there), and a logged model left beside a version's own by a
    retried log. Finished runs that registered nothing (run by hand) are kept."""
    grace_days: float = Field(7.0, ge=0)
    """Days after its registration a rejected version's artifacts are kept (to look at, or to promote by hand); for
    a failed run, days after it ended; for a retried log's model, days after it was logged."""
    gc_backend_store_uri: str | None = None
    """For a tracking server: the database ``mlflow gc --backend-store-uri`` removes from (run where it is
    reachable); null with a server only marks deleted and logs the command for its admin. Local stores need none."""
    gc_artifacts_destination: str | None = None
    """For a server that proxies artifacts: its ``--artifacts-destination`` (``mlflow gc --artifacts-destination``)."""


@block
class DiskBudget:
    """The disk budget a run is checked against before its first node (``retention.disk``)."""

    budget: Annotated[int, Field(ge=0)] | str | None = None
    """The most the project's folders (data/, and the local MLflow store and artifacts) may hold: bytes or a
    size such as ``"20GiB"``; null: no budget."""
    run_estimate: Annotated[int, Field(ge=0)] | str | None = None
    """What one run adds, as bytes or a size; null: the last run's outputs as measured on disk (newest checkpoint
    run, log folder and bundle version, and the bundle's two MLflow copies in a local store)."""

    def __post_init__(self) -> None:  # a size is bytes or a text such as "20GiB", which no field constraint reads
        parse_size(self.budget, "retention.disk.budget")
        parse_size(self.run_estimate, "retention.disk.run_estimate")

    @property
    def budget_bytes(self) -> int | None:
        return parse_size(self.budget, "retention.disk.budget")

    @property
    def estimate_bytes(self) -> int | None:
        return parse_size(self.run_estimate, "retention.disk.run_estimate")


@block
class RetentionConfig:
    """The ``retention`` block: what ``train-deploy gc`` removes and the disk budget (``train_deploy.retention``).

    Whatever these say, nothing a version holding an alias (``champion``, ``previous``, any other) of any registered
    model of the project needs is removed: its bundle version, its checkpoint and log folders, its token files and
    tokenizer, its MLflow run and logged model, and the champion's downloaded ``pretrained/`` for warm starts; nor a
    run a registered model's tags name (its evaluation set's, ``eval_set.uri``)."""

    checkpoints: CheckpointRetention = field(default_factory=CheckpointRetention)
    """Checkpoint folders of training runs (``data/06_models/checkpoints/<run>/``): superseded runs go."""
    training_logs: LogRetention = field(default_factory=LogRetention)
    """Training log folders (``data/08_reporting/training_logs/<run>/``)."""
    bundles: BundleRetention = field(default_factory=BundleRetention)
    """Bundle versions (``data/07_model_output/bundle/<time>/``)."""
    mlflow: MlflowRetention = field(default_factory=MlflowRetention)
    """MLflow artifacts of rejected versions."""
    disk: DiskBudget = field(default_factory=DiskBudget)
    """The disk budget."""
    after_scheduled_run: bool = True
    """``train-deploy schedule`` runs the collection after each run that ended with exit code 0."""
    record: str = "data/08_reporting/retention.jsonl"
    """Where each collection (not a dry run) appends one JSON line: what went, why, bytes, the disk use after and
    the last run's outputs' size; relative to the project folder."""

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RetentionConfig:
        return from_mapping(cls, params, "retention")
