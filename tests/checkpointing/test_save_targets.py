"""Where ``save_state`` writes, and what it leaves alone: new folders, folders holding the user's files or an
older checkpoint, files and symlinks given as the target, rotation among foreign folders, failures and crashes
at every moment of a publish into a shared folder (issue 23, item 3)."""

import errno
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS, clean_env, torchrun

from hasten import Accelerator
from hasten.checkpointing import MANIFEST, complete_checkpoints, publishing
from hasten.errors import CheckpointError, CheckpointTargetError
from hasten.state import reset_state
from hasten.utils import ProjectConfiguration

USER_FILES = {"train.log": b"step 1 loss 0.5\n", "tokenizer/vocab.json": b'{"a": 0}', "notes.txt": b"try lr 3e-4"}


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def build(fill, custom=()):
    """An accelerator with a small model whose weights all hold ``fill``, and the custom objects registered."""
    reset_state()
    acc = Accelerator()
    model = torch.nn.Linear(3, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    acc.register_for_checkpointing(*custom)
    return acc, model


def loaded_fill(path, custom=()):
    acc, model = build(-1.0, custom)
    acc.load_state(path)
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
    assert len(values) == 1, f"{path} holds mixed weights: {values}"
    return values.pop()


def put_user_files(folder):
    for name, data in USER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def assert_user_files(folder):
    for name, data in USER_FILES.items():
        assert (folder / name).read_bytes() == data, f"{folder / name} was changed or removed"


def hidden_leftovers(folder):
    return [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]


def test_every_target_kind_keeps_what_is_not_the_checkpoint(tmp_path):
    acc, _ = build(1.0)
    acc.save_state(tmp_path / "new")  # a new folder
    assert loaded_fill(tmp_path / "new") == 1.0 and not hidden_leftovers(tmp_path / "new")

    shared = tmp_path / "out"  # a folder holding the user's files: they stay, the checkpoint goes beside them
    shared.mkdir()
    put_user_files(shared)
    build(2.0, [Counter(5)])[0].save_state(shared)
    assert_user_files(shared)
    assert loaded_fill(shared, [Counter()]) == 2.0
    assert (shared / "custom_checkpoint_0.json").exists()
    build(3.0)[0].save_state(shared)  # an older checkpoint and the user's files: the checkpoint's files are replaced
    assert_user_files(shared)
    assert loaded_fill(shared) == 3.0
    assert not (shared / "custom_checkpoint_0.json").exists(), (
        "the previous checkpoint's file the new one lacks is removed"
    )
    assert not hidden_leftovers(shared)

    build(4.0)[0].save_state(tmp_path / "new")  # a folder holding only an older checkpoint: swapped whole
    assert loaded_fill(tmp_path / "new") == 4.0 and not hidden_leftovers(tmp_path / "new")

    notes = tmp_path / "notes.txt"  # an existing file: refused before anything is written
    notes.write_bytes(b"my notes")
    (tmp_path / "link_to_file").symlink_to(notes)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    acc, _ = build(5.0)
    for given, named in (
        (notes, notes),
        (tmp_path / "link_to_file", notes),
        (tmp_path / "dangling", tmp_path / "nowhere"),
    ):
        with pytest.raises(CheckpointTargetError) as caught:
            acc.save_state(given)
        message = str(caught.value)
        assert isinstance(caught.value, FileExistsError) and "\n" not in message and str(named) in message, message
        assert "Nothing was written" in message
    assert notes.read_bytes() == b"my notes" and (tmp_path / "link_to_file").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link_to_file", "new", "notes.txt", "out"]

    real = tmp_path / "scratch" / "run1"  # a symlink to a folder: the checkpoint goes into that folder, the link stays
    real.mkdir(parents=True)
    put_user_files(real)
    (tmp_path / "link_to_folder").symlink_to(real)
    assert acc.save_state(tmp_path / "link_to_folder") == str(tmp_path / "link_to_folder")
    assert (tmp_path / "link_to_folder").is_symlink() and (real / MANIFEST).is_file()
    assert_user_files(real)
    assert loaded_fill(tmp_path / "link_to_folder") == 5.0


def test_a_write_failing_midway_in_a_shared_folder_leaves_everything_and_says_only_what_happened(tmp_path, monkeypatch):
    from hasten.checkpointing import files

    shared = tmp_path / "out"
    shared.mkdir()
    put_user_files(shared)
    build(1.0)[0].save_state(shared)
    real_write = files.write_safetensors
    calls = []

    def fail_halfway(handle, tensors, metadata=None):  # the model's file is written, the next one fails midway
        calls.append(1)
        if len(calls) == 2:
            handle.write(b"\0" * 64)
            raise OSError(errno.EIO, "Input/output error")
        return real_write(handle, tensors, metadata)

    monkeypatch.setattr(files, "write_safetensors", fail_halfway)
    acc, _ = build(2.0)
    with pytest.raises(CheckpointError) as caught:
        acc.save_state(shared)
    monkeypatch.setattr(files, "write_safetensors", real_write)
    message = str(caught.value)
    assert re.fullmatch(
        rf"Could not save the checkpoint {re.escape(str(shared))}: Input/output error \(writing "
        rf"{re.escape(str(tmp_path))}/\.out\.partial/\S+\)\. "
        r"The partial folder was removed; earlier checkpoints and the folder's other files are untouched\.",
        message,
    ), message
    assert not hidden_leftovers(shared), "the message says the partial folder was removed: it must be"
    assert_user_files(shared)
    assert loaded_fill(shared) == 1.0


class Crash(BaseException):
    """Stands for the process dying at that moment (nothing after it runs, no handler catches it)."""


def test_a_crash_at_any_moment_of_a_shared_folder_publish_leaves_the_old_or_the_new_checkpoint(tmp_path, monkeypatch):
    shared = tmp_path / "out"
    shared.mkdir()
    put_user_files(shared)
    build(1.0, [Counter(1)])[0].save_state(shared)
    real_rename = os.rename
    renames = []
    monkeypatch.setattr(publishing.os, "rename", lambda a, b: (renames.append(b), real_rename(a, b)))
    build(2.0)[0].save_state(shared)
    moments = len(renames)
    assert moments >= 6, renames  # commit, every file, the manifest
    seen = set()
    for moment in range(moments):
        previous = 1.0 + moment
        build(previous, [Counter(1)] if moment % 2 else [])[0].save_state(shared)  # the folder's current checkpoint
        calls = []

        def crash_at(a, b, moment=moment, calls=calls):
            if len(calls) == moment:
                raise Crash()
            calls.append(b)
            real_rename(a, b)

        monkeypatch.setattr(publishing.os, "rename", crash_at)
        with pytest.raises(Crash):
            build(100.0 + moment)[0].save_state(shared)
        monkeypatch.setattr(publishing.os, "rename", real_rename)
        assert_user_files(shared)
        got = loaded_fill(shared)  # completes an interrupted move first
        assert got in (previous, 100.0 + moment), (moment, got)
        seen.add("new" if got == 100.0 + moment else "old")
        assert_user_files(shared)
        assert not hidden_leftovers(shared) and not (shared / "custom_checkpoint_0.json").exists() or got == previous
    assert seen == {"old", "new"}, "crashes before the commit leave the old checkpoint, after it the new one"


def test_a_committed_publish_that_cannot_finish_says_where_the_checkpoint_is(tmp_path, monkeypatch):
    shared = tmp_path / "out"
    shared.mkdir()
    put_user_files(shared)
    build(1.0)[0].save_state(shared)
    real_rename = os.rename

    def refuse_the_manifest(a, b):
        if str(b).endswith(MANIFEST) and ".publishing" in str(a):
            raise OSError(errno.EACCES, "Permission denied", str(b))
        real_rename(a, b)

    monkeypatch.setattr(publishing.os, "rename", refuse_the_manifest)
    with pytest.raises(CheckpointError) as caught:
        build(2.0)[0].save_state(shared)
    message = str(caught.value)
    publishing_folder = tmp_path / ".out.publishing"
    assert f"The checkpoint {shared} is complete but could not be moved into place (Permission denied" in message, (
        message
    )
    assert str(publishing_folder) in message and "Your other files in the folder were not touched." in message
    with pytest.raises(CheckpointError, match="could not be moved into place"):
        loaded_fill(shared)
    monkeypatch.setattr(publishing.os, "rename", real_rename)
    assert loaded_fill(shared) == 2.0 and not publishing_folder.exists()
    assert_user_files(shared)


def test_a_folder_in_the_way_of_a_checkpoint_file_is_refused_before_the_folder_changes(tmp_path):
    shared = tmp_path / "out"
    (shared / "model.safetensors").mkdir(parents=True)
    (shared / "model.safetensors" / "mine.txt").write_text("keep")
    with pytest.raises(
        CheckpointError,
        match=(
            r"model.safetensors is in the way .* Nothing in the folder was changed \(the staging folder was removed\)"
        ),
    ):
        build(1.0)[0].save_state(shared)
    assert (shared / "model.safetensors" / "mine.txt").read_text() == "keep"
    assert sorted(os.listdir(shared)) == ["model.safetensors"] and not hidden_leftovers(shared)


def test_rotation_deletes_only_the_checkpoints_automatic_naming_wrote(tmp_path):
    folder = tmp_path / "checkpoints"
    explicit = folder / "checkpoint_0"  # saved by hand under a name automatic naming also uses
    build(7.0)[0].save_state(explicit)
    accelerate_like = folder / "checkpoint_1"  # another tool's folder of the same name
    accelerate_like.mkdir()
    (accelerate_like / "model.safetensors").write_bytes(b"not hasten's")
    (accelerate_like / MANIFEST).write_text(json.dumps({"format": "hasten-checkpoint", "files": {}}))
    reset_state()
    acc = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2, iteration=2
        )
    )
    model = torch.nn.Linear(3, 2)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state()
    (folder / "checkpoint_2" / "eval.json").write_text('{"accuracy": 0.9}')  # the user's file inside a checkpoint
    for _ in range(3):
        acc.save_state()
    assert loaded_fill(explicit) == 7.0
    assert (accelerate_like / "model.safetensors").read_bytes() == b"not hasten's"
    assert os.listdir(folder / "checkpoint_2") == ["eval.json"], "only the checkpoint's own files go"
    assert not (folder / "checkpoint_3").exists()
    assert [n for n, _ in complete_checkpoints(tmp_path)] == [0, 1, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_a_folder_per_process_on_two_processes(tmp_path, mode):
    out = torchrun(SCRIPTS / "check_save_folders.py", mode, str(tmp_path), timeout=400).stdout
    expected = "per-process folders ok" if mode == "replicated" else "sharded different folders refused at once"
    assert f"rank 0: {expected}" in out and f"rank 1: {expected}" in out, out


def test_back_to_back_sharded_attendances_never_race():
    """300 attendances in a row with no collective between them (two sharded saves into one folder at one step,
    at their tightest): before each save had keys of its own, a process could pass on the other's stale key, or
    read a key the other was deleting, and fail the next save (a false folder mismatch, or a 60 s wait)."""
    out = torchrun(SCRIPTS / "attendance_stress.py", "300", timeout=120).stdout
    for rank in (0, 1):
        assert f"rank {rank}: 300 attendances met; the mismatch failed" in out, out


@pytest.mark.slow
def test_sigkill_during_saves_into_a_folder_with_user_files(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "crash_saver.py"), str(tmp_path), "10", "--shared"],
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"(\d+) killed during the save, \d+ completed, every load whole", out.stdout)
    assert found and int(found.group(1)) == 10, out.stdout
