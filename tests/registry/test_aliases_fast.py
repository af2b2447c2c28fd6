"""The alias moves' decisions (``train_deploy.registry.aliases``) against an in-memory stand-in of the MlflowClient
calls they make: taking, waiting for, breaking and releasing the lock, a move's steps in order, the repair of an
interrupted move and rollback's refusals, word for word. These run once per mutant of ``make mutation``;
tests/registry/test_aliases.py runs the same behaviour with real processes on real stores."""

from __future__ import annotations

import json
import logging
import re
import time
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    PERMISSION_DENIED,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
)
from mlflow.store.entities.paged_list import PagedList

from train_deploy.registry import aliases
from train_deploy.registry.aliases import (
    CLAIM_PREFIX,
    KEY_TAG,
    LEASE_S,
    MOVE_TAG,
    AliasLock,
    AliasMoveError,
    Claim,
    LockModel,
    LockState,
    Move,
    RollbackError,
    describe,
    repair_interrupted,
    rollback,
    stale,
)
from train_deploy.registry.config import RetryConfig
from train_deploy.registry.retry import RegistryRefused, Retrying
from train_deploy.run_control.lock import holder_identity

NAME = "lm"
LOCK = "lm.aliases-lock"
RETRY = Retrying(RetryConfig(attempts=1, wait_seconds=0), "sqlite:///unused.db")


class Named(Retrying):
    """The registry's retries, recording what each call is named (a failure's message names it)."""

    def __init__(self) -> None:
        super().__init__(RetryConfig(attempts=1, wait_seconds=0), "sqlite:///unused.db")
        self.names: list[str] = []

    def __call__(self, what, call):
        self.names.append(what)
        return super().__call__(what, call)


class Store:
    """The registered models, their tags, aliases and version tags, as MLflow's SQL store keeps them: the same
    exceptions (error codes and messages) for a model, an alias or a name that is missing or taken."""

    def __init__(self, page_size: int = 1000) -> None:
        self.models: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.written: list[tuple[str, str]] = []  # every registered-model tag set, in order
        self.page_size = page_size
        self.refuse_read: set[str] = set()  # models this account may not read (HTTP 403)
        self.reads = 0
        self.descriptions: dict[str, str | None] = {}

    def _tick(self) -> None:
        """No test needs this many reads: a mover past it is looping (a mutant of ``make mutation``), stopped at once
        rather than after the 11-minute default wait of ``acquire``."""
        self.reads += 1
        if self.reads > 2000:
            raise AssertionError("the mover is looping: more than 2000 registry reads")

    def _model(self, name: str) -> dict:
        if name not in self.models:
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return self.models[name]

    def add(self, name: str, tags: dict | None = None, created_ms: int | None = None, **aliases_: str) -> None:
        self.models[name] = {"tags": dict(tags or {}), "aliases": dict(aliases_), "versions": {},
                             "created": int(time.time() * 1000) if created_ms is None else created_ms}

    def create_registered_model(self, name: str, tags: dict | None = None, description: str | None = None):
        self.calls.append(("create", name))
        self._tick()
        if name in self.models:
            raise MlflowException(f"Registered Model (name={name}) already exists.", RESOURCE_ALREADY_EXISTS)
        self.add(name, tags)
        self.descriptions[name] = description
        return self.get_registered_model(name)

    def get_registered_model(self, name: str):
        if name in self.refuse_read:
            raise MlflowException("Permission denied", PERMISSION_DENIED)
        model = self._model(name)
        return SimpleNamespace(name=name, tags=dict(model["tags"]), creation_timestamp=model["created"])

    def delete_registered_model(self, name: str) -> None:
        self.calls.append(("delete", name))
        self._model(name)
        del self.models[name]

    def set_registered_model_tag(self, name: str, key: str, value: str) -> None:
        self.calls.append(("tag", name, key))
        self.written.append((key, value))
        self._model(name)["tags"][key] = value

    def delete_registered_model_tag(self, name: str, key: str) -> None:
        self.calls.append(("untag", name, key))
        self._model(name)["tags"].pop(key, None)

    def search_registered_models(self, filter_string: str, max_results: int, page_token: str | None = None):
        self._tick()
        if max_results > 1000:  # SEARCH_REGISTERED_MODEL_MAX_RESULTS_THRESHOLD
            raise MlflowException("Invalid value for request parameter max_results. It must be at most 1000, but got "
                                  f"value {max_results}", INVALID_PARAMETER_VALUE)
        prefix = re.fullmatch(r"name LIKE '(.*)%'", filter_string).group(1)
        names = sorted(n for n in self.models if n.startswith(prefix) and n not in self.refuse_read)  # READ only
        start = int(page_token or 0)
        end = start + min(max_results, self.page_size)
        page = [self.get_registered_model(n) for n in names[start:end]]
        return PagedList(page, str(end) if end < len(names) else None)

    def get_model_version_by_alias(self, name: str, alias: str):
        model = self._model(name)
        if alias not in model["aliases"]:
            raise MlflowException(f"Registered model alias {alias} not found.", INVALID_PARAMETER_VALUE)
        return SimpleNamespace(version=model["aliases"][alias])

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self.calls.append(("alias", alias, version))
        self._model(name)["aliases"][alias] = version

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self.calls.append(("version tag", version, key, value))
        self._model(name)["versions"].setdefault(version, {})[key] = value

    def tags(self, name: str = NAME) -> dict:
        return self.models[name]["tags"]

    def claims(self) -> dict:
        return {k: json.loads(v) for k, v in self.tags().items() if k.startswith(CLAIM_PREFIX)}


def _claim_of(store: Store, lock: str, key: str, created_ms: int, **holder) -> str:
    """A lock ``lock`` held by ``holder`` (another mover): its lock model with ``key``, and its claim on the model."""
    store.add(lock, {KEY_TAG: key}, created_ms=created_ms)
    tag = CLAIM_PREFIX + lock.replace(".", "_")
    record = {**holder, "lock": lock, "key_sha256": aliases._sha256(key)}
    store.tags()[tag] = json.dumps(record)
    return tag


def _live_holder() -> dict:
    return {**holder_identity(), "what": "a gate", "by": "ops@box", "since": "2026-12-04T08:00:00+00:00"}


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch) -> None:
    """Waits between tries last no time (a test that waits sets its own)."""
    monkeypatch.setattr(aliases, "POLL_S", 0.0)


@pytest.fixture
def store() -> Store:
    store = Store()
    store.add(NAME, {"other": "x"}, champion="1", previous="0")
    return store


def test_a_recorded_move_reads_back_with_its_defaults():
    move = Move(champion="2", previous="1", start="1", event="history.x", tags={"gate.decision": "promoted"})
    assert Move.from_json(json.dumps({"champion": "2", "previous": "1", "start": "1", "event": "history.x",
                                      "tags": {"gate.decision": "promoted"}})) == move
    assert Move.from_json('{"champion": 3}') == Move(champion="3", previous=None, start=None, event="", tags={})
    with pytest.raises(KeyError):
        Move.from_json("{}")


def test_only_a_claims_json_on_a_claim_tag_is_a_claim():
    good = json.dumps({"lock": LOCK, "key_sha256": "abc", "pid": 7})
    assert aliases._claim(CLAIM_PREFIX + "t", good) == Claim(CLAIM_PREFIX + "t", LOCK, "abc", {"pid": 7})
    assert aliases._claim("other.t", good) is None
    for text in ["not json", "[]", '{"key_sha256": "abc"}', '{"lock": 1, "key_sha256": "abc"}',
                 '{"lock": "x", "key_sha256": 2}', '{"lock": "x"}']:
        assert aliases._claim(CLAIM_PREFIX + "t", text) is None, text


def test_a_lock_model_is_held_only_by_a_claim_naming_it_and_its_keys_sha256():
    key = "secret"
    models = {LOCK: LockModel(LOCK, key, 1), LOCK + ".1": LockModel(LOCK + ".1", key, 2),
              LOCK + ".2": LockModel(LOCK + ".2", "", 3)}
    right = Claim("c1", LOCK, aliases._sha256(key), {"pid": 1})
    claims = [right, Claim("c2", LOCK + ".1", aliases._sha256("other"), {}),
              Claim("c3", LOCK + ".2", aliases._sha256(""), {})]
    state = LockState(models, claims)
    assert state.held() == [(models[LOCK], right)]
    assert state.unclaimed() == [models[LOCK + ".1"], models[LOCK + ".2"]]
    assert state.free_name(LOCK, set()) == LOCK + ".3"
    assert state.free_name(LOCK, {LOCK + ".3"}) == LOCK + ".4"
    assert LockState({}, []).free_name(LOCK, set()) == LOCK
    assert LockState({}, []).free_name(LOCK, {LOCK}) == LOCK + ".1"


def test_a_holder_is_described_in_a_few_words():
    assert describe(None) == describe({}) == "holder unknown"
    assert describe({"what": "a gate", "by": "ops", "pid": 7, "host": "box", "since": "t"}) == (
        "a gate by ops, pid 7 on box, since t")
    assert describe({"x": 1}) == "? by ?, pid ? on ?, since ?"


def test_a_lock_is_stale_when_its_process_is_gone_or_it_outlived_the_lease():
    live = holder_identity()
    assert stale(live, 1_000_000, now=1000 + LEASE_S) == ""
    assert stale(live, 1_000_000, now=1001 + LEASE_S) == "held for 601 s, longer than the lease of 600 s"
    assert stale(live, int(time.time() * 1000)) == ""
    assert stale(live, int((time.time() - LEASE_S - 5) * 1000)) == "held for 605 s, longer than the lease of 600 s"
    gone = {**live, "pid": 2**22 + 12345}
    assert stale(gone, 1_000_000, now=1000) == (
        f"its process {2**22 + 12345} is gone (same pid namespace and boot as this one)")


def test_the_lock_models_are_the_exact_names_over_every_page():
    store = Store(page_size=2)
    for name in [LOCK, LOCK + ".1", LOCK + ".12", LOCK + "x", LOCK + ".1a", LOCK + ".2"]:
        store.add(name, {KEY_TAG: name[-2:]} if name != LOCK + ".2" else {}, created_ms=5)
    found = aliases._lock_models(store, LOCK)
    assert found == {LOCK: LockModel(LOCK, "ck", 5), LOCK + ".1": LockModel(LOCK + ".1", ".1", 5),
                     LOCK + ".12": LockModel(LOCK + ".12", "12", 5), LOCK + ".2": LockModel(LOCK + ".2", "", 5)}
    store.models[LOCK]["created"] = None
    assert aliases._lock_models(store, LOCK)[LOCK].created_ms == 0


def test_the_lock_is_a_claim_then_a_lock_model_and_release_removes_both(store):
    retry = Named()
    lock = AliasLock(store, NAME, "a gate", retry)
    with lock:
        assert retry.names == ["list the lock models", "read the registered model", "claim the lock", "take the lock",
                               "list the lock models", "read the registered model"]
        ((tag, claim),) = store.claims().items()
        key = store.tags(LOCK)[KEY_TAG]
        assert (claim["lock"], claim["key_sha256"], claim["what"], claim["pid"]) == (
            LOCK, aliases._sha256(key), "a gate", holder_identity()["pid"])
        assert store.calls == [("tag", NAME, tag), ("create", LOCK)]
        assert (claim["by"], claim["since"][-6:], claim["claimed"][-6:], re.fullmatch("[0-9a-f]{32}", key) is not None,
                store.descriptions[LOCK]) == (
            aliases.who(), "+00:00", "+00:00", True, "train_deploy: held while the aliases of lm move; deleted by its "
            "holder")
        assert lock._held == (LOCK, key, tag)
        lock.check()
    assert store.calls[-2:] == [("untag", NAME, tag), ("delete", LOCK)]
    assert retry.names[6:] == ["list the lock models", "read the registered model", "read the registered model",
                               "drop the claim", "read the lock", "delete the lock"]
    assert sorted(store.models) == [NAME] and store.tags() == {"other": "x"} and lock._held is None
    lock.release()  # released twice: nothing more
    assert store.calls[-1] == ("delete", LOCK)
    never = AliasLock(store, NAME, "a gate", RETRY)
    never.release()
    with pytest.raises(AliasMoveError, match="the lock was taken over"):
        never.check()


def test_a_move_makes_its_calls_in_the_recorded_order_and_clears_its_record(store):
    move = Move(champion="2", previous="1", start="1", event="history.x", tags={"gate.decision": "promoted"})
    event = {"time": "2026-12-02T01:02:03.000004+00:00", "event": "gate", "version": "2"}
    retry = Named()
    with AliasLock(store, NAME, "a gate", retry) as lock:
        store.calls.clear()
        retry.names.clear()
        steps = [what for what, _ in lock.move_steps(move, event)]
        assert steps == ["record the alias move", "tag the version", "record the history", "move previous",
                         "move champion", "clear the alias move"]
        lock.move(move, event)
        assert store.calls == [("tag", NAME, MOVE_TAG), ("version tag", "2", "gate.decision", "promoted"),
                               ("tag", NAME, "history.20261202T010203.000004Z"), ("alias", "previous", "1"),
                               ("alias", "champion", "2"), ("untag", NAME, MOVE_TAG)]
        assert retry.names == steps[:3] + ["move previous", "list the lock models", "read the registered model",
                                           "move champion", "list the lock models", "read the registered model",
                                           "clear the alias move"]
    assert store.models[NAME]["aliases"] == {"champion": "2", "previous": "1"}
    assert json.loads(store.tags()["history.20261202T010203.000004Z"])["version"] == "2"
    assert MOVE_TAG not in store.tags()
    assert [w for w, _ in AliasLock(store, NAME, "x", RETRY).move_steps(
        Move(champion="3", previous=None, start="2", event="e"))] == [
        "record the alias move", "tag the version", "move champion", "clear the alias move"]


def test_a_recorded_move_holds_every_field(store):
    move = Move(champion="2", previous="1", start="1", event="history.x", tags={"a": "b"})
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        lock.move_steps(move)[0][1]()
        assert json.loads(store.tags()[MOVE_TAG]) == {"champion": "2", "previous": "1", "start": "1",
                                                       "event": "history.x", "tags": {"a": "b"}}


def test_an_alias_call_after_a_takeover_is_refused_naming_the_new_holder(store):
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        ((tag, _),) = store.claims().items()
        del store.tags()[tag]
        other = _claim_of(store, LOCK + ".1", "k2", 1, what="a rollback", by="ann", pid=9, host="h", since="s")
        with pytest.raises(AliasMoveError, match=re.escape(
                "registered model lm: the lock was taken over (a rollback by ann, pid 9 on h, since s) before this "
                "move finished; its record aliases.move lets the next mover complete it")):
            lock.move(Move(champion="2", previous=None, start="1", event="e"))
        assert store.models[NAME]["aliases"]["champion"] == "1"
        del store.tags()[other]
        with pytest.raises(AliasMoveError, match=re.escape("taken over (holder unknown)")):
            lock.check()


@pytest.mark.parametrize("change", ["key", "model"])
def test_the_lock_is_not_held_once_its_model_changed(store, change):
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        if change == "key":
            store.tags(LOCK)[KEY_TAG] = "other"
        else:
            del store.models[LOCK]
        with pytest.raises(AliasMoveError, match="the lock was taken over"):
            lock.check()


def test_a_live_holder_is_waited_for_and_the_timeout_names_it(store, monkeypatch, caplog):
    store.add(LOCK, {}, created_ms=int(time.time() * 1000))  # unclaimed: holds nothing
    tag = _claim_of(store, LOCK + ".1", "k", int(time.time() * 1000), **_live_holder())
    monkeypatch.setattr(aliases, "POLL_S", 0.01)
    caplog.set_level(logging.INFO, logger="train_deploy.registry.aliases")
    holder = _live_holder()
    with pytest.raises(AliasMoveError, match=re.escape(
            f"registered model lm: the lock {LOCK}.1 is still held (a gate by ops@box, pid {holder['pid']} on "
            f"{holder['host']}, since 2026-12-04T08:00:00+00:00) after 0 s; no alias was changed")):
        AliasLock(store, NAME, "another", RETRY).acquire(timeout=0.05)
    waits = [r.getMessage() for r in caplog.records if "waiting for the lock" in r.getMessage()]
    assert waits == [f"Registered model lm: waiting for the lock {LOCK}.1 (a gate by ops@box, pid {holder['pid']} on "
                     f"{holder['host']}, since 2026-12-04T08:00:00+00:00)"]
    assert tag in store.tags() and LOCK + ".1" in store.models
    assert [c for c in store.claims() if c != tag] == []  # each try's own claim was dropped


def test_a_lock_whose_holder_is_gone_is_broken_and_taken(store, caplog):
    gone = {**_live_holder(), "pid": 2**22 + 12345}
    tag = _claim_of(store, LOCK, "k", int(time.time() * 1000), **gone)
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        assert tag not in store.tags()
        assert lock._held[0] == LOCK and store.tags(LOCK)[KEY_TAG] == lock._held[1]
    assert store.calls[:2] == [("untag", NAME, tag), ("delete", LOCK)]
    assert any(r.getMessage() == f"Registered model lm: broke the stale lock {LOCK} (a gate by ops@box, pid "
               f"{gone['pid']} on {gone['host']}, since 2026-12-04T08:00:00+00:00: its process {gone['pid']} is "
               "gone (same pid namespace and boot as this one))" for r in caplog.records)


def test_a_lock_older_than_the_lease_is_broken_and_a_younger_one_waited_for(store, monkeypatch):
    monkeypatch.setattr(aliases, "POLL_S", 0.01)
    old = _claim_of(store, LOCK, "k", int((time.time() - LEASE_S - 5) * 1000), **_live_holder())
    with AliasLock(store, NAME, "a gate", RETRY):
        assert old not in store.tags()
    _claim_of(store, LOCK, "k", int((time.time() - LEASE_S + 30) * 1000), **_live_holder())
    with pytest.raises(AliasMoveError, match="is still held"):
        AliasLock(store, NAME, "a gate", RETRY).acquire(timeout=0.02)


def test_an_unclaimed_lock_model_holds_nothing_and_is_warned_about_once_when_old(store, caplog):
    store.add(LOCK, {KEY_TAG: "k"}, created_ms=int((time.time() - 60) * 1000))
    store.add(LOCK + ".1", {}, created_ms=int(time.time() * 1000))
    lock = AliasLock(store, NAME, "a gate", RETRY)
    with lock:
        assert lock._held[0] == LOCK + ".2"
    with lock:
        pass
    warnings = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert warnings == [f"Registered model lm: ignoring {LOCK}, a registered model named like its lock that no mover "
                        "of lm claimed (made by an account without EDIT on lm, or left by an interrupted mover); it "
                        "holds nothing, and an admin may delete it"]
    assert sorted(store.models) == [NAME, LOCK, LOCK + ".1"]  # never deleted


def test_a_name_taken_meanwhile_moves_on_and_an_unreadable_one_is_skipped(store, monkeypatch):
    created = store.create_registered_model

    def create(name, tags=None, description=None):
        if name == LOCK and LOCK not in store.models:  # another account takes the name between read and create
            store.add(LOCK, {KEY_TAG: "theirs"})
            store.refuse_read.add(LOCK)
        return created(name, tags, description)

    monkeypatch.setattr(store, "create_registered_model", create)
    retry = Named()
    lock = AliasLock(store, NAME, "a gate", retry)
    with lock:
        assert lock._held[0] == LOCK + ".1" and lock._unreadable == {LOCK}
        assert retry.names == ["list the lock models", "read the registered model", "claim the lock", "take the lock",
                               "read the lock", "read the registered model", "drop the claim",
                               "list the lock models", "read the registered model", "claim the lock", "take the lock",
                               "list the lock models", "read the registered model"]
        assert [c["lock"] for c in store.claims().values()] == [LOCK + ".1"]
    assert sorted(store.models) == [NAME, LOCK]


def test_a_lost_answer_to_the_create_counts_when_the_key_is_this_movers(store, monkeypatch):
    created = store.create_registered_model
    lost: list[str] = []

    def create(name, tags=None, description=None):
        if not lost:
            lost.append(name)
            created(name, tags, description)
        return created(name, tags, description)  # the retried create finds its own model

    monkeypatch.setattr(store, "create_registered_model", create)
    retry = Named()
    lock = AliasLock(store, NAME, "a gate", retry)
    with lock:
        assert lock._held[0] == LOCK and store.tags(LOCK)[KEY_TAG] == lock._held[1]
        assert [c for c in store.calls if c[0] in ("create", "delete")] == [("create", LOCK), ("create", LOCK)]
        assert retry.names[2:5] == ["claim the lock", "take the lock", "read the lock"]


def test_a_create_meeting_a_released_lock_tries_the_same_name_again(store, monkeypatch):
    created = store.create_registered_model
    answers = [MlflowException("gone", RESOURCE_DOES_NOT_EXIST)]

    def create(name, tags=None, description=None):
        if answers:
            raise answers.pop()
        return created(name, tags, description)

    monkeypatch.setattr(store, "create_registered_model", create)
    retry = Named()
    with AliasLock(store, NAME, "a gate", retry) as lock:
        assert lock._held[0] == LOCK
        assert retry.names[2:5] == ["claim the lock", "take the lock", "take the lock"]


def test_a_lock_released_between_the_create_and_its_read_is_created_again(store, monkeypatch):
    created, reads = store.create_registered_model, store.get_registered_model
    state = {"taken": 0, "gone": 0}

    def create(name, tags=None, description=None):
        if not state["taken"]:  # another mover's lock has the name ...
            state["taken"] = 1
            raise MlflowException(f"Registered Model (name={name}) already exists.", RESOURCE_ALREADY_EXISTS)
        return created(name, tags, description)

    def read(name):
        if name == LOCK and not state["gone"]:  # ... and is released before this one reads it
            state["gone"] = 1
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return reads(name)

    monkeypatch.setattr(store, "create_registered_model", create)
    monkeypatch.setattr(store, "get_registered_model", read)
    retry = Named()
    with AliasLock(store, NAME, "a gate", retry) as lock:
        assert lock._held[0] == LOCK
        assert retry.names[2:6] == ["claim the lock", "take the lock", "read the lock", "take the lock"]


def test_another_error_reading_a_taken_lock_name_is_raised(store, monkeypatch):
    store.add(LOCK + "x", {})  # found by the search's prefix, not a lock name
    reads = store.get_registered_model

    def create(name, tags=None, description=None):
        raise MlflowException(f"Registered Model (name={name}) already exists.", RESOURCE_ALREADY_EXISTS)

    def read(name):
        if name == LOCK:
            raise MlflowException("bad", INVALID_PARAMETER_VALUE)
        return reads(name)

    monkeypatch.setattr(store, "create_registered_model", create)
    monkeypatch.setattr(store, "get_registered_model", read)
    with pytest.raises(MlflowException, match="^bad$"):
        AliasLock(store, NAME, "a gate", RETRY).acquire()


def test_another_error_of_the_create_drops_the_claim_and_is_raised(store, monkeypatch):
    def create(name, tags=None, description=None):
        raise MlflowException("bad", INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(store, "create_registered_model", create)
    with pytest.raises(MlflowException, match="bad"):
        AliasLock(store, NAME, "a gate", RETRY).acquire()
    assert store.claims() == {}


def test_a_rival_that_created_its_lock_meanwhile_keeps_it(store, monkeypatch):
    created = store.create_registered_model
    rival: list[str] = []

    def create(name, tags=None, description=None):
        result = created(name, tags, description)
        if not rival:  # a rival read before this lock existed and created the next name
            rival.append(_claim_of(store, LOCK + ".1", "rk", int(time.time() * 1000), **_live_holder()))
        return result

    monkeypatch.setattr(store, "create_registered_model", create)
    pauses: list[tuple] = []
    monkeypatch.setattr(aliases, "random", SimpleNamespace(uniform=lambda low, high: pauses.append((low, high)) or 0))
    lock = AliasLock(store, NAME, "a gate", RETRY)
    holder = lock._try()
    assert holder == {**_live_holder(), "lock": LOCK + ".1"}
    assert lock._held is None and LOCK not in store.models and list(store.claims()) == rival
    assert pauses == [(0, 0.0)]  # up to POLL_S (0 here)


def test_claims_older_than_the_lease_without_a_lock_model_are_dropped(store):
    old = (time.time() - LEASE_S - 60)
    import datetime as dt
    stamp = dt.datetime.fromtimestamp(old, dt.UTC).isoformat(timespec="seconds")
    young = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    store.tags()[CLAIM_PREFIX + "old"] = json.dumps({"lock": "x", "key_sha256": "s", "claimed": stamp})
    store.tags()[CLAIM_PREFIX + "young"] = json.dumps({"lock": "y", "key_sha256": "s", "claimed": young})
    store.tags()[CLAIM_PREFIX + "undated"] = json.dumps({"lock": "z", "key_sha256": "s"})
    store.tags()[CLAIM_PREFIX + "number"] = json.dumps({"lock": "z", "key_sha256": "s", "claimed": 5})
    retry = Named()
    with AliasLock(store, NAME, "a gate", retry):
        assert sorted(t.removeprefix(CLAIM_PREFIX) for t in store.claims())[2:] == ["undated", "young"]
        assert "number" in "".join(store.claims()) and retry.names[-1] == "drop an orphan claim"
        assert CLAIM_PREFIX + "old" not in store.tags()


def test_release_leaves_a_lock_whose_claim_was_removed_and_never_raises(store, caplog):
    lock = AliasLock(store, NAME, "a gate", RETRY)
    lock.acquire()
    ((tag, _),) = store.claims().items()
    del store.tags()[tag]
    lock.release()
    assert LOCK not in store.models
    assert any(r.getMessage() == f"Registered model lm: the lock {LOCK} was no longer this process's on release "
               "(its claim was removed: broken as stale)" for r in caplog.records)
    lock.acquire()
    store.refuse_read.add(NAME)
    lock.release()
    assert any(r.getMessage() == f"Registered model lm: could not release the lock {LOCK} (MLflow tracking server "
               "sqlite:///unused.db refused read the registered model for 'no credentials' (HTTP 403): the account "
               "needs READ on the registered model to read it, EDIT to register versions or move aliases, and the "
               "right to create registered models for a model's first version and the registry lock "
               "(docs/team-server.md))" for r in caplog.records)


def test_a_lock_model_with_another_key_is_not_deleted(store):
    lock = AliasLock(store, NAME, "a gate", RETRY)
    store.add(LOCK, {KEY_TAG: "theirs"})
    lock._delete_lock_model(LOCK, "mine")
    assert LOCK in store.models
    lock._delete_lock_model(LOCK + ".9", "mine")  # gone meanwhile: nothing to do
    store.refuse_read.add(LOCK)
    lock._unreadable.add(LOCK)
    lock._delete_lock_model(LOCK, "theirs")
    assert LOCK in store.models


def _record(store: Store, **move) -> None:
    store.tags()[MOVE_TAG] = json.dumps({"start": "1", "event": "history.x", **move})


@pytest.mark.parametrize("at", ["1", "2"])  # not `champion`: a fixture of that name marks a test `trained`
def test_an_interrupted_move_is_completed_when_champion_is_at_its_start_or_its_end(store, at, caplog):
    store.models[NAME]["aliases"]["champion"] = at
    _record(store, champion="2", previous="1", tags={"gate.decision": "promoted"})
    done = repair_interrupted(store, NAME, RETRY)
    assert done == "completed an interrupted alias move: champion → version 2, previous → version 1 (history.x)"
    assert store.models[NAME]["aliases"] == {"champion": "2", "previous": "1"}
    assert store.models[NAME]["versions"] == {"2": {"gate.decision": "promoted"}}
    assert MOVE_TAG not in store.tags() and sorted(store.models) == [NAME]
    (history,) = [json.loads(v) for k, v in store.tags().items() if k.startswith("history.")]
    assert {k: history[k] for k in ("event", "decision", "version", "champion", "previous")} == {
        "event": "repair", "decision": "repair", "version": "2", "champion": "2", "previous": "1"}
    assert history["reason"].startswith(done + ", by ") and history["time"].endswith("+00:00")
    assert [json.loads(v)["what"] for k, v in store.written if k.startswith(CLAIM_PREFIX)] == [
        "repair of an interrupted alias move"]
    assert any(r.getMessage() == f"Registered model lm: {done}" for r in caplog.records)


def test_a_repair_without_previous_says_so():
    store = Store()
    store.add(NAME, champion="1")
    _record(store, champion="2", previous=None)
    assert repair_interrupted(store, NAME, RETRY) == (
        "completed an interrupted alias move: champion → version 2 (history.x)")
    assert store.models[NAME]["aliases"] == {"champion": "2"}


def test_a_long_record_is_named_by_its_first_200_characters(store):
    store.tags()[MOVE_TAG] = "x" * 300
    assert repair_interrupted(store, NAME, RETRY) == (
        f"dropped the record of an interrupted alias move ({'x' * 200}): champion is at version 1, set since by "
        "someone else; the aliases stay as they are")


def test_a_record_the_aliases_moved_away_from_is_dropped(store):
    store.models[NAME]["aliases"]["champion"] = "5"
    _record(store, champion="2", previous="1")
    assert repair_interrupted(store, NAME, RETRY) == (
        "dropped the record of an interrupted alias move ({\"start\": \"1\", \"event\": \"history.x\", \"champion\": "
        "\"2\", \"previous\": \"1\"}): champion is at version 5, set since by someone else; the aliases stay as they "
        "are")
    assert store.models[NAME]["aliases"] == {"champion": "5", "previous": "0"} and MOVE_TAG not in store.tags()


@pytest.mark.parametrize("text", ["not json", "{}", '{"champion": "2", "tags": 5}'])
def test_an_unreadable_record_is_dropped(store, text):
    store.tags()[MOVE_TAG] = text
    assert repair_interrupted(store, NAME, RETRY).startswith(
        f"dropped the record of an interrupted alias move ({text}): champion is at version 1")
    assert MOVE_TAG not in store.tags()


def test_no_record_is_one_read_and_no_lock(store):
    retry = Named()
    assert repair_interrupted(store, NAME, retry) is None
    assert retry.names == ["read the registered model"]
    assert repair_interrupted(store, "absent", RETRY) is None
    assert store.calls == []
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        assert lock.repair() is None


def test_rollback_swaps_champion_and_previous_and_records_it(store):
    event = rollback(store, NAME, RETRY)
    assert store.models[NAME]["aliases"] == {"champion": "0", "previous": "1"}
    assert {k: event[k] for k in ("event", "decision", "version", "champion", "previous")} == {
        "event": "rollback", "decision": "rollback", "version": "0", "champion": "0", "previous": "1"}
    assert re.fullmatch(r"rolled back by .+: champion from version 1 to version 0", event["reason"])
    assert json.loads(store.tags()[aliases.event_key(event["time"])]) == event and event["time"].endswith("+00:00")
    assert [json.loads(v)["what"] for k, v in store.written if k.startswith(CLAIM_PREFIX)] == ["rollback"]
    assert [json.loads(v) for k, v in store.written if k == MOVE_TAG] == [{
        "champion": "0", "previous": "1", "start": "1", "event": aliases.event_key(event["time"]), "tags": {}}]
    assert sorted(store.models) == [NAME]


def test_rollback_under_a_held_lock_takes_no_other(store):
    with AliasLock(store, NAME, "a gate", RETRY) as lock:
        creates = [c for c in store.calls if c[0] == "create"]
        rollback(store, NAME, RETRY, lock)
        assert [c for c in store.calls if c[0] == "create"] == creates and lock._held is not None
    assert store.models[NAME]["aliases"] == {"champion": "0", "previous": "1"}


@pytest.mark.parametrize(("names", "message"), [
    ({"champion": "1"}, "registered model lm: no version has the alias 'previous', so there is nothing to roll back "
                        "to"),
    ({"previous": "1"}, "registered model lm: no version has the alias 'champion', so there is no champion to roll "
                        "back from (set it to version 1 by hand if that is meant)"),
    ({"champion": "1", "previous": "1"}, "registered model lm: champion and previous are both version 1"),
])
def test_rollback_refuses_what_it_cannot_do_in_one_line(names, message):
    store = Store()
    store.add(NAME, **names)
    with pytest.raises(RollbackError, match=f"^{re.escape(message)}$"):
        rollback(store, NAME, RETRY)
    assert store.models[NAME]["aliases"] == names and sorted(store.models) == [NAME]


def test_the_model_tags_of_a_missing_model_are_none_and_other_errors_raise(store):
    assert aliases._model_tags(store, "absent") == {}
    store.refuse_read.add(NAME)
    with pytest.raises(MlflowException, match="Permission denied"):
        aliases._model_tags(store, NAME)
    with pytest.raises(RegistryRefused):
        RETRY("read", lambda: store.get_registered_model(NAME))


def test_a_claim_whose_release_failed_is_broken_at_the_next_try(store, monkeypatch, caplog):
    lock = AliasLock(store, NAME, "a gate", RETRY)
    lock.acquire()
    ((tag, _),) = store.claims().items()
    untag = store.delete_registered_model_tag
    monkeypatch.setattr(store, "delete_registered_model_tag", lambda name, key: 1 / 0)
    lock.release()  # the claim and the lock model stay: a live holder, this process
    assert tag in store.tags() and LOCK in store.models
    monkeypatch.setattr(store, "delete_registered_model_tag", untag)
    lock.acquire(timeout=0.05)
    assert tag not in store.tags() and lock._held[0] == LOCK and lock._held[2] != tag
    assert any(r.getMessage().endswith(": left by an earlier try of this mover)") for r in caplog.records)


def test_a_broken_lock_model_this_account_may_not_delete_stays(store, caplog):
    gone = {**_live_holder(), "pid": 2**22 + 12345}
    tag = _claim_of(store, LOCK, "k", int(time.time() * 1000), **gone)
    store.refuse_read.add(LOCK)  # made by another account: no READ, so never deleted
    retry = Named()
    caplog.set_level(logging.INFO, logger="train_deploy.registry.aliases")
    lock = AliasLock(store, NAME, "a gate", retry)
    lock._break(LockModel(LOCK, "k", 1), Claim(tag, LOCK, aliases._sha256("k"), gone), "why")
    assert tag not in store.tags() and LOCK in store.models
    assert retry.names == ["break a stale lock", "read the lock"]
    assert [r.getMessage() for r in caplog.records] == [
        f"Registered model lm: the broken lock model {LOCK} stays, unclaimed (MLflow tracking server "
        "sqlite:///unused.db refused read the lock for 'no credentials' (HTTP 403): the account needs READ on the "
        "registered model to read it, EDIT to register versions or move aliases, and the right to create registered "
        "models for a model's first version and the registry lock (docs/team-server.md))",
        f"Registered model lm: broke the stale lock {LOCK} (a gate by ops@box, pid {gone['pid']} on {gone['host']}, "
        "since 2026-12-04T08:00:00+00:00: why)"]


def test_a_repair_and_a_rollback_name_each_registry_call():
    store = Store()
    store.add(NAME, champion="1", previous="0")
    _record(store, champion="2", previous="1")
    retry = Named()
    with AliasLock(store, NAME, "a gate", retry) as lock:
        retry.names.clear()
        lock.repair()
        assert retry.names[:2] == ["read the registered model", "find the champion"]
        assert retry.names[2:5] == ["record the alias move", "tag the version", "record the history"]
        retry.names.clear()
        rollback(store, NAME, retry, lock)
        assert retry.names[:3] == ["read the registered model", "find the champion", "find the previous champion"]
    store.tags()[MOVE_TAG] = "not json"
    retry.names.clear()
    with AliasLock(store, NAME, "a gate", retry) as lock:
        retry.names.clear()
        lock.repair()
        assert retry.names == ["read the registered model", "find the champion", "clear the alias move"]


def test_an_errors_first_line_or_its_type():
    assert aliases._first_line(ValueError("  first\nsecond")) == "first"
    assert aliases._first_line(ValueError(" ")) == "ValueError(' ')"


def test_an_unclaimed_lock_model_is_warned_about_only_once_older_than_ten_seconds(store, monkeypatch, caplog):
    monkeypatch.setattr(aliases.time, "time", lambda: 1000.0)
    store.add(LOCK, {}, created_ms=1000_000 - 10_000)
    store.add(LOCK + ".1", {}, created_ms=1000_000 - 10_001)
    AliasLock(store, NAME, "a gate", RETRY)._warn_unclaimed(aliases.LockState(aliases._lock_models(store, LOCK), []))
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [f"Registered model lm: ignoring {LOCK}.1"]
