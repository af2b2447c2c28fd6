"""The registry lock and recorded alias moves, with real processes on real stores: one mover at a time, a move
killed after any of its calls is completed by the next run, and rollback refuses what it cannot do in one line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from tests.helpers.registry import ModelStore, registry
from tests.mlflow_server import mlflow_server  # noqa: F401  (the fixture)
from train_deploy.registry.aliases import (
    CLAIM_PREFIX,
    LEASE_S,
    LOCK_SUFFIX,
    MOVE_TAG,
    AliasLock,
    repair_interrupted,
    rollback,
    stale,
)
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.history import read_history
from train_deploy.registry.retry import Retrying
from train_deploy.run_lock import holder_identity

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
