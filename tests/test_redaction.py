"""One redaction for every way out of the process, fed the texts real clients make: MLflow's connection error,
psycopg's refused connection, urllib's errors, the secrets of the environment, and a real process's console."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import psycopg
import pytest
from mlflow import MlflowClient
from mlflow.entities import Param, RunTag

from tests.http_receiver import Receiver
from tests.mlflow_server import free_port
from train_deploy.redaction import HIDDEN, one_line, redact, redact_mlflow, redact_value, treat_as_secret
from train_deploy.registry.gate import one_line as gate_one_line
from train_deploy.run_control.notify import NotifyConfig, message

SECRET = "S3cretPW"


def test_a_real_mlflow_connection_error_keeps_its_cause_without_the_password(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    with pytest.raises(Exception) as raised:
        MlflowClient(f"http://alice:{SECRET}@127.0.0.1:{port}").get_experiment("0")
    assert SECRET in str(raised.value)  # what MLflow says of it
    line = one_line(raised.value)
    assert line.startswith(f"MlflowException: API request to http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get "
                           "failed with exception HTTPConnectionPool(host='127.0.0.1'")
    assert gate_one_line(raised.value) == line  # a gate's reason is the same line
    assert SECRET not in line and "alice" not in line and len(line) == 300


def test_a_real_refused_postgres_connection_says_why_and_its_dsn_is_masked():
    port = free_port()
    uri = f"postgresql://bob:{SECRET}@127.0.0.1:{port}/mlflow"
    keywords = f"host=127.0.0.1 port={port} user=bob password={SECRET} dbname=mlflow"
    for dsn in (uri, keywords):
        with pytest.raises(psycopg.OperationalError) as raised:
            psycopg.connect(dsn, connect_timeout=5)
        assert one_line(raised.value) == (f'OperationalError: connection failed: connection to server at "127.0.0.1", '
                                          f"port {port} failed: Connection refused")
    # a line that names the DSN (a log line, a traceback's locals)
    assert redact(f"cannot reach {uri}: {raised.value}").startswith(f"cannot reach postgresql://127.0.0.1:{port}/mlflow:")
    assert redact(keywords) == f"host=127.0.0.1 port={port} user=bob password={HIDDEN} dbname=mlflow"


def test_urllib_errors_of_a_url_with_credentials_carry_none(monkeypatch):
    receiver = Receiver(status=401)
    token_url = receiver.url + f"?token={SECRET}&channel=ops"
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(urllib.request.Request(token_url, data=b"{}"), timeout=5)  # noqa: S310
    receiver.close()
    assert one_line(raised.value) == "HTTPError: HTTP Error 401: Unauthorized"
    assert redact(f"POST {raised.value.url} answered {raised.value.code}") == (
        f"POST {receiver.url}?token={HIDDEN}&channel=ops answered 401")
    monkeypatch.setenv("TD_TEAM_WEBHOOK", f"http://ops:{SECRET}@127.0.0.1:{free_port()}/hook")
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(os.environ["TD_TEAM_WEBHOOK"].replace(f"ops:{SECRET}@", ""), timeout=5)  # noqa: S310
    assert one_line(refused.value) == "URLError: <urlopen error [Errno 111] Connection refused>"
    assert SECRET not in redact(f"{os.environ['TD_TEAM_WEBHOOK']} {refused.value}")


@pytest.mark.parametrize("name", ["MLFLOW_TRACKING_PASSWORD", "PGPASSWORD", "TD_SOMETHING_TOKEN"])
def test_values_of_the_secret_variables_the_project_reads_are_masked_anywhere(monkeypatch, name):
    monkeypatch.setenv(name, SECRET)
    assert redact(f"login failed for alice with {SECRET}.") == f"login failed for alice with {HIDDEN}."


def test_the_alert_signing_secret_and_a_url_password_held_by_a_variable_are_masked(monkeypatch):
    monkeypatch.setenv("TD_ALERTS_SIGNING", "k9-signing-value")  # a name that does not say it is a secret
    assert redact("sig k9-signing-value") == "sig k9-signing-value"
    treat_as_secret("TD_ALERTS_SIGNING")  # what NotifyConfig(secret_env=…) declares
    assert redact("sig k9-signing-value") == f"sig {HIDDEN}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:p%40ss-w0rd@127.0.0.1:5000")
    assert redact("auth failed: p@ss-w0rd / p%40ss-w0rd") == f"auth failed: {HIDDEN} / {HIDDEN}"


def test_short_values_are_not_hunted_and_nested_values_are_walked(monkeypatch):
    monkeypatch.setenv("TD_FLAG_TOKEN", "1")
    assert redact("step 1 of 10") == "step 1 of 10"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    value = {"reason": f"x {SECRET}", "list": [f"http://a:{SECRET}@h", 3], "tuple": (SECRET,)}
    assert redact_value(value) == {"reason": f"x {HIDDEN}", "list": ["http://h", 3], "tuple": (HIDDEN,)}


# A process whose every way out holds the secret: a log record with a traceback, print(), a write to stderr, an
# uncaught exception in a thread and in the main thread.
_LEAKY = f"""
import logging, sys, threading
from train_deploy.redaction import redact_logging, redact_streams
redact_logging()
redact_streams()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
try:
    raise ConnectionError("API request to http://alice:{SECRET}@127.0.0.1:1/api failed")
except ConnectionError:
    logging.getLogger("leaky").exception("tracking failed with password={SECRET}")
print("View run at: http://alice:{SECRET}@127.0.0.1:1/#/runs/1")
sys.stderr.write("{SECRET} on stderr\\n")
thread = threading.Thread(target=lambda: 1 / 0 if "{SECRET}" else None)
thread.start(); thread.join()
raise RuntimeError("died with {SECRET} in hand")
"""


def test_a_process_with_redaction_installed_prints_no_secret_on_any_stream():
    done = subprocess.run([sys.executable, "-c", _LEAKY], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MLFLOW_TRACKING_PASSWORD": SECRET})
    console = done.stdout + done.stderr
    assert done.returncode == 1 and SECRET not in console, console
    assert "View run at: http://127.0.0.1:1/#/runs/1" in done.stdout
    assert f"ERROR tracking failed with password={HIDDEN}" in done.stderr
    assert "ConnectionError: API request to http://127.0.0.1:1/api failed" in done.stderr
    assert f"RuntimeError: died with {HIDDEN} in hand" in done.stderr and "ZeroDivisionError" in done.stderr


def test_tags_and_params_reach_mlflow_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    redact_mlflow()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    run = client.create_run("0", tags={"source": f"http://alice:{SECRET}@host/x"}, run_name="night.assets")
    assert client.get_run(run.info.run_id).info.run_name == "night.assets"  # what is not a secret goes through
    client.set_tag(run.info.run_id, "failure", f"died with {SECRET}")
    client.log_param(run.info.run_id, "dsn", f"host=db password={SECRET}")
    client.log_batch(run.info.run_id, params=[Param("token", SECRET)], tags=[RunTag("note", f"x {SECRET}")])
    client.create_registered_model("m")
    version = client.create_model_version("m", "runs:/x/model", run.info.run_id)
    client.set_model_version_tag("m", version.version, "reason", f"gate saw {SECRET}")
    client.set_registered_model_tag("m", "holder", f"{SECRET}@host")
    data = client.get_run(run.info.run_id).data
    assert (data.tags["source"], data.tags["failure"], data.tags["note"]) == (
        "http://host/x", f"died with {HIDDEN}", f"x {HIDDEN}")
    assert data.params == {"dsn": f"host=db password={HIDDEN}", "token": HIDDEN}
    assert client.get_model_version("m", version.version).tags["reason"] == f"gate saw {HIDDEN}"
    assert client.get_registered_model("m").tags["holder"] == f"{HIDDEN}@host"


def test_an_alert_is_redacted_of_its_signing_secret_and_webhook_variable(monkeypatch):
    monkeypatch.setenv("TD_SIGNING_VALUE", "sign-k3y-value")
    monkeypatch.setenv("TD_HOOK_URL", "http://127.0.0.1:9/hooks/T0KEN-in-path")
    NotifyConfig(webhooks=["env:TD_HOOK_URL"], secret_env="TD_SIGNING_VALUE")  # declares both secret
    body = message("failed", reason="sign-k3y-value rejected by http://127.0.0.1:9/hooks/T0KEN-in-path")
    assert body["reason"] == f"{HIDDEN} rejected by {HIDDEN}"
