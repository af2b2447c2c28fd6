"""Moving ``champion`` and ``previous``: one mover at a time, each move recorded before it starts, repaired after
an interruption.

Three things move the aliases: the gate (a promotion, ``train_deploy.registry.gate``), ``train-deploy-registry
rollback`` (:func:`rollback`), and the repair of an interrupted move (:meth:`AliasLock.repair`, run by both and by
a scheduled run's change check, :func:`repair_interrupted`). Each holds the model's registry lock from reading the
aliases it decides on until its last alias call.

**Why a lock, and why this one.** MLflow has no compare-and-set on aliases or tags: ``set_registered_model_alias``
and ``set_registered_model_tag`` overwrite, so a token written and read back cannot tell two writers apart (each can
read its own token back before the other writes). Re-reading the champion just before moving only narrows the race
to the two calls. The one atomic create-if-absent MLflow offers is a name: a registered model's name is the primary
key of its table in the SQL store, and creating one that exists fails with ``RESOURCE_ALREADY_EXISTS``, through the
client and the REST API alike. So the lock is a registered model, ``<model>.aliases-lock``.

**Only a mover may hold it.** Creating a registered model is a right every account of a team server has, a
read-only one included (``default_permission = READ``, ``docs/team-server.md``), and such an account cannot be
kept from creating the lock's name or made to delete it. So a lock model counts only when the model's own tags
vouch for it, and writing those needs EDIT on the model. Taking the lock, in order:

1. read the lock models (``<model>.aliases-lock``, ``<model>.aliases-lock.1``, ``.2``, … found by one search), then
   the model's tags; a lock model is *held* when a claim tag on the model (``aliases-lock.claim.<token>``: the
   lock's name, the sha256 of its key, and who holds it: host, pid, pid namespace, boot id, what, by, since) names
   it and its key (its tag ``lock.key``, a random secret) matches. Any other lock model holds nothing: it is
   ignored, with a warning once, and never deleted (its maker may be an account whose models this one cannot
   delete); the lock moves on to the next name;
2. while a held lock exists, wait (a stale one is broken first, below);
3. write this mover's claim on the model (an account without EDIT is refused here, HTTP 403, and creates nothing),
   then create the first free lock name with the key as its tag;
4. read the locks again: if a held lock other than this one exists, drop this one (claim, then model) and try
   again after a random pause of up to :data:`POLL_S`.

The claim is written before the lock model exists, so a lock model is held from the moment it exists, and its key
is secret until then: no account can make a lock model that counts without writing a claim. Of two movers that
both created a lock, the one that reads later (step 4) sees the other's, so they never both hold it (at worst both
give way and try again). A holder drops its claim first, then deletes its model (a lock model recreated under a
released name with the now-known key finds no claim). Because only the claims decide, the name does not matter for
safety; the first free name only makes two movers collide on the one atomic create rather than in step 4.

A holder that died leaves its claim and lock model behind: a lock whose holder's process is gone is broken at once,
any other after :data:`LEASE_S` seconds (its creation time on the server against this machine's clock). A pid is
judged only by a process in the same pid namespace of the same boot (``train_deploy.run_control.lock.process_gone``):
containers sharing a host name each have their own pids. Breaking removes the holder's claim (EDIT on the model is
enough), then the lock model when this account may delete it; one it may not delete stays, ignored.

**A move, in order** (:meth:`AliasLock.move_steps`): with the lock held, any recorded move is repaired first and
``champion`` is read again (the gate compares again when it changed since it scored); then

1. the move itself is recorded: the registered-model tag ``aliases.move`` = ``{champion, previous, start, event,
   tags}``;
2. the new champion gets its ``tags`` (the gate's ``gate.*`` decision), and the history its event;
3. ``previous`` → the version that was champion;
4. ``champion`` → the new one;
5. ``aliases.move`` is deleted.

A kill before step 1 moved nothing and decided nothing (a gate tags a rejected version without a move). A kill
after it leaves the record (and a stale lock): the next mover completes the move, tags included, when ``champion``
is still at ``start`` or already at the move's ``champion``, and says so in the history (a ``repair`` event); so
``champion == previous`` (a kill between steps 3 and 4) never outlives the next run, and a promoting decision never
stands without its move. Any other state (aliases set by hand meanwhile) is left as it is, and the record dropped
with a warning.

**The windows that remain:**

- a holder stalled longer than the lease (a tracking server away for minutes in the middle of a move) loses its
  lock to the next mover; it checks that it still holds the lock (its claim and its lock model) before each alias
  call, so at most the one call in flight can land after the takeover, and it only ever carries out its recorded
  move, which the next mover's repair completes the same way;
- breaking a stale lock model is read-then-delete: a mover that reads the stale model, then deletes it after
  another mover broke it and created its own lock under the freed name, deletes that lock (one round trip wide,
  and only after a holder died); its holder then stops at its next check, as above;
- the lease is judged by this machine's clock against the server's, so clocks more than a few seconds apart make it
  shorter or longer;
- an account that may create registered models can make the search of step 1 long by creating many lock-like
  names, and can make a mover lose the one atomic create now and then (it moves on to the next name); it can
  neither hold the lock nor keep it, and what it made stays listed until an admin deletes it;
- a mover killed between writing its claim and creating its lock model leaves the claim; the next holder removes
  claims without a lock model once they are older than the lease;
- aliases set by hand (the MLflow UI, ``MlflowClient``) do not take the lock; the gate still compares against
  whatever ``champion`` it reads under the lock;
- MLflow's file store (``./mlruns`` without a database) has no atomic create; the project's stores are SQL
  databases or an ``mlflow server`` over one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import itertools
import json
import logging
import random
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.registry.history import CHAMPION, PREVIOUS, alias_version, event_key, record_event, who
from train_deploy.registry.retry import RegistryRefused, Retrying
from train_deploy.run_control.lock import holder_identity, process_gone

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".aliases-lock"
"""The lock models are ``<model>.aliases-lock``, then ``<model>.aliases-lock.1``, ``.2``, … (see the module)."""
KEY_TAG = "lock.key"
"""On a lock model: its random key; the holder's claim names the key's sha256."""
CLAIM_PREFIX = "aliases-lock.claim."
"""On the registered model: ``aliases-lock.claim.<token>``, one mover's claim (JSON: lock, key_sha256, holder)."""
MOVE_TAG = "aliases.move"
LEASE_S = 600.0
"""A lock older than this is broken by the next mover (a gate's critical section scores one model at most)."""
POLL_S = 0.5
UNCLAIMED_WARN_S = 10.0
"""An unclaimed lock model younger than this may be a holder's being released: warned about only once older."""


class AliasMoveError(RuntimeError):
    """The aliases cannot be moved safely now; the message names the model and why."""


class RollbackError(RuntimeError):
    """There is nothing to roll back to; the message names the model."""


@dataclass(frozen=True, slots=True)
class Move:
    """A recorded alias move: ``champion`` → this version, ``previous`` → that one (None: left as it is)."""

    champion: str
    previous: str | None
    start: str | None
    """Which version held ``champion`` when the move was recorded."""
    event: str
    """The history entry (its tag) of the decision or rollback the move carries out."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags the new champion gets before it moves (the gate's decision: a version never holds ``champion``
    without it, and never has a promoting decision without the move recorded)."""

    @classmethod
    def from_json(cls, text: str) -> Move:
        record = json.loads(text)
        return cls(champion=str(record["champion"]), previous=record.get("previous"), start=record.get("start"),
                   event=str(record.get("event", "")), tags=dict(record.get("tags") or {}))


@dataclass(frozen=True, slots=True)
class LockModel:
    """A registered model named like the lock: its name, its key (``lock.key``, '' when it has none), its creation
    time on the server (milliseconds)."""

    name: str
    key: str
    created_ms: int


@dataclass(frozen=True, slots=True)
class Claim:
    """A mover's claim, written on the registered model (an account without EDIT on it cannot)."""

    tag: str
    lock: str
    key_sha256: str
    holder: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LockState:
    """One reading of a model's lock: the lock models (read first), then the claims on the model."""

    models: dict[str, LockModel]
    claims: list[Claim]

    def held(self) -> list[tuple[LockModel, Claim]]:
        """The lock models a claim vouches for (its name, its key's sha256), each with that claim."""
        return [(lock, claim) for lock in self.models.values() for claim in self.claims
                if lock.key and claim.lock == lock.name and claim.key_sha256 == _sha256(lock.key)]

    def unclaimed(self) -> list[LockModel]:
        """Lock models no claim vouches for: they hold nothing."""
        held = {lock.name for lock, _ in self.held()}
        return [lock for name, lock in sorted(self.models.items()) if name not in held]

    def free_name(self, first: str, taken: set[str]) -> str:
        """The first lock name that no lock model (nor one of ``taken``, unreadable) has."""
        return next(name for n in itertools.count() if (name := first if n == 0 else f"{first}.{n}")
                    not in self.models and name not in taken)


class AliasLock:
    """The registry lock of registered model ``name`` (see the module): ``with AliasLock(...) as lock:``."""

    def __init__(self, client: MlflowClient, name: str, what: str, retry: Retrying) -> None:
        self.client, self.name, self.retry = client, name, retry
        self.lock_name = name + LOCK_SUFFIX
        self.holder = {**holder_identity(), "what": what, "by": who(),
                       "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        self._held: tuple[str, str, str] | None = None  # (lock model, its key, the claim's tag) while held
        self._unreadable: set[str] = set()  # lock names taken by models this account may not read
        self._dropped: set[str] = set()  # claims this mover gave up (their removal may have failed)
        self._warned: set[str] = set()

    def __enter__(self) -> AliasLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self, timeout: float = LEASE_S + 60) -> None:
        """Take the lock, waiting while another live mover holds it; a stale lock is broken (see the module)."""
        deadline, seen = time.monotonic() + timeout, None
        while (holder := self._try()) is not None:
            if time.monotonic() > deadline:
                raise AliasMoveError(f"registered model {self.name}: the lock {holder.get('lock', self.lock_name)} "
                                     f"is still held ({describe(holder)}) after {timeout:.0f} s; no alias was "
                                     "changed")
            if not holder:
                continue  # the name was taken meanwhile: the next one at once
            if holder != seen:
                logger.info("Registered model %s: waiting for the lock %s (%s)", self.name, holder.get("lock"),
                            describe(holder))
                seen = holder
            time.sleep(POLL_S)

    def release(self) -> None:
        """Drop this process's claim, then delete its lock model (never raises: a lock left goes stale)."""
        if self._held is None:
            return
        name, key, claim = self._held
        self._held, self._dropped = None, self._dropped | {claim}
        try:
            if claim in self.retry("read the registered model", lambda: _model_tags(self.client, self.name)):
                self.retry("drop the claim", lambda: self.client.delete_registered_model_tag(self.name, claim))
            else:
                logger.warning("Registered model %s: the lock %s was no longer this process's on release (its claim "
                               "was removed: broken as stale)", self.name, name)
            self._delete_lock_model(name, key)
        except Exception as exc:  # the lock goes stale; the next mover breaks it
            logger.warning("Registered model %s: could not release the lock %s (%s)", self.name, name,
                           _first_line(exc))

    def check(self) -> None:
        """Raise :class:`AliasMoveError` unless this process still holds the lock (before each alias call)."""
        state = self._read()
        if self._held is not None:
            name, key, claim = self._held
            if (lock := state.models.get(name)) is not None and lock.key == key and any(
                    found.tag == claim for found in state.claims):
                return
        now = next(({**found.holder, "lock": lock.name} for lock, found in state.held()), None)
        raise AliasMoveError(f"registered model {self.name}: the lock was taken over ({describe(now)}) before this "
                             f"move finished; its record {MOVE_TAG} lets the next mover complete it")

    def move(self, move: Move, event: dict[str, Any] | None = None) -> None:
        """Carry out ``move`` in the recorded order (see the module), appending ``event`` to the history after the
        move is recorded."""
        for what, call in self.move_steps(move, event):
            self.retry(what, call)

    def move_steps(self, move: Move, event: dict[str, Any] | None = None) -> list[tuple[str, Callable[[], Any]]]:
        """The calls of ``move``, in order, each named: a kill between any two leaves a state :meth:`repair`
        completes."""
        c, name = self.client, self.name
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("record the alias move", lambda: c.set_registered_model_tag(name, MOVE_TAG, json.dumps(asdict(move)))),
            ("tag the version", lambda: self._tag_version(move))]
        if event is not None:
            steps.append(("record the history", lambda: record_event(c, name, event)))
        if move.previous is not None:
            steps.append((f"move {PREVIOUS}", lambda: self._set_alias(PREVIOUS, move.previous)))
        steps.append((f"move {CHAMPION}", lambda: self._set_alias(CHAMPION, move.champion)))
        steps.append(("clear the alias move", lambda: c.delete_registered_model_tag(name, MOVE_TAG)))
        return steps

    def repair(self) -> str | None:
        """Complete a move an interrupted mover recorded; returns what was done, None when nothing was recorded."""
        tags = self.retry("read the registered model", lambda: _model_tags(self.client, self.name))
        if MOVE_TAG not in tags:
            return None
        try:
            move = Move.from_json(tags[MOVE_TAG])
        except (ValueError, KeyError, TypeError):
            move = None
        champion = self.retry("find the champion", lambda: alias_version(self.client, self.name, CHAMPION))
        if move is not None and champion in (move.start, move.champion):
            done = (f"completed an interrupted alias move: {CHAMPION} → version {move.champion}"
                    + (f", {PREVIOUS} → version {move.previous}" if move.previous else "") + f" ({move.event})")
            self.move(move, {"time": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"), "event": "repair",
                             "decision": "repair", "version": move.champion, "champion": move.champion,
                             "previous": move.previous, "reason": f"{done}, by {who()}"})
        else:
            self.retry("clear the alias move", lambda: self.client.delete_registered_model_tag(self.name, MOVE_TAG))
            done = (f"dropped the record of an interrupted alias move ({tags[MOVE_TAG][:200]}): {CHAMPION} is at "
                    f"version {champion}, set since by someone else; the aliases stay as they are")
        logger.warning("Registered model %s: %s", self.name, done)
        return done

    def _tag_version(self, move: Move) -> None:
        for key, value in move.tags.items():
            self.client.set_model_version_tag(self.name, move.champion, key, value)

    def _set_alias(self, alias: str, version: str) -> None:
        self.check()
        self.client.set_registered_model_alias(self.name, alias, version)

    def _try(self) -> dict[str, Any] | None:
        """None when this process now holds the lock; else the holder (its claim) to wait for, or {} to try the
        next name at once."""
        state = self._read()
        self._warn_unclaimed(state)
        for lock, claim in state.held():
            if why := ("left by an earlier try of this mover" if claim.tag in self._dropped
                       else stale(claim.holder, lock.created_ms)):
                self._break(lock, claim, why)
            return {**claim.holder, "lock": lock.name}
        return self._take(state)

    def _take(self, state: LockState) -> dict[str, Any] | None:
        name, key = state.free_name(self.lock_name, self._unreadable), secrets.token_hex(16)
        claim = CLAIM_PREFIX + uuid.uuid4().hex
        record = {**self.holder, "lock": name, "key_sha256": _sha256(key),
                  "claimed": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        self.retry("claim the lock", lambda: self.client.set_registered_model_tag(self.name, claim, json.dumps(record)))
        self._held = (name, key, claim)
        try:
            created = self._create(name, key)
        except BaseException:
            self.release()
            raise
        if not created:
            self.release()
            return {}
        # Step 4 of the module: a mover that created its lock before this one, and read the locks before this one's
        # existed, holds it; both give way when each saw the other, apart again after random pauses.
        after = self._read()
        held = after.held()
        if rivals := [(lock, found) for lock, found in held if found.tag != claim]:
            self.release()
            time.sleep(random.uniform(0, POLL_S))
            return {**rivals[0][1].holder, "lock": rivals[0][0].name}
        if not any(found.tag == claim for _, found in held):  # its claim was removed meanwhile: not held
            self.release()
            return {}
        self._drop_orphan_claims(after)
        return None

    def _create(self, name: str, key: str) -> bool:
        """Whether this process created the lock model ``name`` (False: another model has that name)."""
        while True:
            try:
                self.retry("take the lock", lambda: self.client.create_registered_model(
                    name, tags={KEY_TAG: key},
                    description=f"train_deploy: held while the aliases of {self.name} move; deleted by its holder"))
                return True
            except MlflowException as exc:
                # RESOURCE_DOES_NOT_EXIST: the server's insert met a lock whose holder released it before the
                # server read it back to say so (MLflow's SQL store answers a duplicate name with a lookup).
                if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                    raise
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    continue
            try:
                found = self.retry("read the lock", lambda: self.client.get_registered_model(name))
            except RegistryRefused:
                self._unreadable.add(name)  # a model this account may not read has the name: the next one
                return False
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                continue  # released meanwhile
            return found.tags.get(KEY_TAG) == key  # this process's create went through, and its answer was lost

    def _break(self, lock: LockModel, claim: Claim, why: str) -> None:
        """Remove a stale holder's claim (the lock then holds nothing), then its lock model where this account may."""
        self.retry("break a stale lock", lambda: self.client.delete_registered_model_tag(self.name, claim.tag))
        try:
            self._delete_lock_model(lock.name, lock.key)
        except (MlflowException, RegistryRefused) as exc:
            logger.info("Registered model %s: the broken lock model %s stays, unclaimed (%s)", self.name, lock.name,
                        _first_line(exc))
        logger.warning("Registered model %s: broke the stale lock %s (%s: %s)", self.name, lock.name,
                       describe(claim.holder), why)

    def _delete_lock_model(self, name: str, key: str) -> None:
        """Delete the lock model ``name`` if it is still the one with ``key`` (one this account may read)."""
        if name in self._unreadable:
            return
        try:
            found = self.retry("read the lock", lambda: self.client.get_registered_model(name))
            if found.tags.get(KEY_TAG) == key:
                self.retry("delete the lock", lambda: self.client.delete_registered_model(name))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # not removed by another mover meanwhile
                raise

    def _drop_orphan_claims(self, state: LockState) -> None:
        """Remove claims older than the lease whose lock model never came (a mover killed between the two)."""
        held = {claim.tag for _, claim in state.held()}
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=LEASE_S)
        for claim in state.claims:
            with contextlib.suppress(ValueError, TypeError):
                if claim.tag not in held and dt.datetime.fromisoformat(claim.holder.get("claimed", "")) < cutoff:
                    self.retry("drop an orphan claim",
                               lambda c=claim.tag: self.client.delete_registered_model_tag(self.name, c))

    def _warn_unclaimed(self, state: LockState) -> None:
        """Say once per lock model that it is ignored; its tags (another account's words) are never repeated."""
        now_ms = time.time() * 1000
        for lock in state.unclaimed():
            if lock.name not in self._warned and now_ms - lock.created_ms > UNCLAIMED_WARN_S * 1000:
                self._warned.add(lock.name)
                logger.warning("Registered model %s: ignoring %s, a registered model named like its lock that no "
                               "mover of %s claimed (made by an account without EDIT on %s, or left by an interrupted "
                               "mover); it holds nothing, and an admin may delete it", self.name, lock.name,
                               self.name, self.name)

    def _read(self) -> LockState:
        """The lock models, then the claims (a claim is written before its lock model: read in this order, every
        lock model read is held or not as it is)."""
        models = self.retry("list the lock models", lambda: _lock_models(self.client, self.lock_name))
        tags = self.retry("read the registered model", lambda: _model_tags(self.client, self.name))
        return LockState(models, [claim for tag, text in sorted(tags.items()) if (claim := _claim(tag, text))])


def stale(holder: dict[str, Any], created_ms: int, now: float | None = None) -> str:
    """Why the lock of ``holder`` created at ``created_ms`` may be broken ('' when it may not)."""
    if process_gone(holder):
        return f"its process {holder['pid']} is gone (same pid namespace and boot as this one)"
    age = (time.time() if now is None else now) - created_ms / 1000
    return f"held for {age:.0f} s, longer than the lease of {LEASE_S:.0f} s" if age > LEASE_S else ""


def _lock_models(client: MlflowClient, first: str) -> dict[str, LockModel]:
    """The registered models named ``first`` or ``first.<n>`` (one search by prefix, every page)."""
    exact, found, token = re.compile(re.escape(first) + r"(\.[0-9]+)?"), {}, None
    while True:
        page = client.search_registered_models(filter_string=f"name LIKE '{first}%'", max_results=1000,
                                               page_token=token)
        for model in page:
            if exact.fullmatch(model.name):
                found[model.name] = LockModel(model.name, str(model.tags.get(KEY_TAG, "")),
                                              int(model.creation_timestamp or 0))
        if not (token := page.token):
            return found


def _claim(tag: str, text: str) -> Claim | None:
    """The claim a registered-model tag holds, or None (another tag, or not a claim's JSON)."""
    if not tag.startswith(CLAIM_PREFIX):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("lock"), str) or \
            not isinstance(record.get("key_sha256"), str):
        return None
    return Claim(tag, record.pop("lock"), record.pop("key_sha256"), record)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def describe(holder: dict[str, Any] | None) -> str:
    """A lock holder in a few words."""
    if not holder:
        return "holder unknown"
    return (f"{holder.get('what', '?')} by {holder.get('by', '?')}, pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}, since {holder.get('since', '?')}")


def repair_interrupted(client: MlflowClient, name: str, retry: Retrying) -> str | None:
    """Complete an interrupted alias move of ``name`` if one is recorded (one read when none is)."""
    if MOVE_TAG not in retry("read the registered model", lambda: _model_tags(client, name)):
        return None
    with AliasLock(client, name, "repair of an interrupted alias move", retry) as lock:
        return lock.repair()


def rollback(client: MlflowClient, name: str, retry: Retrying, lock: AliasLock | None = None) -> dict[str, Any]:
    """``champion`` ← ``previous`` and ``previous`` ← the old champion, under the registry lock (``lock`` when the
    caller holds it already); records and returns the event."""
    with contextlib.nullcontext(lock) if lock is not None else AliasLock(client, name, "rollback", retry) as held:
        held.repair()
        champion = retry("find the champion", lambda: alias_version(client, name, CHAMPION))
        previous = retry("find the previous champion", lambda: alias_version(client, name, PREVIOUS))
        if previous is None:
            raise RollbackError(f"registered model {name}: no version has the alias {PREVIOUS!r}, so there is "
                                "nothing to roll back to")
        if champion is None:
            raise RollbackError(f"registered model {name}: no version has the alias {CHAMPION!r}, so there is no "
                                f"champion to roll back from (set it to version {previous} by hand if that is meant)")
        if champion == previous:
            raise RollbackError(f"registered model {name}: {CHAMPION} and {PREVIOUS} are both version {champion}")
        event = {"time": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"), "event": "rollback",
                 "decision": "rollback", "version": previous, "champion": previous, "previous": champion,
                 "reason": f"rolled back by {who()}: {CHAMPION} from version {champion} to version {previous}"}
        held.move(Move(champion=previous, previous=champion, start=champion, event=event_key(event["time"])), event)
    return event


def _model_tags(client: MlflowClient, name: str) -> dict[str, str]:
    """The registered model's tags; none when it does not exist."""
    try:
        return client.get_registered_model(name).tags
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        raise
