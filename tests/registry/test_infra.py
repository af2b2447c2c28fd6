"""The serving check starts a registered version as production does: a model that cannot load fails it in one line.

The passing check and the gate's rejection of a candidate that fails it run in tests/registry/test_gate.py.
"""

from __future__ import annotations

import pytest

from train_deploy.registry.config import ServingCheckConfig
from train_deploy.registry.infra import ServingCheckFailed, check_serving


@pytest.mark.slow
def test_a_version_whose_files_are_damaged_fails_the_check_naming_why(model_store, tiny_bundle, tmp_path):
    info = model_store.log(tiny_bundle, registered_model_name="infra_damaged")
    (description,) = [p for p in model_store.root.rglob("bundle.json") if info.model_id in p.as_posix()]
    description.unlink()  # the served copy has lost its bundle description
    uri = model_store.tracking_uri
    with pytest.raises(ServingCheckFailed, match=r"^the server exited with code \d+ before answering: .*bundle\.json"):
        check_serving("models:/infra_damaged/1", uri, uri, ServingCheckConfig(timeout_seconds=240), tmp_path)


def test_the_time_limit_must_be_positive():
    from train_deploy.config import ConfigError
    from train_deploy.registry.config import RegistryConfig

    with pytest.raises(ConfigError, match="registry.serving_check.timeout_seconds"):
        RegistryConfig.from_params({"serving_check": {"timeout_seconds": 0}})
