"""The served tiny model that the server's test modules share: one server process per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.serving import AppServer, downloaded


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_store, tiny_model) -> Iterator[AppServer]:
    """The tiny model (logged with the default limits) served by the real server (``train_deploy.serving.app``) in
    its own process, from an empty folder."""
    model = downloaded(model_store, tiny_model.model_uri, tmp_path_factory.mktemp("served_model"))
    served = AppServer(model, model_store, tmp_path_factory.mktemp("served") / "empty")
    served.start()
    try:
        yield served
    finally:
        served.stop()
