"""Atomic outputs: a folder is either the old one or the complete new one, durably, and what a killed
run leaves behind is found and removed without touching anything else."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from train_deploy.atomic import (
    DiskFullError,
    atomic_folder,
    atomic_path,
    atomic_symlink,
    clean_leftovers,
    remove_leftovers,
    stale_leftovers,
)


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def test_folder_is_swapped_in_whole_and_a_failure_keeps_the_old_one(tmp_path):
    final = tmp_path / "out"
    with atomic_folder(final) as staging:
        (staging / "a.txt").write_text("first")
    assert (final / "a.txt").read_text() == "first"
    with pytest.raises(RuntimeError), atomic_folder(final) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "a.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert (final / "a.txt").read_text() == "first"
    with atomic_folder(final) as staging:
        (staging / "b.txt").write_text("second")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old folders left behind


def test_the_staged_tree_and_its_parent_are_fsynced(tmp_path, monkeypatch):
    synced: list[Path] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    with atomic_folder(tmp_path / "out") as staging:
        (staging / "sub" / "deeper").mkdir(parents=True)
        (staging / "a.txt").write_text("a")
        (staging / "sub" / "deeper" / "b.txt").write_text("b")
    staged = {str(p.relative_to(staging)) for p in synced if p == staging or staging in p.parents}
    assert staged == {".", "a.txt", "sub", "sub/deeper", "sub/deeper/b.txt"}
    assert synced[-1] == tmp_path  # the renames themselves, after the files


def test_replaced_folders_are_moved_aside_under_unpredictable_names(tmp_path, monkeypatch):
    moved_aside: list[Path] = []
    replace = os.replace

    def record(source, target) -> None:
        if Path(source) == tmp_path / "out":
            moved_aside.append(Path(target))
        replace(source, target)

    monkeypatch.setattr(os, "replace", record)
    for text in ("first", "second", "third"):
        with atomic_folder(tmp_path / "out") as staging:
            (staging / "a.txt").write_text(text)
    assert len(moved_aside) == 2 and moved_aside[0].parent != moved_aside[1].parent
    for target in moved_aside:
        assert re.fullmatch(r"\.out\.tdold-[a-z0-9_]{8}", target.parent.name) and target.name == "out"
    assert (tmp_path / "out" / "a.txt").read_text() == "third" and tree(tmp_path).keys() == {"out", "out/a.txt"}


# --- leftovers of killed runs ----------------------------------------------------------------------

KILLED_WRITING = """
import os, signal, sys
from pathlib import Path
from train_deploy.atomic import atomic_folder, atomic_path, scratch_folder

root = Path(sys.argv[1])
with atomic_folder(root / "tokens") as staging, atomic_path(root / "runs" / "manifest.json") as tmp:
    (scratch_folder(staging, "shards") / "000001.train.bin").write_bytes(b"tokens")
    tmp.write_text("{}")
    os.kill(os.getpid(), signal.SIGKILL)
"""

KILLED_SWAPPING = """
import os, signal, sys
from pathlib import Path
from train_deploy.atomic import atomic_folder

root = Path(sys.argv[1])
replace, calls = os.replace, []

def replace_then_die(source, target):
    calls.append(target)
    if len(calls) == 2:  # the old folder is in its holder, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    replace(source, target)

with atomic_folder(root / "checkpoints" / "step_00000002") as staging:
    (staging / "model.safetensors").write_text("new")
    os.replace = replace_then_die
"""

USER_FILES = ["tokens/train.bin", ".gitignore", ".env.local", ".tokens.backup", "notes.tdstage-abc12345",
              ".config.settings", "tokens.old-12", ".step_00000002", "checkpoints/.keep",
              "checkpoints/step_00000001/model.safetensors", "checkpoints/.step_00000003.tmp",
              "runs/.manifest.json.tmp"]


def test_a_link_is_switched_in_one_rename_and_a_stranded_temporary_link_is_a_leftover(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "store" / name).mkdir(parents=True)
    atomic_symlink(tmp_path / "current", "store/a")
    atomic_symlink(tmp_path / "current", "store/b")
    assert os.readlink(tmp_path / "current") == "store/b" and (tmp_path / "current").is_dir()
    os.symlink("store/a", tmp_path / ".current.tdstage-0a1b2c3d.tmp")  # what a kill before the rename leaves
    assert [p.name for p in remove_leftovers(tmp_path)] == [".current.tdstage-0a1b2c3d.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "store"] and (tmp_path / "store/a").is_dir()


def run_killed(script: str, root: Path) -> None:
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr


def test_leftovers_of_killed_writers_are_found_and_removed_and_nothing_else(tmp_path):
    root = tmp_path / "data"
    for name in USER_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / "checkpoints" / "step_00000002").mkdir()
    (root / "checkpoints" / "step_00000002" / "model.safetensors").write_text("old")
    run_killed(KILLED_WRITING, root)
    run_killed(KILLED_SWAPPING, root)
    (root / ".tokens.old-4242").mkdir()  # the name old copies had before the markers
    assert not (root / "checkpoints" / "step_00000002").exists()  # only its holder has it now

    found = stale_leftovers(root) + stale_leftovers(root / "runs") + stale_leftovers(root / "checkpoints")
    assert sorted(re.sub(r"-[a-z0-9_]{8}", "-X", str(p.relative_to(root))) for p in found) == [
        ".tokens.old-4242", ".tokens.tdstage-X", "checkpoints/.step_00000002.tdold-X",
        "checkpoints/.step_00000002.tdstage-X", "runs/.manifest.json.tdstage-X.tmp"]
    assert sorted(clean_leftovers(root)) == sorted(found)
    assert (root / "checkpoints" / "step_00000002" / "model.safetensors").read_text() == "old"  # put back
    assert tree(root) == {**{name: name.encode() for name in USER_FILES},
                          "tokens": None, "checkpoints": None, "checkpoints/step_00000001": None, "runs": None,
                          "checkpoints/step_00000002": None, "checkpoints/step_00000002/model.safetensors": b"old"}
    assert clean_leftovers(root) == [] and remove_leftovers(root / "missing") == []


# --- a full disk -----------------------------------------------------------------------------------

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_a_file_is_one_line_and_keeps_the_old_file(tmp_path):
    final = tmp_path / "manifest.json"
    final.write_text("old")
    with pytest.raises(DiskFullError) as exc, atomic_path(final, what="the token manifest") as tmp:
        tmp.write_bytes(b"x" * 3 * 2**20)
        raise FULL
    assert re.fullmatch(rf"{re.escape(str(final))}: no space left on device \(ENOSPC\) writing the token manifest; "
                        r"at least 3 MB needed, \d+ MB free", str(exc.value))
    assert exc.value.errno == errno.ENOSPC and isinstance(exc.value, OSError)
    assert tree(tmp_path) == {"manifest.json": b"old"}


def test_a_full_disk_names_the_file_the_error_names(tmp_path):
    with pytest.raises(DiskFullError, match=r"out: .* writing sub/a\.bin; \d+ MB free$"), \
            atomic_folder(tmp_path / "out") as staging:
        (staging / "sub").mkdir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staging / "sub" / "a.bin"))
    assert tree(tmp_path) == {}


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_older_checkpoints(tmp_path, monkeypatch,
                                                                                          error):
    import paddle
    import safetensors.paddle
    from safetensors import SafetensorError

    from train_deploy.training.checkpoint import complete_checkpoints, step_dir, write_checkpoint

    model, optimizer = {"w": paddle.ones([512, 512])}, {"w/moment1": paddle.zeros([512, 512])}
    for step in (1, 2):
        write_checkpoint(tmp_path, step, model, optimizer, {"step": step}, keep_last=3)
    before = tree(tmp_path)
    save_file = safetensors.paddle.save_file

    def disk_fills_at_the_optimizer(tensors, filename, metadata=None) -> None:
        if Path(filename).name.startswith("optimizer"):  # what safetensors raises, or a plain OSError
            raise FULL if error == "oserror" else SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.paddle, "save_file", disk_fills_at_the_optimizer)
    with pytest.raises(DiskFullError) as exc:
        write_checkpoint(tmp_path, 3, model, optimizer, {"step": 3}, keep_last=3)
    assert re.fullmatch(rf"{re.escape(str(step_dir(tmp_path, 3)))}: no space left on device \(ENOSPC\) writing "
                        r"the folder; at least 2 MB needed, \d+ MB free", str(exc.value))
    assert tree(tmp_path) == before  # the older checkpoints as they were, no partial folder
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
