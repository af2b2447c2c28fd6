"""What ``train-deploy gc`` would remove from the project's folders, and why: the plan, decided before anything goes.

The folders come from the catalog (``checkpoints``, ``training_logs``, ``export_bundle``, the ``by_fingerprint``
stores of ``token_files`` and ``tokenizer``, ``init_cache``), so a moved entry is collected where it is. What the
versions holding an alias need (:class:`Kept`, from the registry) is never in a plan.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from train_deploy.handoffs import TOKENIZER_FILE, BundleMeta, DescriptionError
from train_deploy.retention.config import RetentionConfig
from train_deploy.retention.disk import tree_bytes


@dataclass(kw_only=True, slots=True)
class Kept:
    """What the versions holding an alias (``champion``, ``previous``, …) need, read from their tags."""

    versions: dict[str, list[str]] = field(default_factory=dict)
    """Version → the aliases it holds."""
    run_names: set[str] = field(default_factory=set)
    """Their training runs (``training.run_name``): checkpoint and log folders."""
    bundle_fingerprints: set[str] = field(default_factory=set)
    corpus_fingerprints: set[str] = field(default_factory=set)
    tokenizer_hashes: set[str] = field(default_factory=set)
    run_ids: set[str] = field(default_factory=set)
    model_ids: set[str] = field(default_factory=set)
    init_folders: set[str] = field(default_factory=set)
    """``<model>-v<version>``: the champion's ``pretrained/`` downloaded for warm starts."""

    def describe(self) -> str:
        return ", ".join(f"version {v} ({'/'.join(a)})" for v, a in sorted(self.versions.items())) or "no version"


@dataclass(kw_only=True, slots=True)
class Removal:
    """One thing the plan removes."""

    kind: str
    """``checkpoints``, ``training_logs``, ``bundle``, ``token_files``, ``tokenizer``, ``init_cache``, ``mlflow_run``
    or ``mlflow_model``."""
    target: str
    """The folder, or the MLflow run or logged model id."""
    bytes: int
    """What it takes on disk here (0 when it is on a tracking server)."""
    reason: str


@dataclass(kw_only=True, slots=True)
class Layout:
    """The project's folders that retention looks after, from the catalog."""

    project: Path
    checkpoints: Path | None = None
    training_logs: Path | None = None
    bundles: Path | None = None
    stores: list[tuple[str, Path, int]] = field(default_factory=list)
    """``(what, <path>.by_fingerprint, keep_last)`` of the ``by_fingerprint`` datasets."""
    init_cache: Path | None = None
    mlflow_local: list[Path] = field(default_factory=list)
    """The local MLflow store's database and artifact folder (none with a tracking server)."""

    @property
    def roots(self) -> list[tuple[Path, int]]:
        """What the disk budget counts, each with the depth its parts are named at: the project's data folder
        (``data/06_models/checkpoints``) and the local MLflow store (``mlartifacts/<experiment>``, the database)."""
        return [(self.project / "data", 2), *((path, 1) for path in self.mlflow_local)]

    @classmethod
    def from_catalog(cls, catalog, project: Path, tracking_uri: str) -> Layout:
        from train_deploy.datasets import ArtifactFolderDataset, WorkFolderDataset

        def folder(name: str, kind: type) -> Path | None:
            dataset = catalog.get(name) if name in catalog else None
            return _absolute(project, dataset.folder) if isinstance(dataset, kind) else None

        stores = []
        for name in ("token_files", "tokenizer"):
            dataset = catalog.get(name) if name in catalog else None
            if isinstance(dataset, ArtifactFolderDataset) and dataset.store is not None:
                stores.append((name, _absolute(project, dataset.store), dataset._keep_last))
        return cls(project=project, checkpoints=folder("checkpoints", WorkFolderDataset),
                   training_logs=folder("training_logs", WorkFolderDataset),
                   bundles=folder("export_bundle", ArtifactFolderDataset), stores=stores,
                   init_cache=folder("init_cache", WorkFolderDataset), mlflow_local=local_store(project, tracking_uri))


def local_store(project: Path, tracking_uri: str) -> list[Path]:
    """The files of a local store (``sqlite:///mlruns.db`` and ``mlartifacts/``), or [] for a server."""
    if tracking_uri.startswith(("http://", "https://")):
        return []
    places = [project / "mlartifacts"]
    if tracking_uri.startswith("sqlite:///"):
        places.append(_absolute(project, Path(tracking_uri.removeprefix("sqlite:///"))))
    return places


def _absolute(project: Path, path: Path) -> Path:
    return path if path.is_absolute() else project / path


def _folders(parent: Path | None) -> list[Path]:
    """The sub-folders of ``parent`` (none hidden: staging folders are the lock holder's), newest change first."""
    if parent is None or not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)


def plan_runs(kind: str, parent: Path | None, keep_runs: int, kept: Kept) -> list[Removal]:
    """Training runs' folders (checkpoints or logs) past the ``keep_runs`` newest, but not the aliases' runs."""
    if not keep_runs:
        return []
    removals = []
    for folder in _folders(parent)[keep_runs:]:
        if folder.name not in kept.run_names:
            removals.append(Removal(kind=kind, target=str(folder), bytes=tree_bytes(folder),
                                    reason=f"superseded training run (not among the {keep_runs} newest, no alias)"))
    return removals


def plan_bundles(parent: Path | None, keep_last: int, kept: Kept) -> list[Removal]:
    """Bundle versions past the ``keep_last`` newest, but not the newest one of each alias's bundle fingerprint."""
    if not keep_last:
        return []
    versions = sorted(_folders(parent), key=lambda p: p.name, reverse=True)  # <UTC time>: by name is by age
    needed = set()
    for fingerprint in kept.bundle_fingerprints:
        needed |= {next((v for v in versions if _bundle_fingerprint(v) == fingerprint), None)}
    return [Removal(kind="bundle", target=str(version), bytes=tree_bytes(version),
                    reason=f"bundle version not among the {keep_last} newest, not exported for a version with an alias")
            for version in versions[keep_last:] if version not in needed]


def _bundle_fingerprint(version: Path) -> str | None:
    """The fingerprint ``bundle.json`` records (its one typed reader), None for a folder no bundle reads from."""
    try:
        return BundleMeta.read(version / "bundle").fingerprint
    except DescriptionError:
        return None


def _json_field(path: Path, key: str) -> str | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def plan_stores(stores: Iterable[tuple[str, Path, int]], kept: Kept) -> list[Removal]:
    """Folders of the ``by_fingerprint`` stores past their ``keep_last`` most recently used, as the dataset itself
    prunes them (the current one always kept), but not the token files or tokenizer of a version with an alias."""
    removals = []
    for what, store, keep_last in stores:
        link = store.with_name(store.name.removesuffix(".by_fingerprint"))
        current = (link.parent / os.readlink(link)).resolve() if link.is_symlink() else None
        others = [f for f in _folders(store) if f.resolve() != current]
        for folder in others[max(keep_last - 1, 0):] if keep_last else []:
            if _needed_store_folder(what, folder, kept):
                continue
            removals.append(Removal(kind=what, target=str(folder), bytes=tree_bytes(folder),
                                    reason=f"older than the {keep_last} corpora used last (keep_last in the catalog)"))
    return removals


def _needed_store_folder(what: str, folder: Path, kept: Kept) -> bool:
    if what == "tokenizer":
        return _json_field(folder / TOKENIZER_FILE, "hash") in kept.tokenizer_hashes
    return folder.name in kept.corpus_fingerprints  # token files are stored under the corpus fingerprint


def plan_init_cache(cache: Path | None, model_name: str, kept: Kept) -> list[Removal]:
    """The champion ``pretrained/`` folders downloaded for warm starts of versions that hold no alias now."""
    folders = _folders(cache / "champion") if cache is not None else []
    return [Removal(kind="init_cache", target=str(folder), bytes=tree_bytes(folder),
                    reason="downloaded for a warm start from a version that is no longer champion or previous")
            for folder in folders
            if folder.name.startswith(f"{model_name}-v") and folder.name not in kept.init_folders]


def plan_files(layout: Layout, config: RetentionConfig, model_name: str, kept: Kept) -> list[Removal]:
    """Every folder the configuration removes, in the order they go (least needed first)."""
    return [*plan_runs("checkpoints", layout.checkpoints, config.checkpoints.keep_runs, kept),
            *plan_runs("training_logs", layout.training_logs, config.training_logs.keep_runs, kept),
            *plan_bundles(layout.bundles, config.bundles.keep_last, kept),
            *plan_stores(layout.stores, kept),
            *plan_init_cache(layout.init_cache, model_name, kept)]


def last_run_bytes(layout: Layout) -> int:
    """What the last run wrote, measured: its checkpoint and log folders, its bundle version, and in a local store
    the bundle's two MLflow copies (the run's ``export/bundle`` and the logged model)."""
    newest = [next(iter(_folders(parent)), None) for parent in (layout.checkpoints, layout.training_logs)]
    bundle = next(iter(sorted(_folders(layout.bundles), key=lambda p: p.name, reverse=True)), None)
    bundle_bytes = tree_bytes(bundle) if bundle is not None else 0
    copies = 2 if layout.mlflow_local else 0
    return sum(tree_bytes(folder) for folder in newest if folder is not None) + bundle_bytes * (1 + copies)
