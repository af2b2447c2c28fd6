"""What ``train-deploy gc`` would remove from the project's folders, and why: the plan, decided before anything goes.

The folders come from the catalog (``checkpoints``, ``training_logs``, ``export_bundle``, the ``by_fingerprint``
stores of ``token_files`` and ``tokenizer``, ``init_cache``), so a moved entry is collected where it is. What the
versions holding an alias of any of the project's registered models need (:class:`Kept`, from the registry) is
never in a plan; folders that registered versions came from (:class:`Registered`) take the places the counts keep
before those of runs that failed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from train_deploy.handoffs import TOKENIZER_FILE, BundleMeta, DescriptionError
from train_deploy.retention.config import RetentionConfig
from train_deploy.retention.disk import tree_bytes


@dataclass(kw_only=True, slots=True)
class Registered:
    """What any registered version of the project's models came from (whatever its decision): folders of runs that
    got that far take the ``keep_runs``/``keep_last`` places first, so failed nights never push them out."""

    run_names: set[str] = field(default_factory=set)
    bundle_fingerprints: set[str] = field(default_factory=set)
    corpus_fingerprints: set[str] = field(default_factory=set)
    tokenizer_hashes: set[str] = field(default_factory=set)

    def add(self, tags: dict[str, str]) -> None:
        """Count the version with these tags."""
        for found, tag in ((self.run_names, "training.run_name"), (self.bundle_fingerprints, "bundle.fingerprint"),
                           (self.corpus_fingerprints, "corpus.fingerprint"), (self.tokenizer_hashes, "tokenizer.hash")):
            found |= {tags[tag]} if tags.get(tag) else set()


@dataclass(kw_only=True, slots=True)
class Kept:
    """What the versions holding an alias (``champion``, ``previous``, …) of every registered model of the project
    need, read from their tags, each with who needs it; and the runs the models' own tags name."""

    versions: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Registered model → version → the aliases it holds."""
    run_names: set[str] = field(default_factory=set)
    """Their training runs (``training.run_name``): checkpoint and log folders."""
    bundle_fingerprints: set[str] = field(default_factory=set)
    corpus_fingerprints: set[str] = field(default_factory=set)
    tokenizer_hashes: set[str] = field(default_factory=set)
    run_ids: set[str] = field(default_factory=set)
    """Their MLflow runs, and the runs a model's tags name (``eval_set.uri``: its evaluation set's)."""
    model_ids: set[str] = field(default_factory=set)
    init_folders: set[str] = field(default_factory=set)
    """``<model>-v<version>``: the champion's ``pretrained/`` downloaded for warm starts."""
    why: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """(field, value) → who needs it (``train_deploy_lm version 1 (champion)``)."""
    registered: Registered = field(default_factory=Registered)
    spared: list[tuple[str, str, str]] = field(default_factory=list)
    """(kind, folder or MLflow id, why) of what the configured counts or decisions would remove, kept for this."""

    def need(self, name: str, value: str, who: str) -> None:
        """Record that ``who`` needs ``value`` (of the field ``name``)."""
        getattr(self, name).add(value)
        holders = self.why.setdefault((name, value), [])
        holders += [] if who in holders else [who]

    def spares(self, kind: str, target: str | Path, name: str, value: str | None) -> bool:
        """Whether ``value`` (of the field ``name``) is needed; if so, ``target`` is recorded as spared, and why."""
        if value is None or value not in getattr(self, name):
            return False
        self.spared.append((kind, str(target), "needed by " + "; ".join(self.why.get((name, value), ["an alias"]))))
        return True

    def describe(self) -> str:
        return "; ".join(f"{model}: " + ", ".join(f"version {v} ({'/'.join(a)})" for v, a in sorted(held.items()))
                         for model, held in sorted(self.versions.items())) or "no version"


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


def _first_places(folders: list[Path], registered: Callable[[Path], bool], places: int,
                  newest: bool = True) -> set[Path]:
    """The folders the ``places`` go to: those a registered version came from first, then the others, newest first
    in each; with ``newest``, also the newest of all (the run a retry resumes, the bundle the next registry stage
    may register)."""
    ranked = [f for f in folders if registered(f)] + [f for f in folders if not registered(f)]
    return set(ranked[:places]) | set(folders[:1] if newest else [])


def plan_runs(kind: str, parent: Path | None, keep_runs: int, kept: Kept) -> list[Removal]:
    """Training runs' folders (checkpoints or logs) past the ``keep_runs`` newest that registered a version (a failed
    run takes a place only when too few did) and the newest one, but not the aliases' runs."""
    if not keep_runs:
        return []
    folders = _folders(parent)
    keep = _first_places(folders, lambda f: f.name in kept.registered.run_names, keep_runs)
    return [Removal(kind=kind, target=str(folder), bytes=tree_bytes(folder),
                    reason=f"superseded training run (not the newest, nor among the {keep_runs} newest that "
                           "registered a version; no alias needs it)")
            for folder in folders if folder not in keep and not kept.spares(kind, folder, "run_names", folder.name)]


def plan_bundles(parent: Path | None, keep_last: int, kept: Kept) -> list[Removal]:
    """Bundle versions past the ``keep_last`` newest that a version was registered from (others take the places
    left) and the newest, but not the newest one of each alias's bundle fingerprint."""
    if not keep_last:
        return []
    versions = sorted(_folders(parent), key=lambda p: p.name, reverse=True)  # <UTC time>: by name is by age
    fingerprints = {version: _bundle_fingerprint(version) for version in versions}
    needed = set()
    for fingerprint in kept.bundle_fingerprints:
        needed |= {next((v for v in versions if fingerprints[v] == fingerprint), None)}
    keep = _first_places(versions, lambda v: fingerprints[v] in kept.registered.bundle_fingerprints, keep_last)
    return [Removal(kind="bundle", target=str(version), bytes=tree_bytes(version),
                    reason=f"bundle version not the newest, nor among the {keep_last} newest registered; no alias "
                           "needs it")
            for version in versions if version not in keep and
            not (version in needed and kept.spares("bundle", version, "bundle_fingerprints", fingerprints[version]))]


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
    """Folders of the ``by_fingerprint`` stores past their ``keep_last`` most recently used (the current one always
    kept; folders a registered version came from take the places first), but not the token files or tokenizer of a
    version with an alias. The only pruning of these stores: a save prunes nothing (``train_deploy.datasets``)."""
    removals = []
    for what, store, keep_last in stores:
        if keep_last:
            removals += _plan_store(what, store, keep_last, kept)
    return removals


def _plan_store(what: str, store: Path, keep_last: int, kept: Kept) -> list[Removal]:
    link = store.with_name(store.name.removesuffix(".by_fingerprint"))
    current = (link.parent / os.readlink(link)).resolve() if link.is_symlink() else None
    folders = _folders(store)
    others = [f for f in folders if f.resolve() != current]
    field_name, value_of = _store_need(what)
    registered = getattr(kept.registered, field_name)
    places = keep_last - (len(others) < len(folders))  # without a current folder, all keep_last go to the others
    keep = _first_places(others, lambda f: value_of(f) in registered, places, newest=False)
    return [Removal(kind=what, target=str(folder), bytes=tree_bytes(folder),
                    reason=f"not among the {keep_last} corpora used last that a version was registered from "
                           "(keep_last in the catalog); no alias needs it")
            for folder in others if folder not in keep and not kept.spares(what, folder, field_name, value_of(folder))]


def _store_need(what: str) -> tuple[str, Callable[[Path], str | None]]:
    """The field of :class:`Kept` (and :class:`Registered`) a store's folder is matched by, and its value."""
    if what == "tokenizer":
        return "tokenizer_hashes", lambda folder: _json_field(folder / TOKENIZER_FILE, "hash")
    return "corpus_fingerprints", lambda folder: folder.name  # token files are stored under the corpus fingerprint


def plan_init_cache(cache: Path | None, model_names: Iterable[str], kept: Kept) -> list[Removal]:
    """The champion ``pretrained/`` folders downloaded for warm starts of the project's models' versions that hold
    no alias now."""
    folders = _folders(cache / "champion") if cache is not None else []
    names = set(model_names)
    return [Removal(kind="init_cache", target=str(folder), bytes=tree_bytes(folder),
                    reason="downloaded for a warm start from a version that is no longer champion or previous")
            for folder in folders if folder.name.rpartition("-v")[0] in names
            and not kept.spares("init_cache", folder, "init_folders", folder.name)]


def plan_files(layout: Layout, config: RetentionConfig, model_names: Iterable[str], kept: Kept) -> list[Removal]:
    """Every folder the configuration removes, in the order they go (least needed first)."""
    return [*plan_runs("checkpoints", layout.checkpoints, config.checkpoints.keep_runs, kept),
            *plan_runs("training_logs", layout.training_logs, config.training_logs.keep_runs, kept),
            *plan_bundles(layout.bundles, config.bundles.keep_last, kept),
            *plan_stores(layout.stores, kept),
            *plan_init_cache(layout.init_cache, model_names, kept)]


def last_run_bytes(layout: Layout) -> int:
    """What the last run wrote, measured: its checkpoint and log folders, its bundle version, and in a local store
    the bundle's two MLflow copies (the run's ``export/bundle`` and the logged model)."""
    newest = [next(iter(_folders(parent)), None) for parent in (layout.checkpoints, layout.training_logs)]
    bundle = next(iter(sorted(_folders(layout.bundles), key=lambda p: p.name, reverse=True)), None)
    bundle_bytes = tree_bytes(bundle) if bundle is not None else 0
    copies = 2 if layout.mlflow_local else 0
    return sum(tree_bytes(folder) for folder in newest if folder is not None) + bundle_bytes * (1 + copies)
