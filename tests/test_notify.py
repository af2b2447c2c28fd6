"""Alerts reach a real HTTP receiver on 127.0.0.1 and a real command; a receiver's failure is logged, never raised."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.http_receiver import Receiver, StallingReceiver
from train_deploy.config import ConfigError
from train_deploy.run_control.notify import NotifyConfig, deadline, notify, receiver_name, verify


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


def test_each_outcome_is_one_json_post(receiver):
    config = NotifyConfig(webhooks=[receiver.url])
    assert notify(config, "promoted", "/some/project", model="m", version="3", score=1.25, champion_score=1.5) == []
    assert notify(config, "failed", stage="export", reason="SIGKILL in export_bundle", log="logs/run.log") == []
    (_, first), (headers, second) = receiver.received
    promoted = json.loads(first)
    assert promoted["event"] == "promoted" and promoted["project"] == "project" and promoted["score"] == 1.25
    assert {"time", "host"} <= set(promoted) and headers["Content-Type"] == "application/json"
    assert json.loads(second)["stage"] == "export"


def test_a_webhook_url_can_come_from_the_environment(receiver, monkeypatch):
    monkeypatch.setenv("TD_TEAM_WEBHOOK", receiver.url)
    config = NotifyConfig.from_params({"webhooks": ["env:TD_TEAM_WEBHOOK", "env:TD_UNSET_WEBHOOK"]})
    failures = notify(config, "skipped", reason="unchanged")
    assert len(receiver.received) == 1 and failures == ["notify.webhooks: env:TD_UNSET_WEBHOOK holds no http(s) URL"]


def test_unwanted_events_are_not_sent(receiver):
    notify(NotifyConfig(webhooks=[receiver.url], events=["failed"]), "skipped", reason="unchanged")
    assert receiver.received == []


def test_signed_posts_verify_and_a_tampered_body_does_not(receiver, monkeypatch):
    monkeypatch.setenv("TD_NOTIFY_SECRET", "s3cret")
    notify(NotifyConfig(webhooks=[receiver.url], secret_env="TD_NOTIFY_SECRET"), "rejected", score=2.0)
    ((headers, body),) = receiver.received
    assert verify("s3cret", headers, body)
    assert not verify("s3cret", headers, body.replace(b"2.0", b"1.0"))
    assert not verify("other", headers, body)


def test_a_missing_secret_is_a_logged_failure_not_an_unsigned_post(receiver, caplog):
    failures = notify(NotifyConfig(webhooks=[receiver.url], secret_env="TD_UNSET_SECRET_VAR"), "failed")
    assert receiver.received == [] and "TD_UNSET_SECRET_VAR" in failures[0]


def test_down_erroring_and_slow_receivers_are_logged_without_the_url_path(caplog):
    down = Receiver()
    down.close()  # nothing listens on its port any more
    erroring, slow = Receiver(status=500), Receiver(delay=1.5)
    config = NotifyConfig(webhooks=[down.url, erroring.url, slow.url], timeout_seconds=0.5, attempts=2)
    with caplog.at_level(logging.WARNING, logger="train_deploy.run_control.notify"):
        start = time.monotonic()
        failures = notify(config, "failed", reason="boom")
        took = time.monotonic() - start
    erroring.close()
    slow.close()
    assert len(failures) == 3 and "unreachable" in failures[0] and "HTTP 500" in failures[1]
    assert len(erroring.received) == 2  # a 5xx is tried again
    assert took < 10
    assert "T0KEN" not in caplog.text and "secret-path" not in caplog.text and len(caplog.records) == 3


@pytest.mark.parametrize(("mode", "failure"), [
    ("trickle", "gave no complete answer within 5 s"),  # a byte every 1.5 s: no 2 s read ever times out
    ("silent", "unreachable (TimeoutError)"),
])
def test_a_receiver_that_trickles_or_never_answers_is_given_up_by_the_delivery_deadline(caplog, mode, failure):
    stalling = StallingReceiver(mode)
    config = NotifyConfig(webhooks=[stalling.url], timeout_seconds=2.0, attempts=2)
    assert deadline(config) == 5.0  # 2 tries of 2 s and the second between them
    outcome: list[list[str]] = []
    with caplog.at_level(logging.WARNING, logger="train_deploy.run_control.notify"):
        start = time.monotonic()
        sender = threading.Thread(target=lambda: outcome.append(notify(config, "failed", reason="boom")),
                                  daemon=True)  # daemon: on a delivery without a deadline the test fails, not hangs
        sender.start()
        sender.join(deadline(config) + 8.0)
        took = time.monotonic() - start
    stalling.close()
    assert not sender.is_alive(), f"notify() still blocked after {took:.0f} s"
    host = f"http://127.0.0.1:{stalling.url.split(':')[2].split('/')[0]}"
    assert outcome == [[f"{host} {failure}"]]
    assert deadline(config) - 0.5 < took < deadline(config) + 5.0  # delivery process start-up included
    assert [r.getMessage() for r in caplog.records] == [f"Could not notify the failed outcome: {host} {failure}"]
    assert stalling.connections == (1 if mode == "trickle" else 2)  # a trickled answer holds its one try

def test_a_command_gets_the_message_on_stdin(tmp_path):
    out = tmp_path / "messages.jsonl"
    script = f"import sys; open({str(out)!r}, 'ab').write(sys.stdin.buffer.read() + b'\\n')"
    config = NotifyConfig(command=f"{sys.executable} -c {json.dumps(script)}")
    assert notify(config, "validation_stopped", report=[{"statistic": "cjk_share", "value": 0.1}]) == []
    assert json.loads(out.read_text())["report"][0]["statistic"] == "cjk_share"


def test_a_failing_or_missing_command_is_reported_in_one_line(tmp_path):
    failing = NotifyConfig(command=f"{sys.executable} -c \"import sys; sys.exit('no mail server')\"")
    (failure,) = notify(failing, "failed")
    assert "exited 1" in failure and "no mail server" in failure
    (missing,) = notify(NotifyConfig(command=str(tmp_path / "no-such-command")), "failed")
    assert "could not start" in missing


def test_long_fields_are_cut(receiver):
    notify(NotifyConfig(webhooks=[receiver.url]), "failed", reason="x" * 100_000)
    assert len(json.loads(receiver.received[0][1])["reason"]) <= 2000


@pytest.mark.parametrize(("params", "key"), [
    ({"webhooks": ["ftp://host/x"]}, "notify.webhooks[0]"),
    ({"events": ["promoted", "exploded"]}, "notify.events"),
    ({"timeout_seconds": 0}, "notify.timeout_seconds"),
    ({"hooks": []}, "notify.hooks"),
])
def test_bad_settings_name_the_key(params, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        NotifyConfig.from_params(params)


def test_receiver_names_keep_scheme_host_and_port_only():
    assert receiver_name("https://hooks.example.com/services/T0/B1/XYZ?token=abc") == "https://hooks.example.com"
    assert receiver_name("http://127.0.0.1:8080/x") == "http://127.0.0.1:8080"
