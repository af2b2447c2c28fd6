"""Elastic training (``training.launch.elastic``) on Paddle's launcher with a real etcd on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.etcd import etcd  # noqa: F401  (the fixture)


def _etcd3(url: str, code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` with an ``etcd3`` client ``c`` of ``url`` in a fresh interpreter (protobuf's implementation is
    chosen once per process, at its first import)."""
    host, port = url.removeprefix("etcd://").split(":")
    script = f"import etcd3\nc = etcd3.client(host={host!r}, port={port})\n{code}"
    variables = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**variables, **env})


def test_etcd_fixture_serves_the_client_paddle_imports(etcd):  # noqa: F811
    """The fixture's etcd answers the ``etcd3`` client Paddle's ETCDMaster imports, with the launcher's setting."""
    done = _etcd3(etcd, "c.put('/train_deploy/probe', b'42')\nprint(c.get('/train_deploy/probe')[0].decode())",
                  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    assert (done.returncode, done.stdout.strip()) == (0, "42"), done.stderr[-2000:]


def test_etcd3_needs_the_python_protobuf_setting(etcd):  # noqa: F811
    """Without PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, etcd3 0.12's generated code does not import: the
    reason the elastic launcher's environment sets it."""
    done = _etcd3(etcd, "print('imported')")
    assert done.returncode != 0 and "Descriptors cannot be created directly" in done.stderr, done.stderr[-2000:]
