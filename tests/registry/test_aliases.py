"""The registry lock and recorded alias moves, with real processes on real stores: one mover at a time, a move
killed after any of its calls is completed by the next run, and rollback refuses what it cannot do in one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from tests.helpers.registry import ModelStore, registry
from tests.mlflow_server import MlflowAuthServer, User, mlflow_auth_server, mlflow_server  # noqa: F401  (fixtures)
from tests.test_run_lock import own_namespaces
from train_deploy.registry.aliases import (
    CLAIM_PREFIX,
    KEY_TAG,
    LEASE_S,
    LOCK_SUFFIX,
    MOVE_TAG,
    AliasLock,
    Move,
    repair_interrupted,
    rollback,
    stale,
)
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.history import read_history
from train_deploy.registry.retry import Retrying
from train_deploy.run_control.lock import holder_identity

MODEL = "aliases_test_lm"
# A mover that takes the lock, makes the first `steps` calls of a gate's move champion 1 → 2 (previous → 1), and is
# killed: what a SIGKILL, an OOM kill or a power cut between two calls leaves.
_KILLED_MOVE = """
import os, signal, sys
from mlflow import MlflowClient
from train_deploy.registry.aliases import AliasLock, Move
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.retry import Retrying

uri, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = MlflowClient(uri, uri)
lock = AliasLock(client, name, "a gate killed mid-move", Retrying(RetryConfig(attempts=1), uri))
lock.acquire()
event = {"time": "2026-12-02T01:02:03.000004+00:00", "event": "gate", "decision": "promoted", "version": "2"}
move = Move(champion="2", previous="1", start="1", event="history.20261202T010203.000004Z",
            tags={"gate.decision": "promoted"})
for what, call in lock.move_steps(move, event)[:steps]:
    call()
os.kill(os.getpid(), signal.SIGKILL)
"""
# Each of several processes adds 1 to a tag of the model, `rounds` times, reading and writing it under the lock:
# without mutual exclusion, increments are lost.
_COUNTER = """
import sys
from mlflow import MlflowClient
from train_deploy.registry.aliases import AliasLock
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.retry import Retrying

uri, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = MlflowClient(uri, uri)
for _ in range(rounds):
    with AliasLock(client, name, "counting", Retrying(RetryConfig(attempts=3, wait_seconds=1), uri)):
        count = int(client.get_registered_model(name).tags.get("count", "0"))
        client.set_registered_model_tag(name, "count", str(count + 1))
"""


def versions(store: ModelStore, count: int, name: str = MODEL, **aliases: str) -> MlflowClient:
    """``count`` versions of model ``name`` in ``store`` (their source an empty folder: no model is loaded here)."""
    client = MlflowClient(store.tracking_uri, store.tracking_uri)
    client.create_registered_model(name)
    source = store.root / "source"
    source.mkdir(parents=True, exist_ok=True)
    for _ in range(count):
        client.create_model_version(name, source=str(source))
    for alias, version in aliases.items():
        client.set_registered_model_alias(name, alias, version)
    return client


def aliases(client: MlflowClient, name: str = MODEL) -> dict[str, str]:
    return {alias: str(version) for alias, version in client.get_registered_model(name).aliases.items()}


def locked(client: MlflowClient, name: str = MODEL) -> bool:
    """Whether a lock model of ``name`` exists, or a claim on it (a mover's lock, held or left behind)."""
    lock_names = re.compile(re.escape(name + LOCK_SUFFIX) + r"(\.[0-9]+)?")
    return any(lock_names.fullmatch(model.name) for model in client.search_registered_models()) or any(
        tag.startswith(CLAIM_PREFIX) for tag in client.get_registered_model(name).tags)


@pytest.mark.slow  # a move killed after each of its calls: about a minute (make test-quick leaves it out)
def test_a_move_killed_after_any_of_its_calls_is_completed_by_the_next_run_then_rollback_works(tmp_path):
    store = ModelStore(tmp_path / "store")
    retry = Retrying(RetryConfig(attempts=1), store.tracking_uri)
    steps = range(1, 7)  # record, tag the version, history, previous, champion, clear
    clients = {step: versions(store, 2, f"{MODEL}_{step}", champion="1") for step in steps}
    killed = {step: subprocess.Popen([sys.executable, "-c", _KILLED_MOVE, store.tracking_uri, f"{MODEL}_{step}",
                                      str(step)], env=store.environment(), stderr=subprocess.PIPE, text=True)
              for step in steps}
    for process in killed.values():
        _, err = process.communicate(timeout=300)
        assert process.returncode == -signal.SIGKILL, err[-2000:]
    for step in steps:
        client, name = clients[step], f"{MODEL}_{step}"
        assert locked(client, name)  # the dead mover's lock is left behind
        assert (MOVE_TAG in client.get_registered_model(name).tags) == (step < 6)
        if step == 4:
            assert aliases(client, name) == {"champion": "1", "previous": "1"}  # the state issue 28 found

        # The next scheduled run's change check (before it reads the champion) breaks the dead process's lock and
        # completes the recorded move, the version's decision included.
        done = repair_interrupted(client, name, retry)
        assert (done or "").startswith("completed an interrupted alias move") == (step < 6), step
        assert aliases(client, name) == {"champion": "2", "previous": "1"}
        assert client.get_model_version(name, "2").tags["gate.decision"] == "promoted"
        assert MOVE_TAG not in client.get_registered_model(name).tags and locked(client, name) == (step == 6)

        rolled = rollback(client, name, retry)  # breaks a stale lock too
        assert rolled["reason"].endswith("champion from version 2 to version 1")
        assert aliases(client, name) == {"champion": "1", "previous": "2"} and not locked(client, name)
        history = [(event["decision"], event.get("version")) for event in read_history(client, name)]
        gate_event = [("promoted", "2")] if step >= 3 else []
        assert history == gate_event + ([("repair", "2")] if step < 6 else []) + [("rollback", "1")], step


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_rollback_with_no_champion_is_refused_in_one_line_and_changes_nothing(tmp_path):
    store = ModelStore(tmp_path / "store")
    client = versions(store, 2, previous="1")
    done = registry(store, "rollback", "--model", MODEL)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert f"registered model {MODEL}: no version has the alias 'champion', so there is no champion to roll back " \
           "from" in done.stderr
    assert aliases(client) == {"previous": "1"} and read_history(client, MODEL) == [] and not locked(client)


@pytest.mark.slow
def test_movers_on_one_server_take_the_lock_one_at_a_time(mlflow_server, tmp_path):  # noqa: F811
    uri, processes, rounds = mlflow_server.uri, 3, 4
    MlflowClient(uri, uri).create_registered_model(MODEL)
    env = ModelStore(tmp_path).environment()
    counters = [subprocess.Popen([sys.executable, "-c", _COUNTER, uri, MODEL, str(rounds)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(processes)]
    for counter in counters:
        _, err = counter.communicate(timeout=300)
        assert counter.returncode == 0, err[-2000:]
    client = MlflowClient(uri, uri)
    assert client.get_registered_model(MODEL).tags["count"] == str(processes * rounds)  # no increment lost
    assert not locked(client)


def test_a_lock_is_stale_when_its_process_in_this_pid_namespace_is_gone_or_it_outlived_the_lease():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    here, now, gone = holder_identity(), time.time(), int(ended.stdout)
    assert stale({**here, "pid": gone}, int(now * 1000), now) == (
        f"its process {gone} is gone (same pid namespace and boot as this one)")
    assert stale(here, int(now * 1000), now) == ""  # alive: this process
    # Not ours to judge: another container's pid namespace under the same host name, another boot, a record without
    # the namespace (host and pid alone).
    assert stale({**here, "pid": gone, "pid_ns": "pid:[4026599999]"}, int(now * 1000), now) == ""
    assert stale({**here, "pid": gone, "boot": "0" * 8 + here["boot"][8:]}, int(now * 1000), now) == ""
    assert stale({"host": here["host"], "pid": gone}, int(now * 1000), now) == ""
    old = int((now - LEASE_S - 1) * 1000)
    assert stale({"host": "elsewhere"}, old, now) == f"held for {LEASE_S + 1:.0f} s, longer than the lease of " \
                                                     f"{LEASE_S:.0f} s"
    assert stale({}, old, now).startswith("held for")  # a holder that cannot be read: by age alone


# A mover in a container of its own that shares the host name of another (--network host, hostNetwork pods):
# it takes the lock (A), or tries to for 3 s (B), and says what happened.
_CONTAINER = """
import json, os, socket, sys
socket.sethostname("shared-host")
from mlflow import MlflowClient
from train_deploy.registry.aliases import AliasLock, AliasMoveError
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.retry import Retrying

uri, name, role = sys.argv[1:4]
client = MlflowClient(uri, uri)
lock = AliasLock(client, name, f"a gate in container {role}", Retrying(RetryConfig(attempts=1), uri))
if role == "A":
    lock.acquire()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # holds the lock until the test says
    lock.check()
    lock.release()
    print(json.dumps({"released": True}), flush=True)
else:
    try:
        lock.acquire(timeout=3)
        print(json.dumps({"pid": os.getpid(), "took": True}))
    except AliasMoveError as held:
        print(json.dumps({"pid": os.getpid(), "refused": str(held)}))
"""


@pytest.mark.slow
def test_a_mover_in_another_pid_namespace_under_the_same_host_name_does_not_break_a_live_lock(tmp_path):
    store = ModelStore(tmp_path / "store")
    client = versions(store, 1)
    # A runs under a shell, as pid 2 of its namespace; B is pid 1 of its own, where no pid 2 exists.
    a = subprocess.Popen(own_namespaces("sh", "-c", f'"{sys.executable}" -c "$0" "$@"; exit $?', _CONTAINER,
                                        store.tracking_uri, MODEL, "A"),
                         env=store.environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(a.stdout.readline()) == {"pid": 2}
        b = subprocess.run(own_namespaces(sys.executable, "-c", _CONTAINER, store.tracking_uri, MODEL, "B"),
                           env=store.environment(), capture_output=True, text=True, timeout=120)
        assert b.returncode == 0, b.stderr[-2000:]
        outcome = json.loads(b.stdout)
        assert outcome["pid"] == 1, outcome
        refused = outcome["refused"]
        assert refused.startswith(f"registered model {MODEL}: the lock {MODEL}{LOCK_SUFFIX} is still held (a gate in "
                                  "container A by "), refused
        assert refused.endswith("after 3 s; no alias was changed") and ", pid 2 on shared-host, " in refused
        a.stdin.write("\n")
        a.stdin.flush()
        assert json.loads(a.stdout.readline()) == {"released": True}  # A held it throughout
        assert a.wait(60) == 0
    finally:
        a.kill()
        a.wait()
    assert not locked(client)


class _ReleasedMeanwhile(MlflowClient):
    """A client whose first lock insert meets a rival's lock that the rival releases before the server reads it
    back: MLflow's SQL store then answers RESOURCE_DOES_NOT_EXIST for the create (seen on PostgreSQL in CI)."""

    raced = False

    def create_registered_model(self, name, *args, **kwargs):
        if name.endswith(LOCK_SUFFIX) and not self.raced:
            self.raced = True
            super().create_registered_model(name)  # the rival takes the lock ...
            self.delete_registered_model(name)  # ... and releases it
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return super().create_registered_model(name, *args, **kwargs)


def test_a_lock_released_while_the_server_answers_the_insert_is_taken_on_the_next_try(tmp_path):
    store = ModelStore(tmp_path / "store")
    versions(store, 1)
    client = _ReleasedMeanwhile(store.tracking_uri, store.tracking_uri)
    with AliasLock(client, MODEL, "a gate", Retrying(RetryConfig(attempts=1), store.tracking_uri)) as lock:
        assert client.raced and locked(client)
        lock.check()  # this process holds it
    assert not locked(client)



class _ReleaseFails(MlflowClient):
    """A client whose first claim removal fails (the server went away for a moment during a release)."""

    failed = False

    def delete_registered_model_tag(self, name, key):
        if not self.failed:
            self.failed = True
            raise MlflowException("temporarily unavailable")
        return super().delete_registered_model_tag(name, key)


def test_a_mover_whose_release_failed_takes_the_lock_again_at_once_instead_of_waiting_out_its_own_lease(tmp_path):
    store = ModelStore(tmp_path / "store")
    versions(store, 1)
    client = _ReleaseFails(store.tracking_uri, store.tracking_uri)
    lock = AliasLock(client, MODEL, "a gate", Retrying(RetryConfig(attempts=1), store.tracking_uri))
    with lock:
        pass
    assert client.failed and locked(client)  # the release left its lock and claim behind: a live pid's
    started = time.monotonic()
    lock.acquire(timeout=3)  # its own leftover, not a live rival's: broken at once
    lock.check()
    lock.release()
    assert time.monotonic() - started < 3 and not locked(client)


# -- a read-only account on the team server (docs/team-server.md) --------------------------------------------------

def _as(monkeypatch: pytest.MonkeyPatch, user: User) -> None:
    """The MLflow clients of this process act as ``user`` from now on."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user.username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", user.password)


def _refused(call) -> str:
    """What the server answers ``call``: it must refuse it (HTTP 403)."""
    with pytest.raises(MlflowException) as refused:
        call()
    assert refused.value.get_http_status_code() == 403, refused.value
    return refused.value.error_code


def _registry_as(user: User, uri: str, tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**ModelStore(tmp_path).environment(), "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_TRACKING_USERNAME": user.username, "MLFLOW_TRACKING_PASSWORD": user.password}
    command = Path(sys.executable).parent / "train-deploy-registry"
    return subprocess.run([str(command), *args, "--model", MODEL, "--tracking-uri", uri], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_a_read_only_account_can_neither_hold_nor_block_the_lock_gates_and_rollback_go_on(
        mlflow_auth_server: MlflowAuthServer, monkeypatch, tmp_path, caplog):  # noqa: F811
    server, uri = mlflow_auth_server, mlflow_auth_server.uri
    server.stop()  # the guide's server: every account reads everything, writes what it is granted
    config = server.auth_config.read_text()
    server.auth_config.write_text(config.replace("default_permission = EDIT", "default_permission = READ"))
    server.start()
    trainer, reader = server.create_user("trainer"), server.create_user("server")
    client = MlflowClient(uri, uri)
    _as(monkeypatch, trainer)  # its first run creates the model: it manages it
    client.create_registered_model(MODEL)
    run = client.create_run(client.create_experiment("train_deploy")).info.run_id
    for _ in range(2):  # no model is loaded here: the source is never read
        client.create_model_version(MODEL, source=f"runs:/{run}/model", run_id=run)
    client.set_registered_model_alias(MODEL, "champion", "1")

    # The read-only account makes the lock's name and the next ones, each claiming a holder and a key; a claim on
    # the model it cannot write.
    _as(monkeypatch, reader)
    forged = [MODEL + LOCK_SUFFIX, *(f"{MODEL}{LOCK_SUFFIX}.{n}" for n in (1, 2))]
    for name in forged:
        client.create_registered_model(name, tags={KEY_TAG: "forged-key", "holder": "forged-holder-text"})
    assert _refused(lambda: client.set_registered_model_tag(MODEL, CLAIM_PREFIX + "x", "{}")) == "PERMISSION_DENIED"
    refused = _registry_as(reader, uri, tmp_path, "rollback")  # its own rollback: refused, creating nothing
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == (f"train-deploy-registry rollback: {uri}: permission denied (HTTP 403) for 'server': "
                              f"needs EDIT on registered model {MODEL}\n")

    # The trainer's gate takes the lock at once, under the next name.
    _as(monkeypatch, trainer)
    retry = Retrying(RetryConfig(attempts=1), uri)
    lock, started = AliasLock(client, MODEL, "gate of version 2", retry), time.monotonic()
    lock.acquire(timeout=20)  # the forged lock would hold it for the lease (600 s) before
    assert time.monotonic() - started < 10
    ours = f"{MODEL}{LOCK_SUFFIX}.3"
    assert [name for name in _lock_names(client) if name not in forged] == [ours]

    # While the trainer holds it, the read-only account changes nothing: it can neither delete the lock model or the
    # claim, nor move an alias; a copy of the lock under the next name, key included, holds nothing.
    _as(monkeypatch, reader)
    claim = next(tag for tag in client.get_registered_model(MODEL).tags if tag.startswith(CLAIM_PREFIX))
    assert _refused(lambda: client.delete_registered_model(ours)) == "PERMISSION_DENIED"
    assert _refused(lambda: client.delete_registered_model_tag(MODEL, claim)) == "PERMISSION_DENIED"
    assert _refused(lambda: client.set_registered_model_alias(MODEL, "champion", "2")) == "PERMISSION_DENIED"
    copied = client.get_registered_model(ours).tags[KEY_TAG]
    client.create_registered_model(f"{MODEL}{LOCK_SUFFIX}.4", tags={KEY_TAG: copied})
    _as(monkeypatch, trainer)
    lock.check()  # still the trainer's
    lock.move(Move(champion="2", previous="1", start="1", event="history.20261203T010203.000004Z"))
    lock.release()
    assert aliases(client) == {"champion": "2", "previous": "1"}

    # The emergency action, from the command line: at once too.
    started = time.monotonic()
    rolled = _registry_as(trainer, uri, tmp_path, "rollback")
    assert rolled.returncode == 0 and time.monotonic() - started < 30, rolled.stderr
    assert rolled.stdout.startswith(f"{MODEL}: rolled back by MLflow account 'trainer' (") and rolled.stdout.endswith(
        "): champion from version 2 to version 1\n")
    assert aliases(client) == {"champion": "1", "previous": "2"}
    # The trainer's locks are gone; what the read-only account made stays, holding nothing, and its words were never
    # repeated as a holder's.
    assert _lock_names(client) == [*forged, f"{MODEL}{LOCK_SUFFIX}.4"]
    assert not any(tag.startswith(CLAIM_PREFIX) for tag in client.get_registered_model(MODEL).tags)
    assert "forged-holder-text" not in caplog.text + rolled.stderr


def _lock_names(client: MlflowClient) -> list[str]:
    return sorted(model.name for model in client.search_registered_models() if LOCK_SUFFIX in model.name)
