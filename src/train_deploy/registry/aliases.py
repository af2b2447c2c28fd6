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
client and the REST API alike. So the lock is the registered model ``<model>.aliases-lock``, created with its holder
(token, host, pid, what it does, since when) as a tag in the same insert, and deleted by its holder. A holder that
died leaves it behind: a lock whose holder ran on this host under a pid that is gone is broken at once; any other
after :data:`LEASE_S` seconds (its creation time on the server against this machine's clock). While held, it is
listed among the registry's models. On a server with authentication its creator may delete it; breaking another
user's stale lock needs MANAGE on it, else the mover stops with one line naming the lock to delete.

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
  lock to the next mover; it checks that it still holds the lock before each alias call, so at most the one call in
  flight can land after the takeover, and it only ever carries out its recorded move, which the next mover's repair
  completes the same way;
- breaking a stale lock is read-the-holder-then-delete: two movers breaking the same stale lock at the same moment
  may delete the lock the faster one just took (one round trip wide, and only after a holder died);
- the lease is judged by this machine's clock against the server's, so clocks more than a few seconds apart make it
  shorter or longer; a holder's pid is judged only on its own host name (hosts sharing a name and a pid namespace
  are not expected);
- aliases set by hand (the MLflow UI, ``MlflowClient``) do not take the lock; the gate still compares against
  whatever ``champion`` it reads under the lock;
- MLflow's file store (``./mlruns`` without a database) has no atomic create; the project's stores are SQL
  databases or an ``mlflow server`` over one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.registry.history import CHAMPION, PREVIOUS, alias_version, event_key, record_event, who
from train_deploy.registry.retry import Retrying

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".aliases-lock"
HOLDER_TAG = "holder"
MOVE_TAG = "aliases.move"
LEASE_S = 600.0
"""A lock older than this is broken by the next mover (a gate's critical section scores one model at most)."""
POLL_S = 0.5


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


class AliasLock:
    """The registry lock of registered model ``name`` (see the module): ``with AliasLock(...) as lock:``."""

    def __init__(self, client: MlflowClient, name: str, what: str, retry: Retrying) -> None:
        self.client, self.name, self.retry = client, name, retry
        self.lock_name = name + LOCK_SUFFIX
        self.holder = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "what": what,
                       "by": who(), "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}

    def __enter__(self) -> AliasLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self, timeout: float = LEASE_S + 60) -> None:
        """Take the lock, waiting while another live mover holds it; a stale lock is broken (see the module)."""
        deadline, seen = time.monotonic() + timeout, None
        while (holder := self._take()) is not None:
            if holder != seen:
                logger.info("Registered model %s: waiting for the lock %s (%s)", self.name, self.lock_name,
                            describe(holder))
                seen = holder
            if time.monotonic() > deadline:
                raise AliasMoveError(f"registered model {self.name}: the lock {self.lock_name} is still held "
                                     f"({describe(holder)}) after {timeout:.0f} s; no alias was changed")
            time.sleep(POLL_S)

    def release(self) -> None:
        """Delete the lock if it is still this holder's (never raises: the lock then goes stale)."""
        try:
            holder = self._holder()
            if holder is not None and holder.get("token") == self.holder["token"]:
                self.retry("release the lock", lambda: self.client.delete_registered_model(self.lock_name))
            else:
                logger.warning("Registered model %s: the lock %s was no longer this process's on release (%s)",
                               self.name, self.lock_name, describe(holder))
        except Exception as exc:  # the lock goes stale; the next mover breaks it
            logger.warning("Registered model %s: could not release the lock %s (%s)", self.name, self.lock_name,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))

    def check(self) -> None:
        """Raise :class:`AliasMoveError` unless this process still holds the lock (before each alias call)."""
        holder = self._holder()
        if holder is None or holder.get("token") != self.holder["token"]:
            raise AliasMoveError(f"registered model {self.name}: the lock {self.lock_name} was taken over "
                                 f"({describe(holder)}) before this move finished; its record {MOVE_TAG} lets the "
                                 "next mover complete it")

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

    def _take(self) -> dict[str, Any] | None:
        """None when this process now holds the lock; else the holder that has it."""
        try:
            self.retry("take the lock", lambda: self.client.create_registered_model(
                self.lock_name, tags={HOLDER_TAG: json.dumps(self.holder)},
                description=f"train_deploy: held while the aliases of {self.name} move; deleted by its holder"))
            return None
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                # The server's insert met the lock, whose holder released it before the server read it back to
                # say so (MLflow's SQL store answers a duplicate name with a lookup): free now, try again.
                return self._take()
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        found = self._read()
        if found is None:
            return self._take()  # released meanwhile: try again at once
        holder, created_ms = found
        if holder.get("token") == self.holder["token"]:
            return None  # this process's create went through, and its answer was lost
        if why := stale(holder, created_ms):
            self._break(holder, why)
        return holder

    def _break(self, holder: dict[str, Any], why: str) -> None:
        again = self._holder()
        if again is None or again.get("token") != holder.get("token"):
            return  # released or broken meanwhile
        try:
            self.retry("break a stale lock", lambda: self.client.delete_registered_model(self.lock_name))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":  # not removed by another mover meanwhile
                first = exc.message.strip().splitlines()[0] if exc.message.strip() else exc.error_code
                raise AliasMoveError(f"registered model {self.name}: the stale lock {self.lock_name} "
                                     f"({describe(holder)}: {why}) cannot be removed ({first}); delete that "
                                     "registered model once no gate or rollback of the model runs") from None
        logger.warning("Registered model %s: broke the stale lock %s (%s: %s)", self.name, self.lock_name,
                           describe(holder), why)

    def _holder(self) -> dict[str, Any] | None:
        found = self._read()
        return None if found is None else found[0]

    def _read(self) -> tuple[dict[str, Any], int] | None:
        """The lock's holder and creation time (server milliseconds), or None when there is no lock."""
        try:
            model = self.retry("read the lock", lambda: self.client.get_registered_model(self.lock_name))
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        try:
            holder = json.loads(model.tags.get(HOLDER_TAG, "{}"))
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), int(model.creation_timestamp or 0)


def stale(holder: dict[str, Any], created_ms: int, now: float | None = None) -> str:
    """Why the lock of ``holder`` created at ``created_ms`` may be broken ('' when it may not)."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() \
            and not psutil.pid_exists(pid):
        return f"its process {pid} on this host is gone"
    age = (time.time() if now is None else now) - created_ms / 1000
    return f"held for {age:.0f} s, longer than the lease of {LEASE_S:.0f} s" if age > LEASE_S else ""


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
