"""Checkpoint I/O: format versions, loads that change nothing unless the whole checkpoint is good,
saves that fail cleanly (full disk, read-only folder), in-place loads and asynchronous saves."""

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, requires, torchrun
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.checkpointing import MANIFEST, complete_checkpoints, wait_for_pending_save
from hasten.errors import CheckpointError
from hasten.settings.sizes import format_bytes
from hasten.state import reset_state
from hasten.utils import ProjectConfiguration, set_seed


def build(acc, outputs=1):
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, outputs))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    dl = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)), batch_size=4, shuffle=True)
    return acc.prepare(model, opt, dl, sched)


def steps(acc, model, opt, dl, sched, count):
    for _, (x, y) in zip(range(count), dl):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()


def snapshot(model, opt, sched, dl):
    """Everything a load may change, as bytes (bitwise comparison)."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        tensors.update({f"opt.{i}.{k}": v for k, v in state.items()})
    return {
        "tensors": {
            k: v.detach().clone().view(torch.uint8) if v.dim() else v.detach().clone() for k, v in tensors.items()
        },
        "sched": json.dumps(sched.state_dict(), default=str),
        "dl": json.dumps(dl.state_dict(), default=str),
        "torch_rng": torch.get_rng_state().clone(),
        "py_rng": random.getstate(),
        "np_rng": str(np.random.get_state()),
    }


def same(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    assert a["sched"] == b["sched"] and a["dl"] == b["dl"] and a["py_rng"] == b["py_rng"] and a["np_rng"] == b["np_rng"]
    assert torch.equal(a["torch_rng"], b["torch_rng"])


def trained_checkpoint(tmp_path):
    acc = Accelerator()
    objs = build(acc)
    steps(acc, *objs, 3)
    acc.save_state(tmp_path / "c")
    steps(acc, *objs, 2)  # the live state now differs from the checkpoint
    return acc, objs


@pytest.mark.parametrize("threads", [1, 3])
def test_load_fills_live_tensors_in_place_and_restores_exactly(tmp_path, monkeypatch, threads):
    from hasten.checkpointing import files

    monkeypatch.setattr(files, "_READ_THREADS", threads)  # a many-core machine reads in pieces on several threads
    monkeypatch.setattr(files, "_READ_PIECE", 64)
    acc, (model, opt, dl, sched) = trained_checkpoint(tmp_path)
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    state_ptrs = {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()}
    acc.load_state(tmp_path / "c")
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    assert {(id(p), k): v.data_ptr() for p, s in opt.state.items() for k, v in s.items()} == state_ptrs
    saved = CheckpointTensors(tmp_path / "c")
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved.model[name])
    assert any(
        v.numel() * v.element_size() > 64 for v in model.state_dict().values()
    )  # some tensors were read in pieces


class CheckpointTensors:
    def __init__(self, path):
        from safetensors.torch import load_file

        self.model = load_file(path / "model.safetensors")


@pytest.mark.parametrize(
    "victim",
    [
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "scheduler.json",
        "dataloaders.json",
        "random_states_0.safetensors",
        "random_states_0.json",
    ],
)
def test_one_flipped_byte_in_any_file_is_named_and_changes_nothing(tmp_path, victim):
    acc, objs = trained_checkpoint(tmp_path)
    path = tmp_path / "c" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    before = snapshot(*objs[:2], objs[3], objs[2])
    with pytest.raises(CheckpointError, match=rf"{victim} is corrupt: its checksum does not match"):
        acc.load_state(tmp_path / "c")
    same(before, snapshot(*objs[:2], objs[3], objs[2]))


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_model_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    acc, objs = trained_checkpoint(tmp_path)
    reset_state()
    other = Accelerator()
    model, opt, dl, sched = build(other, outputs=2)
    steps(other, model, opt, dl, sched, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"does not fit Sequential \(shape differs: 2.bias \(saved \[1\], model \[2\]\)"
    ):
        other.load_state(tmp_path / "c")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sched.state_dict()["last_epoch"] == 1 and dl.state_dict() != {}


def as_format_1(folder):
    """Rewrite a checkpoint's manifest as hasten's format 1 wrote it (crc32 per file; the files themselves are
    unchanged)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["format_version"] = 1
    for name, record in manifest["files"].items():
        manifest["files"][name] = {"size": record["size"], "crc32": f"{zlib.crc32((folder / name).read_bytes()):08x}"}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_format_1_checkpoints_still_load_and_are_verified(tmp_path):
    acc, objs = trained_checkpoint(tmp_path)
    as_format_1(tmp_path / "c")
    acc.load_state(tmp_path / "c")
    expected = CheckpointTensors(tmp_path / "c").model
    assert all(torch.equal(v, expected[k]) for k, v in objs[0].state_dict().items())
    path = tmp_path / "c" / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.safetensors is corrupt"):
        acc.load_state(tmp_path / "c")


def as_format_2(folder):
    """Rewrite a checkpoint's manifest as hasten's format 2 wrote it (one xxh3-64 per file; the files are unchanged)."""
    import xxhash

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["format_version"] = 2
    del manifest["piece_bytes"]
    for name, record in manifest["files"].items():
        manifest["files"][name] = {
            "size": record["size"],
            "xxh3_64": xxhash.xxh3_64((folder / name).read_bytes()).hexdigest(),
        }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def test_format_2_checkpoints_still_load_and_are_verified(tmp_path):
    acc, objs = trained_checkpoint(tmp_path)
    as_format_2(tmp_path / "c")
    acc.load_state(tmp_path / "c")
    expected = CheckpointTensors(tmp_path / "c").model
    assert all(torch.equal(v, expected[k]) for k, v in objs[0].state_dict().items())
    path = tmp_path / "c" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        acc.load_state(tmp_path / "c")


def test_new_checkpoints_record_a_checksum_per_piece_and_a_flip_in_any_piece_is_found(tmp_path, monkeypatch):
    from hasten.checkpointing import integrity

    monkeypatch.setattr(integrity, "PIECE_BYTES", 64)  # small pieces: every file of this small checkpoint has several
    acc, objs = trained_checkpoint(tmp_path)
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert manifest["format_version"] == 3 and manifest["piece_bytes"] == 64
    for name, record in manifest["files"].items():
        assert set(record) == {"size", "xxh3_64"} and len(record["xxh3_64"]) == max(1, -(-record["size"] // 64)), name
    path = tmp_path / "c" / "optimizer.safetensors"
    original = path.read_bytes()
    for position in (0, 64, 65, len(original) // 2, len(original) - 1):  # first, second, middle and last piece
        data = bytearray(original)
        data[position] ^= 0x04
        path.write_bytes(bytes(data))
        before = snapshot(*objs[:2], objs[3], objs[2])
        with pytest.raises(CheckpointError, match="optimizer.safetensors is corrupt"):
            acc.load_state(tmp_path / "c")
        same(before, snapshot(*objs[:2], objs[3], objs[2]))
    path.write_bytes(original)
    acc.load_state(tmp_path / "c")


@contextlib.contextmanager
def small_tmpfs(path, size, read_only=False):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    assert mounted.returncode == 0, f"mount failed (the test must require tmpfs): {mounted.stderr.decode().strip()}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@requires("tmpfs")
def test_full_disk_removes_the_partial_folder_and_says_what_is_needed(tmp_path):
    acc = Accelerator()
    model = torch.nn.Linear(256, 256)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    with small_tmpfs(tmp_path / "disk", "300k") as disk:
        acc.save_state(disk / "small")  # ~260 KB fits
        acc.backward(model(torch.randn(2, 256)).sum())
        opt.step()  # AdamW state: three times the model, no longer fits
        with pytest.raises(CheckpointError) as caught:
            acc.save_state(disk / "big")
        message = str(caught.value)
        acc.save_state(tmp_path / "roomy")  # the same state where it fits: what the full disk needed
        needed = sum(
            record["size"] for record in json.loads((tmp_path / "roomy" / MANIFEST).read_text())["files"].values()
        )
        assert "\n" not in message
        expected = (
            rf"Could not save the checkpoint {disk / 'big'}: no space left on the device \(writing .*\)\. It needs "
            rf"{re.escape(format_bytes(needed))}; \d+\.\d+ KB is free there"
        )
        assert re.search(expected, message), message
        assert sorted(os.listdir(disk)) == ["small"]
        reset_state()
        other = Accelerator()  # a new run resumes from the earlier checkpoint, untouched by the failed save
        fresh = torch.nn.Linear(256, 256)
        other.prepare(fresh, torch.optim.AdamW(fresh.parameters()))
        other.load_state(disk / "small")


@requires("tmpfs")
def test_read_only_folder_is_one_clear_line(tmp_path):
    acc = Accelerator()
    build(acc)
    with small_tmpfs(tmp_path / "ro", "1m") as folder:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        with pytest.raises(
            CheckpointError,
            match=(
                rf"Could not save the checkpoint {folder / 'c'}: .* is not writable \(Read-only file system\)\. Save "
                r"to a writable folder"
            ),
        ):
            acc.save_state(folder / "c")
    with pytest.raises(CheckpointError, match=r"Checkpoint folder .*missing does not exist\.") as missing:
        acc.load_state(tmp_path / "missing")
    assert isinstance(missing.value, ValueError), "Accelerate raises ValueError for a missing folder"


def test_async_save_returns_a_snapshot_and_publishes_it(tmp_path):
    acc = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True, async_save=True
        )
    )
    model, opt, dl, sched = build(acc)
    steps(acc, model, opt, dl, sched, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    path = acc.save_state()
    steps(acc, model, opt, dl, sched, 3)  # changes the live weights while the files are written
    assert wait_for_pending_save() == tmp_path / "checkpoints" / "checkpoint_0"
    assert str(path).endswith("checkpoint_0")
    assert [n for n, _ in complete_checkpoints(tmp_path)] == [0]
    acc.load_state()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


@requires("tmpfs")
def test_async_save_errors_come_back_at_the_next_wait_point(tmp_path):
    acc = Accelerator()
    model = torch.nn.Linear(256, 256)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.backward(model(torch.randn(2, 256)).sum())
    opt.step()
    with small_tmpfs(tmp_path / "disk", "300k") as disk:
        acc.save_state(disk / "big", async_save=True)  # returns: the error comes with the next wait
        with pytest.raises(CheckpointError, match=r"no space left on the device .* It needs 7\d\d\.\d\d KB"):
            acc.end_training()
        assert os.listdir(disk) == []


@pytest.mark.slow
def test_sigkill_during_background_writes_never_leaves_an_unloadable_checkpoint(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "crash_saver.py"), str(tmp_path), "20", "--async"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"(\d+) killed during the save", out.stdout)
    assert found and int(found.group(1)) >= 20, out.stdout


@pytest.mark.slow
def test_async_save_on_two_processes_publishes_every_rank_files_once(tmp_path):
    out = torchrun(SCRIPTS / "async_save_two_processes.py", str(tmp_path)).stdout
    assert "rank 0: async save ok" in out and "rank 1: async save ok" in out, out
    assert [n for n, _ in complete_checkpoints(tmp_path)] == [0]


def _async_saving_step(tmp_path, project=None, released=None):
    """An async save of a trained model, then one more training step; returns what the step saw on disk
    (sizes of the model's and the optimizer's files when the step ran) and the sizes once written.
    ``released``: an event the test sets after the step (the background writes may be held until then)."""
    acc = Accelerator(project_config=project)
    model = torch.nn.Linear(2048, 2048)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.backward(model(torch.randn(2, 2048)).sum())
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def on_disk_when_stepping(optimizer, args, kwargs):
        folder = next(p for p in (tmp_path / ".c.partial", tmp_path / "c") if p.is_dir())
        seen.append(
            {
                name: (folder / name).stat().st_size if (folder / name).exists() else None
                for name in ("model.safetensors", "optimizer.safetensors")
            }
        )

    acc.save_state(tmp_path / "c", async_save=True)
    handle = opt.optimizer.register_step_pre_hook(on_disk_when_stepping)  # runs after hasten's gate
    acc.backward(model(torch.randn(2, 2048)).sum())
    opt.step()  # changes every weight: the checkpoint must still hold the values before it
    handle.remove()
    if released is not None:
        released.set()
    wait_for_pending_save()
    acc.load_state(tmp_path / "c")
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
    return seen, {
        name: (tmp_path / "c" / name).stat().st_size for name in ("model.safetensors", "optimizer.safetensors")
    }


def test_an_async_save_stages_the_state_and_the_next_step_does_not_wait_for_the_write(tmp_path, monkeypatch):
    from hasten.checkpointing import CheckpointWriter, staging_memory
    from hasten.checkpointing.staging import _buffer

    released, real_write = threading.Event(), CheckpointWriter.write_pending

    def held_write(self):
        released.wait(60)
        real_write(self)

    monkeypatch.setattr(CheckpointWriter, "write_pending", held_write)
    seen, _ = _async_saving_step(tmp_path, released=released)
    assert seen == [{"model.safetensors": None, "optimizer.safetensors": None}], (
        "the step ran while the writes were held"
    )
    monkeypatch.setattr(CheckpointWriter, "write_pending", real_write)
    held, address = staging_memory(), _buffer.memory.data_ptr()
    params = 2048 * 2048 + 2048
    assert held >= 3 * 4 * params  # the weights and AdamW's two moments
    reset_state()
    (tmp_path / "c").rename(tmp_path / "first")
    _async_saving_step(tmp_path)
    assert staging_memory() == held and _buffer.memory.data_ptr() == address, "the next save reuses the buffer"
    Accelerator().end_training()
    assert staging_memory() == 0, "end_training frees the staging memory"


@requires("linux thread scheduling")
def test_the_background_writes_run_at_the_training_process_own_priority(tmp_path, monkeypatch):
    from hasten.checkpointing import CheckpointWriter

    seen, real_write = {}, CheckpointWriter.write_pending

    def observed_write(self):
        thread = threading.get_native_id()
        seen["writer"] = (os.sched_getscheduler(thread), os.getpriority(os.PRIO_PROCESS, thread))
        real_write(self)

    monkeypatch.setattr(CheckpointWriter, "write_pending", observed_write)
    _async_saving_step(tmp_path)
    wait_for_pending_save()
    training = (os.sched_getscheduler(threading.get_native_id()), os.getpriority(os.PRIO_PROCESS, 0))
    assert seen == {"writer": training}, (
        "the writes must run at the priority a synchronous save runs at: in the idle class (or at a higher "
        "niceness) they stalled for minutes beside busy processes"
    )
    Accelerator().end_training()  # frees the staging memory


@pytest.mark.slow
def test_an_async_save_beside_busy_processes_completes_and_loads_back(tmp_path):
    """One CPU-bound process per core beside the training loop (DataLoader workers doing CPU work): the save
    completes while training goes on, and loads back the state it captured."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        acc = Accelerator()
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        for _ in range(2):
            acc.backward(model(torch.randn(4, 1024)).square().mean())
            opt.step()
            opt.zero_grad()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        acc.save_state(tmp_path / "c", async_save=True)
        for _ in range(3):
            acc.backward(model(torch.randn(4, 1024)).square().mean())
            opt.step()
            opt.zero_grad()
        wait_for_pending_save()
    finally:
        for process in busy:
            process.kill()
            process.wait()
    acc.load_state(tmp_path / "c")
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
    acc.end_training()


@requires("linux thread /proc", "torch thread pool")
def test_the_staging_copy_starts_no_thread_pool_beside_training(tmp_path, monkeypatch):
    from hasten.checkpointing import CheckpointWriter

    threads, real_copy = {}, CheckpointWriter.copy_staged

    def observed_copy(self):
        threads["before"] = len(os.listdir("/proc/self/task"))
        real_copy(self)
        threads["after"] = len(os.listdir("/proc/self/task"))

    monkeypatch.setattr(CheckpointWriter, "copy_staged", observed_copy)
    _async_saving_step(tmp_path)
    assert threads["after"] == threads["before"], (
        "the background copy started threads of its own (an OpenMP team at the normal priority, which took cores "
        "from the training steps after the save)"
    )
    Accelerator().end_training()


def test_copy_bytes_copies_contiguous_strided_empty_and_lazy_views_exactly():
    from hasten.checkpointing.staging import copy_bytes

    sources = [
        torch.randn(3, 5),
        torch.randn(5, 3).t(),
        torch.arange(7, dtype=torch.int16)[1:],
        torch.ones(0),
        torch.randn(4, dtype=torch.complex64).conj(),  # a lazy conjugate: its bytes are not its values
        torch._neg_view(torch.randn(4)),  # a lazy negation, contiguous
    ]
    for source in sources:
        destination = torch.empty(source.shape, dtype=source.dtype)
        copy_bytes(destination, source)
        assert torch.equal(destination, source)


def test_with_no_staging_memory_the_next_optimizer_step_waits_until_the_weights_are_written(tmp_path):
    from hasten.checkpointing import staging_memory

    seen, written = _async_saving_step(tmp_path, ProjectConfiguration(async_staging_limit=0))
    assert seen == [written] and staging_memory() == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_failing_on_one_process_fails_the_save_on_every_process(tmp_path, mode):
    out = torchrun(
        SCRIPTS / "save_failure_two_processes.py", str(tmp_path), *(["--async"] if mode == "async" else [])
    ).stdout
    found = dict(re.findall(r"rank (\d): failed cleanly: (.*?untouched\.)", out))  # the two ranks' lines may interleave
    assert set(found) == {"0", "1"} and found["0"] == found["1"], out
    assert re.fullmatch(
        r"Could not save the checkpoint \S*/bad: Is a directory \(writing "
        r"\S*/\.bad\.partial/random_states_1\.safetensors\)\. .*",
        found["0"],
    ), out
    hooked = dict(re.findall(r"rank (\d): hook failure: (.*?untouched\.)", out))
    assert set(hooked) == {"0", "1"} and hooked["0"] == hooked["1"], out
    assert "a save hook on process 1 failed (ValueError: disk quota of the side files)" in hooked["0"], out
    late = re.search(r"rank 1: late hook failure: (.*)", out).group(1)
    assert "A save hook on process 1 failed (ValueError: disk quota of the side files)" in late, out
    assert "wrote without waiting for this process: it holds everything but" in late, out
