"""A real SQLite MLflow store (``tests/registry/conftest.py``'s :class:`ModelStore`) holding four registered versions
of the session's tiny bundle, logged as a run of the pipeline logs them (the bundle as the run's ``export/bundle``
and as the version's model): 3 is ``champion``, 2 ``previous``, 1 and 4 rejected. Nothing is trained for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from tests.helpers.registry import ModelStore
from tests.helpers.retention import MODEL

ROLES = {"1": "rejected", "2": "previous", "3": "champion", "4": "rejected"}


@dataclass(frozen=True)
class Registered:
    store: ModelStore
    versions: dict[str, object]
    """Version number → its ``ModelVersion`` as registered (run id, model id)."""

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.store.tracking_uri, self.store.tracking_uri)


@pytest.fixture(scope="module")
def registered(tmp_path_factory, tiny_bundle) -> Registered:
    from train_deploy.registry.model import log_bundle_model

    store = ModelStore(tmp_path_factory.mktemp("retention_store"))
    with store.active():
        experiment = mlflow.create_experiment("retention", artifact_location=str(store.root / "artifacts"))
        for version, role in ROLES.items():
            with mlflow.start_run(experiment_id=experiment):
                mlflow.log_artifacts(str(tiny_bundle), "export/bundle")
                log_bundle_model(Path(tiny_bundle), registered_model_name=MODEL)
            _tag(store, version, role)
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    client.set_registered_model_alias(MODEL, "champion", "3")
    client.set_registered_model_alias(MODEL, "previous", "2")
    return Registered(store, {v: client.get_model_version(MODEL, v) for v in ROLES})


def _tag(store: ModelStore, version: str, role: str) -> None:
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    tags = {"training.run_name": f"run{version}", "bundle.fingerprint": f"bundle{version}",
            "corpus.fingerprint": f"corpus{version}", "tokenizer.hash": f"tokenizer{version}",
            "gate.decision": "rejected" if role == "rejected" else "promoted"}
    for key, value in tags.items():
        client.set_model_version_tag(MODEL, version, key, value)
