"""The catalog's folder datasets: staged and published whole, kept when unchanged, versioned, read-only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kedro.io import DataCatalog, DatasetError

from tests.helpers.project import REPO
from train_deploy.atomic import clean_leftovers
from train_deploy.datasets import ArtifactFolderDataset, DescriptionDataset, FolderWork, WorkFolderDataset
from train_deploy.handoffs import DescriptionError, TrainingResult, read_json, write_json


@dataclass(kw_only=True, slots=True)
class Notes:
    """A folder holding ``notes.txt`` and its description ``notes.json``."""

    path: str = field(default="", metadata={"json": False})
    reused: bool = field(default=False, metadata={"json": False})
    fingerprint: str

    @classmethod
    def read_folder(cls, folder: Path) -> Notes:
        return read_json(cls, Path(folder) / "notes.json", path=str(folder))


def notes(fingerprint: str, text: str = "text", fail: bool = False) -> FolderWork[Notes]:
    def build(folder: Path) -> Notes:
        (folder / "notes.txt").write_text(text, encoding="utf-8")
        if fail:
            raise ValueError(f"{folder.name}: the build failed halfway")
        described = Notes(path=str(folder), fingerprint=fingerprint)
        write_json(folder / "notes.json", described)
        return described

    return FolderWork(build=build, keep=lambda current: current.fingerprint == fingerprint, what="notes",
                      fingerprint=fingerprint)


def dataset(path: Path, **kwargs) -> ArtifactFolderDataset:
    return ArtifactFolderDataset(path=str(path), description="tests.test_datasets.Notes", **kwargs)


def test_save_builds_beside_the_location_and_publishes_the_whole_folder(tmp_path):
    target = dataset(tmp_path / "notes")
    assert not target.exists()
    target.save(notes("a"))
    loaded = target.load()
    assert loaded == Notes(path=str(tmp_path / "notes"), fingerprint="a")
    assert (tmp_path / "notes" / "notes.txt").read_text(encoding="utf-8") == "text"
    assert [p.name for p in tmp_path.iterdir()] == ["notes"] and target.exists()
    assert dataset(tmp_path / "notes").load() == loaded  # a later run reads the same description from disk


def test_an_unchanged_folder_is_kept_and_a_changed_one_rebuilt(tmp_path, caplog):
    target = dataset(tmp_path / "notes")
    target.save(notes("a", "first"))
    with caplog.at_level("INFO"):
        target.save(notes("a", "second"))
    assert target.load().reused and (tmp_path / "notes/notes.txt").read_text(encoding="utf-8") == "first"
    assert f"Kept the notes in {tmp_path / 'notes'}: up to date" in caplog.text
    target.save(notes("b", "second"))
    assert not target.load().reused and (tmp_path / "notes/notes.txt").read_text(encoding="utf-8") == "second"


def test_a_failed_build_leaves_the_published_folder_and_no_staging_behind(tmp_path):
    target = dataset(tmp_path / "notes")
    target.save(notes("a", "first"))
    with pytest.raises(DatasetError) as exc:
        target.save(notes("b", "second", fail=True))
    assert str(exc.value).endswith(": the build failed halfway") and "\n" not in str(exc.value)
    assert isinstance(exc.value.__cause__, ValueError)  # the stage's own error, kept for callers that need it
    assert (tmp_path / "notes/notes.txt").read_text(encoding="utf-8") == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]


def test_a_damaged_description_is_rebuilt_not_kept(tmp_path, caplog):
    target = dataset(tmp_path / "notes")
    target.save(notes("a", "first"))
    (tmp_path / "notes/notes.json").write_text("{not json", encoding="utf-8")
    assert not target.exists()
    with caplog.at_level("WARNING"):
        target.save(notes("a", "second"))
    assert "notes.json: unreadable" in caplog.text
    assert (tmp_path / "notes/notes.txt").read_text(encoding="utf-8") == "second"


def test_versions_keep_every_save_load_the_newest_and_link_an_unchanged_one(tmp_path):
    first = dataset(tmp_path / "notes", versions=True)
    first.save(notes("a", "first"))
    second = dataset(tmp_path / "notes", versions=True)  # the next run: a new save version
    second.save(notes("a", "again"))
    older, newer = sorted((tmp_path / "notes").iterdir())
    assert second.load().path == str(newer / "notes") and second.load().reused
    assert (newer / "notes/notes.txt").stat().st_ino == (older / "notes/notes.txt").stat().st_ino
    third = dataset(tmp_path / "notes", versions=True)
    third.save(notes("b", "changed"))
    assert len(list((tmp_path / "notes").iterdir())) == 3
    assert (Path(third.load().path) / "notes.txt").read_text(encoding="utf-8") == "changed"


def test_by_fingerprint_keeps_each_fingerprints_folder_and_switching_back_builds_nothing(tmp_path, caplog):
    dataset(tmp_path / "notes", by_fingerprint=True).save(notes("a", "first"))
    dataset(tmp_path / "notes", by_fingerprint=True).save(notes("b", "second"))
    store = tmp_path / "notes.by_fingerprint"
    before = (store / "a" / "notes.txt").stat()
    again = dataset(tmp_path / "notes", by_fingerprint=True)
    with caplog.at_level("INFO"):
        again.save(notes("a", "would be rebuilt"))
    assert f"Kept the notes in {store / 'a'}: up to date" in caplog.text
    assert again.load() == Notes(path=str(store / "a"), fingerprint="a", reused=True)
    assert (store / "a" / "notes.txt").stat().st_mtime_ns == before.st_mtime_ns  # not written again
    assert sorted(p.name for p in store.iterdir()) == ["a", "b"]
    assert os.readlink(tmp_path / "notes") == "notes.by_fingerprint/a"  # relative: the project can move
    with pytest.raises(DatasetError, match="the build failed halfway"):
        dataset(tmp_path / "notes", by_fingerprint=True).save(notes("c", fail=True))
    assert sorted(p.name for p in store.iterdir()) == ["a", "b"]  # nothing of c, and a is still current
    assert (tmp_path / "notes" / "notes.txt").read_text(encoding="utf-8") == "first"
    assert dataset(tmp_path / "notes", by_fingerprint=True).load().path == str(store / "a")  # a later run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "notes.by_fingerprint"]  # nothing staged left


KILLED_BUILDING = """
import os, signal, sys
from pathlib import Path
from tests.test_datasets import dataset, notes
from train_deploy.datasets import FolderWork

def build(folder):
    (folder / "notes.txt").write_text("half")
    os.kill(os.getpid(), signal.SIGKILL)

dataset(Path(sys.argv[1]) / "notes", by_fingerprint=True).save(FolderWork(build=build, fingerprint="b"))
"""


def test_a_run_killed_while_building_another_fingerprint_leaves_the_current_one_and_a_leftover(tmp_path):
    dataset(tmp_path / "notes", by_fingerprint=True).save(notes("a", "first"))
    done = subprocess.run([sys.executable, "-c", KILLED_BUILDING, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    store = tmp_path / "notes.by_fingerprint"
    assert dataset(tmp_path / "notes", by_fingerprint=True).load().fingerprint == "a"
    staged = [p for p in store.iterdir() if p.name != "a"]
    assert len(staged) == 1 and staged[0].name.startswith(".b.tdstage-")  # what the killed build was filling
    assert clean_leftovers(tmp_path) == staged  # removed by the next run (under the run lock)
    assert [p.name for p in store.iterdir()] == ["a"]


def test_by_fingerprint_moves_a_folder_of_the_old_layout_in_and_a_save_prunes_no_other_fingerprint(tmp_path, caplog):
    dataset(tmp_path / "notes").save(notes("old", "before"))  # a real folder, as earlier versions wrote it
    assert dataset(tmp_path / "notes", by_fingerprint=True).load().fingerprint == "old"  # still read as it is
    with caplog.at_level("INFO"), pytest.raises(DatasetError):  # the first save after the upgrade fails
        dataset(tmp_path / "notes", by_fingerprint=True).save(notes("new", fail=True))
    store = tmp_path / "notes.by_fingerprint"
    assert f"Moved the notes in {tmp_path / 'notes'} to {store / 'old'}" in caplog.text
    assert dataset(tmp_path / "notes", by_fingerprint=True).load().fingerprint == "old"  # still current
    dataset(tmp_path / "notes", by_fingerprint=True).save(notes("old", "again"))
    assert (tmp_path / "notes").is_symlink() and (store / "old/notes.txt").read_text(encoding="utf-8") == "before"
    with caplog.at_level("INFO"):
        for fingerprint in ("b", "c", "old", "d"):  # "old" used again: more recent than b and c
            dataset(tmp_path / "notes", by_fingerprint=True, keep_last=3).save(notes(fingerprint))
    # keep_last is train-deploy gc's to apply (it knows what the registered models' aliases need): a save removes
    # no other fingerprint's folder, and marks its own the most recently used
    assert sorted(p.name for p in store.iterdir()) == ["b", "c", "d", "old"]
    assert sorted(store.iterdir(), key=lambda p: p.stat().st_mtime_ns)[-2:] == [store / "old", store / "d"]
    assert (store / "old/notes.txt").read_text(encoding="utf-8") == "before"  # kept, never rebuilt
    assert "Removed" not in caplog.text
    with pytest.raises(DatasetError, match="versions and by_fingerprint exclude each other"):
        dataset(tmp_path / "x", by_fingerprint=True, versions=True)


def test_a_versioned_folder_dataset_fits_a_catalog_with_other_versioned_datasets(tmp_path):
    catalog = DataCatalog.from_config({
        "bundle": {"type": "train_deploy.datasets.ArtifactFolderDataset", "path": str(tmp_path / "b"),
                   "description": "tests.test_datasets.Notes", "versions": True},
        "table": {"type": "json.JSONDataset", "filepath": str(tmp_path / "t.json"), "versioned": True},
    })
    catalog.save("table", {"a": 1})
    catalog.save("bundle", notes("a"))
    assert catalog.load("bundle").fingerprint == "a" and catalog.load("table") == {"a": 1}


def test_description_dataset_round_trips_a_typed_record_and_refuses_others(tmp_path):
    result = TrainingResult(run_name="r", step=4, consumed_samples=32, finished=True, checkpoints="c",
                            checkpoint="c/step_00000004", val_loss=None, seq_length=32, eval_windows=16,
                            parameters=100, layout={"dp": 2, "mp": 1, "pp": 1})
    record = DescriptionDataset(filepath=str(tmp_path / "result.json"),
                                description="train_deploy.handoffs.TrainingResult")
    record.save(result)
    assert record.load() == result and json.loads((tmp_path / "result.json").read_text())["step"] == 4
    with pytest.raises(DatasetError, match=r"result.json: expected a TrainingResult, got dict"):
        record.save({"step": 4})
    (tmp_path / "result.json").write_text(json.dumps({**json.loads((tmp_path / "result.json").read_text()),
                                                      "step": "four"}))
    with pytest.raises(DatasetError, match=r"result.json: step: expected an integer, got 'four'"):
        record.load()


def test_work_folder_is_a_location_that_nothing_saves(tmp_path):
    folder = WorkFolderDataset(path=str(tmp_path / "checkpoints"))
    assert folder.load().run("abc") == tmp_path / "checkpoints" / "abc"
    assert not folder.exists()
    with pytest.raises(DatasetError, match="is filled by the processes a node starts"):
        folder.save(None or object())


def test_a_description_class_must_describe_a_folder():
    with pytest.raises(DatasetError, match="not an importable class"):
        ArtifactFolderDataset(path="x", description="train_deploy.handoffs.Nothing")
    with pytest.raises(DatasetError, match="is not a description dataclass of a folder"):
        ArtifactFolderDataset(path="x", description="train_deploy.handoffs.TrainingResult")


def test_description_errors_name_the_file_and_key(tmp_path):
    (tmp_path / "notes.json").write_text(json.dumps({"fingerprint": 3}), encoding="utf-8")
    with pytest.raises(DescriptionError, match=rf"^{tmp_path / 'notes.json'}: fingerprint: expected a string, got 3$"):
        Notes.read_folder(tmp_path)


def test_a_folder_pointer_loads_the_folder_it_was_saved_with_and_a_damaged_one_is_one_line(tmp_path,
                                                                                           tiny_token_files):
    """validated_token_files: the token files the data gate passed, read again from their folder by a later stage."""
    from train_deploy.datasets import FolderPointerDataset
    from train_deploy.handoffs import TokenManifest

    pointer = FolderPointerDataset(filepath=str(tmp_path / "validated.json"),
                                   description="train_deploy.handoffs.TokenManifest")
    assert not pointer.exists()
    pointer.save(tiny_token_files)
    assert json.loads((tmp_path / "validated.json").read_text()) == {"path": str(Path(tiny_token_files.path).resolve())}
    loaded = pointer.load()
    assert isinstance(loaded, TokenManifest) and loaded.fingerprint == tiny_token_files.fingerprint
    assert Path(loaded.path) == Path(tiny_token_files.path).resolve()
    (tmp_path / "validated.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"validated.json: not a folder record; run the stage that writes it again$"):
        pointer.load()
