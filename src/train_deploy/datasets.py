"""Catalog datasets for the folders the stages write: token files, tokenizer, checkpoints, bundle.

A stage's artifact is a folder, not an object in memory, and it is built by the stage's own code (many
processes write token shards; the exporter writes a server model, ONNX files, proofs). So a node returns
a :class:`FolderWork` (how to fill an empty folder, and when the folder already published can be kept)
and :class:`ArtifactFolderDataset` does the rest: it builds in a staging folder beside its location and
publishes it atomically (``train_deploy.atomic.atomic_folder``), keeps the current folder when the work
says it is the same, writes each run a new version when ``versions``, and loads the folder's typed
description (``train_deploy.handoffs``). Nodes never see a path they did not get from the catalog.

With ``by_fingerprint`` (the token files, the tokenizer) every fingerprint keeps its own folder in
``<path>.by_fingerprint/<fingerprint>/`` and ``<path>`` is a symbolic link to the one the last run used,
switched in one rename: a second corpus keeps the first one's folder, and switching back re-encodes nothing.
Old folders past ``keep_last`` are retention's to remove (``train-deploy gc``), never a save's: only retention
knows which of them a version holding an alias of any of the project's registered models needs.

:class:`WorkFolderDataset` is the read-only location of a folder that other processes fill while a node
runs (the training workers' checkpoints and logs).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Generic, TypeVar

from kedro.io import AbstractVersionedDataset, DatasetError, Version
from kedro.io.core import VersionNotFoundError

from train_deploy.atomic import atomic_folder, atomic_symlink, scratch_folder
from train_deploy.handoffs import DescriptionError, WorkFolder, read_json, write_json

logger = logging.getLogger(__name__)

D = TypeVar("D")

STORE_SUFFIX = ".by_fingerprint"
"""``<path><STORE_SUFFIX>/`` holds a ``by_fingerprint`` dataset's folders, one per fingerprint."""


@dataclass(frozen=True, slots=True)
class FolderWork(Generic[D]):
    """What a node hands to an :class:`ArtifactFolderDataset`: how to fill its folder."""

    build: Callable[[Path], D]
    """Fill the given empty staging folder and return its description."""
    keep: Callable[[D], bool] | None = None
    """Given the description of the folder already published: True if ``build`` would make the same."""
    what: str = "artifact"
    """Named in log lines ("tokenizer", "token files", "bundle")."""
    fingerprint: str = ""
    """The ``fingerprint`` the built folder's description will have: names its folder in a ``by_fingerprint``
    dataset (required there)."""


class ArtifactFolderDataset(AbstractVersionedDataset[FolderWork, Any]):
    """A folder artifact: save publishes a :class:`FolderWork` atomically, load returns its description.

    Args:
        path: the folder; with ``versions``, each save is a new ``<path>/<UTC time>/<name>``, as Kedro
            versions files, and a load reads the newest.
        description: import path of the description class; it reads a published folder with
            ``read_folder(folder)`` and has a local ``path`` field (``train_deploy.handoffs``).
        versions: keep every save. Not Kedro's ``versioned``: that gives all datasets of a catalog one
            save version, which a dataset wrapped by kedro-mlflow's artifact dataset cannot receive.
        by_fingerprint: keep one folder per fingerprint (:attr:`FolderWork.fingerprint`) in :attr:`store`;
            ``path`` is a symbolic link to the one saved last (a real folder there, from before, is moved in).
        keep_last: with ``by_fingerprint``, keep the folders of this many fingerprints, the most recently used
            (the current one always); 0 keeps all. Applied by ``train-deploy gc`` (``train_deploy.retention``,
            after every scheduled run), which knows what the registered models' aliases need and which folders
            a registered version came from; a save removes no other fingerprint's folder.
    """

    def __init__(self, *, path: str, description: str, versions: bool = False, by_fingerprint: bool = False,
                 keep_last: int = 0, version: Version | None = None, metadata: dict[str, Any] | None = None) -> None:
        if by_fingerprint and versions:
            raise DatasetError(f"{path}: versions and by_fingerprint exclude each other")
        if not isinstance(keep_last, int) or keep_last < 0:
            raise DatasetError(f"{path}: keep_last must be 0 (keep all) or more, got {keep_last!r}")
        version = version or (Version(None, None) if versions else None)
        super().__init__(filepath=PurePosixPath(Path(path).as_posix()), version=version, exists_function=_exists)
        self._description = _import(description)
        self._store = Path(path).with_name(Path(path).name + STORE_SUFFIX) if by_fingerprint else None
        self._keep_last = keep_last
        self._saved: Any = None  # what this run published: loads in the same run need not read it back
        self.metadata = metadata

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._filepath), "description": self._description.__name__, "version": self._version,
                "by_fingerprint": self._store is not None}

    @property
    def folder(self) -> Path:
        """The configured location (with ``versions``, the folder that holds the versions; with
        ``by_fingerprint``, the link to the current folder)."""
        return Path(self._filepath)

    @property
    def store(self) -> Path | None:
        """With ``by_fingerprint``, the folder holding one folder per fingerprint (``<path>.by_fingerprint``)."""
        return self._store

    def _save(self, work: FolderWork) -> None:
        try:
            if self._store is None:
                self._saved = self._publish(work, Path(self._get_save_path()), self._current())
            else:
                self._saved = self._publish_by_fingerprint(work, self._store)
        except DatasetError:
            raise
        except Exception as exc:  # the stage's own one-line error, not wrapped in a dataset repr
            raise DatasetError(str(exc)) from exc
        finally:
            self._cached_load_version = None  # the next load finds what this save published

    def _publish(self, work: FolderWork, final: Path, current: Any) -> Any:
        if current is not None and work.keep is not None and work.keep(current):
            return self._keep(current, final, work.what)
        with atomic_folder(final) as staging:
            built = work.build(staging)
        return dataclasses.replace(built, path=str(final))

    def _publish_by_fingerprint(self, work: FolderWork, store: Path) -> Any:
        """Publish into ``store/<fingerprint>`` (kept when unchanged), then point :attr:`folder` at it."""
        if not work.fingerprint:
            raise DatasetError(f"{self.folder}: the {work.what} has no fingerprint to be stored by")
        self._move_flat_folder(store, work.what)
        final = store / _folder_name(work.fingerprint)
        published = self._publish(work, final, self._read(final))
        atomic_symlink(self.folder, f"{store.name}/{final.name}")
        os.utime(final)  # the most recently used: what keep_last keeps (train-deploy gc applies it)
        return published

    def _move_flat_folder(self, store: Path, what: str) -> None:
        """A real folder at :attr:`folder` (written before ``by_fingerprint``) moves into ``store`` under its
        fingerprint and the link takes its place, so it is kept like the others and still current if this save
        fails; one that cannot be read, or whose fingerprint is there already, is removed."""
        flat = self.folder
        if flat.is_symlink() or not flat.is_dir():
            return
        fingerprint = getattr(self._read(flat), "fingerprint", "")
        target = store / _folder_name(fingerprint) if fingerprint else None
        store.mkdir(parents=True, exist_ok=True)
        if target is not None and not target.exists():
            os.replace(flat, target)
            logger.info("Moved the %s in %s to %s (one folder per fingerprint)", what, flat, target)
        else:
            _remove(flat)
        if target is not None and target.is_dir():
            atomic_symlink(flat, f"{store.name}/{target.name}")

    def _load(self) -> Any:
        folder = self._published_folder()
        if self._saved is not None and Path(self._saved.path) == folder:
            return self._saved
        return self._description.read_folder(folder)

    def _exists(self) -> bool:
        return self._current() is not None

    def _published_folder(self) -> Path:
        """The folder a load reads: the newest version, the link's target, or the configured folder."""
        if self._store is not None and self.folder.is_symlink():
            return self.folder.parent / os.readlink(self.folder)
        return Path(self._get_load_path())

    def _current(self) -> Any:
        """The description of the newest published folder, or None when there is none or it is damaged."""
        try:
            folder = self._published_folder()
        except VersionNotFoundError:
            return None
        return self._read(folder)

    def _read(self, folder: Path) -> Any:
        """The description of the published ``folder``, or None when there is none or it is damaged."""
        if not folder.is_dir():
            return None
        try:
            return self._description.read_folder(folder)
        except DescriptionError as exc:
            logger.warning("Rebuilding %s: %s", folder, exc)
            return None

    def _keep(self, current: Any, final: Path, what: str) -> Any:
        kept = Path(current.path)
        if kept != final:  # a new version with the same files: hard links, no copy
            with atomic_folder(final) as staging:
                _link_tree(kept, staging)
        logger.info("Kept the %s in %s: up to date%s", what, kept, f" as {final}" if kept != final else "")
        fields = {f.name for f in dataclasses.fields(current)}
        return dataclasses.replace(current, path=str(final), **({"reused": True} if "reused" in fields else {}))


class DescriptionDataset(AbstractVersionedDataset[Any, Any]):
    """A small typed record (``train_deploy.handoffs``) as a JSON file: ``training_result``, ``selected_checkpoint``."""

    def __init__(self, *, filepath: str, description: str, version: Version | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        super().__init__(filepath=PurePosixPath(Path(filepath).as_posix()), version=version)
        self._description = _import(description, needs="")
        self.metadata = metadata

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "description": self._description.__name__, "version": self._version}

    def _save(self, data: Any) -> None:
        if not isinstance(data, self._description):
            raise DatasetError(f"{self._filepath}: expected a {self._description.__name__}, got {type(data).__name__}")
        write_json(Path(self._get_save_path()), data)
        self._cached_load_version = None

    def _load(self) -> Any:
        return read_json(self._description, Path(self._get_load_path()))

    def _exists(self) -> bool:
        try:
            return Path(self._get_load_path()).is_file()
        except VersionNotFoundError:
            return False


class FolderPointerDataset(AbstractVersionedDataset[Any, Any]):
    """A record read from a folder (``read_folder``), saved as the folder's path in a small JSON file:
    ``validated_token_files``, which names the token files the data gate passed (the night's own, or their
    screened copy) for the stages after it, in this run or in a later run that starts from one of them."""

    def __init__(self, *, filepath: str, description: str, version: Version | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        super().__init__(filepath=PurePosixPath(Path(filepath).as_posix()), version=version)
        self._description = _import(description)
        self.metadata = metadata

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "description": self._description.__name__, "version": self._version}

    def _save(self, data: Any) -> None:
        if not isinstance(data, self._description) or not getattr(data, "path", ""):
            raise DatasetError(f"{self._filepath}: expected a {self._description.__name__} read from its folder")
        write_json(Path(self._get_save_path()), {"path": str(Path(data.path).resolve())})
        self._cached_load_version = None

    def _load(self) -> Any:
        where = Path(self._get_load_path())
        try:
            folder = Path(json.loads(where.read_text(encoding="utf-8"))["path"])
        except (OSError, ValueError, KeyError, TypeError):
            raise DatasetError(f"{where}: not a folder record; run the stage that writes it again") from None
        return self._description.read_folder(folder)

    def _exists(self) -> bool:
        try:
            return Path(self._get_load_path()).is_file()
        except VersionNotFoundError:
            return False


class WorkFolderDataset(AbstractVersionedDataset[None, WorkFolder]):
    """Read-only: the location of a folder that processes fill while a node runs (checkpoints, logs)."""

    def __init__(self, *, path: str, metadata: dict[str, Any] | None = None) -> None:
        super().__init__(filepath=PurePosixPath(Path(path).as_posix()), version=None)
        self.metadata = metadata

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._filepath)}

    @property
    def folder(self) -> Path:
        """The configured location."""
        return Path(self._filepath)

    def _load(self) -> WorkFolder:
        return WorkFolder(path=str(self._filepath))

    def _save(self, data: None) -> None:
        raise DatasetError(f"{self._filepath} is filled by the processes a node starts; nothing saves it")

    def _exists(self) -> bool:
        return Path(self._filepath).is_dir()


def _exists(path: str) -> bool:
    return Path(path).is_dir()


def _import(name: str, needs: str = "read_folder") -> type:
    module, _, attribute = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        raise DatasetError(f"description: {name!r} is not an importable class") from None
    if not dataclasses.is_dataclass(cls) or (needs and not hasattr(cls, needs)):
        raise DatasetError(f"description: {name} is not a description dataclass{' of a folder' if needs else ''}")
    return cls


def _folder_name(fingerprint: str) -> str:
    """A fingerprint as a folder name: letters, digits, ``_`` and ``-`` (``init_from:<hash>`` → ``init_from-…``)."""
    return re.sub(r"[^0-9A-Za-z_-]", "-", fingerprint)


def _remove(folder: Path) -> None:
    """Remove ``folder``: renamed first to a staging name, so an interrupted removal leaves no part of it under its
    own name (the next run's leftover cleaning finishes it)."""
    holder = scratch_folder(folder.parent, folder.name)
    os.replace(folder, holder / folder.name)
    shutil.rmtree(holder, ignore_errors=True)


def _link_tree(source: Path, target: Path) -> None:
    """Recreate ``source``'s files in the existing folder ``target`` as hard links (copies across devices)."""
    for root, folders, files in os.walk(source):
        here = target / Path(root).relative_to(source)
        for name in folders:
            (here / name).mkdir()
        for name in files:
            try:
                os.link(Path(root) / name, here / name)
            except OSError:
                shutil.copy2(Path(root) / name, here / name)
