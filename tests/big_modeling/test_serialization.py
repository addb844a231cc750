"""Saving model weights (sharded safetensors, tied weights, atomic files) and loading them back safely."""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import warnings

import pytest
import safetensors.torch
import torch
from helpers import ROOT, SCRIPTS
from torch import nn

from hasten.big_modeling import init_empty_weights
from hasten.big_modeling.serialization import (
    load,
    load_checkpoint_in_model,
    load_state_dict,
    parse_size,
    save,
    save_model_weights,
    verify_safetensors_file,
)
from hasten.errors import CheckpointError, ConfigError
from hasten.runtime.fileio import atomic_write


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TiedLM(nn.Module):
    """A small language model whose output layer reuses the embedding (tied weights)."""

    def __init__(self, vocab: int = 50, width: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        expected = model(ids)
    return model, ids, expected


def _empty_model() -> TiedLM:
    with init_empty_weights():
        return TiedLM()


# ------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("3kib", 3 * 1024),
        ("5Gb", 5 * 10**9 // 8),
        ("123", 123),
        (4096, 4096),
        (" 2 TB ", 2 * 10**12),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10 parsecs", "GB", "-1GB", -5, True, "1.2.3MB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="Invalid size"):
        parse_size(bad)


# ------------------------------------------------------------------------------------- atomic files


def test_atomic_write_keeps_old_file_when_writer_fails(tmp_path):
    target = tmp_path / "weights.bin"
    atomic_write(target, lambda path: path.write_bytes(b"old"))

    def broken(path: pathlib.Path):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


# ------------------------------------------------------------------------------------------- saving


def test_single_file_save_is_plain_safetensors(tmp_path, trained):
    model, _, _ = trained
    written = save_model_weights(model.state_dict(), tmp_path)
    assert written == [tmp_path / "model.safetensors"]
    loaded = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "head.weight" not in loaded  # tied alias written once
    for name, tensor in loaded.items():
        assert torch.equal(tensor, model.state_dict()[name])
    header = verify_safetensors_file(tmp_path / "model.safetensors")
    assert header.metadata["format"] == "pt"
    assert json.loads(header.metadata["hasten_tied_weights"]) == {"head.weight": "embed.weight"}


def test_sharded_save_with_tied_weights_reloads_equal(tmp_path, trained):
    model, ids, expected = trained
    written = save_model_weights(model.state_dict(), tmp_path, max_shard_size="2KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    count = len(shards)
    assert count > 2
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert written[-1] == tmp_path / "model.safetensors.index.json"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["hasten_tied_weights"] == {"head.weight": "embed.weight"}
    for shard in shards:  # a shard only exceeds the limit when it holds one tensor
        names = safetensors.torch.load_file(tmp_path / shard)
        assert len(names) == 1 or sum(t.numel() * t.element_size() for t in names.values()) <= 2000

    fresh = _empty_model()
    load_checkpoint_in_model(fresh, tmp_path, device_map={"": "cpu"}, strict=True)
    assert fresh.head.weight is fresh.embed.weight
    with torch.no_grad():
        assert torch.equal(fresh(ids), expected)

    direct = TiedLM()
    state = {}
    for shard in shards:
        state.update(safetensors.torch.load_file(tmp_path / shard))
    result = direct.load_state_dict(state, strict=False)
    assert result.missing_keys == ["head.weight"] and result.unexpected_keys == []
    with torch.no_grad():
        assert torch.equal(direct(ids), expected)


def test_load_via_index_file_and_single_file(tmp_path, trained):
    model, ids, expected = trained
    save_model_weights(model.state_dict(), tmp_path / "sharded", max_shard_size="4KB")
    save_model_weights(model.state_dict(), tmp_path / "single")
    for checkpoint in (
        tmp_path / "sharded" / "model.safetensors.index.json",
        tmp_path / "single" / "model.safetensors",
    ):
        fresh = _empty_model()
        load_checkpoint_in_model(fresh, checkpoint, strict=True)
        with torch.no_grad():
            assert torch.equal(fresh(ids), expected)


def test_resave_with_other_shard_count_removes_stale_files(tmp_path, trained):
    model, ids, expected = trained
    save_model_weights(model.state_dict(), tmp_path, max_shard_size="2KB")
    (tmp_path / "notes.txt").write_text("keep me")
    save_model_weights(model.state_dict(), tmp_path, max_shard_size="6KB")
    names = sorted(p.name for p in tmp_path.iterdir())
    count = len([n for n in names if n.startswith("model-")])
    assert names == sorted(
        ["notes.txt", "model.safetensors.index.json"]
        + [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    save_model_weights(model.state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    fresh = _empty_model()
    load_checkpoint_in_model(fresh, tmp_path, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(ids), expected)


def test_bin_format_round_trip(tmp_path, trained):
    model, ids, expected = trained
    save_model_weights(model.state_dict(), tmp_path / "one", safe_serialization=False)
    save_model_weights(model.state_dict(), tmp_path / "many", max_shard_size="2KB", safe_serialization=False)
    assert (tmp_path / "one" / "pytorch_model.bin").is_file()
    assert (tmp_path / "many" / "pytorch_model.bin.index.json").is_file()
    for folder in ("one", "many"):
        fresh = _empty_model()
        load_checkpoint_in_model(fresh, tmp_path / folder, strict=True)
        assert fresh.head.weight is fresh.embed.weight
        with torch.no_grad():
            assert torch.equal(fresh(ids), expected)


def test_save_refuses_meta_tensors(tmp_path):
    with pytest.raises(CheckpointError, match="'embed.weight': it is on the meta device"):
        save_model_weights(_empty_model().state_dict(), tmp_path)


def test_save_model_weights_rejects_a_file_as_directory(tmp_path, trained):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        save_model_weights(trained[0].state_dict(), tmp_path / "file")


def test_views_of_one_storage_are_saved_separately(tmp_path):
    base = torch.arange(100_000, dtype=torch.float32)
    state = {"first": base[:6], "second": base[6:12].view(2, 3), "again": base[:6]}
    save_model_weights(state, tmp_path, safe_serialization=True)
    save_model_weights(state, tmp_path / "bin", safe_serialization=False)
    for loaded in (
        load_state_dict(tmp_path / "model.safetensors"),
        load_state_dict(tmp_path / "bin" / "pytorch_model.bin"),
    ):
        assert torch.equal(loaded["first"], base[:6]) and torch.equal(loaded["second"], base[6:12].view(2, 3))
        assert loaded["again"].data_ptr() == loaded["first"].data_ptr()
    assert (tmp_path / "bin" / "pytorch_model.bin").stat().st_size < 10_000  # not the 400 kB storage


# ------------------------------------------------------------------------------------- save / load


def test_save_and_load_tensor_dict_as_safetensors(tmp_path):
    shared = torch.randn(4, 4)
    save(
        {"a": shared, "b": shared, "c": torch.ones(2, dtype=torch.int64)},
        tmp_path / "x.safetensors",
        safe_serialization=True,
    )
    loaded = load(tmp_path / "x.safetensors")
    assert torch.equal(loaded["a"], shared) and loaded["b"] is loaded["a"] and loaded["c"].dtype == torch.int64


def test_save_torch_objects_and_refuse_non_tensors_for_safetensors(tmp_path):
    save({"step": 3, "values": [1.0, 2.0]}, tmp_path / "state.pt")
    assert load(tmp_path / "state.pt") == {"step": 3, "values": [1.0, 2.0]}
    with pytest.raises(ConfigError, match="saves a dict of tensors, got list"):
        save([torch.ones(1)], tmp_path / "y.safetensors", safe_serialization=True)


# ----------------------------------------------------------------------------------- damaged files


def test_truncated_safetensors_is_named(tmp_path, trained):
    save_model_weights(trained[0].state_dict(), tmp_path, max_shard_size="4KB")
    victim = tmp_path / "model-00002-of-00003.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00003\.safetensors is not a valid safetensors file.*holds only"
    ):
        load_checkpoint_in_model(_empty_model(), tmp_path)
    victim.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="shorter than the 8-byte header"):
        verify_safetensors_file(victim)
    victim.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b" " * 10)
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load_state_dict(victim)


def test_missing_shard_and_mixed_saves_are_reported(tmp_path, trained):
    model = trained[0]
    save_model_weights(model.state_dict(), tmp_path / "a", max_shard_size="4KB")
    save_model_weights(model.state_dict(), tmp_path / "b", max_shard_size="4KB")
    shard = "model-00001-of-00003.safetensors"
    (tmp_path / "a" / shard).replace(tmp_path / "a.bak")
    with pytest.raises(CheckpointError, match=f"shard files that are missing: {shard}"):
        load_checkpoint_in_model(_empty_model(), tmp_path / "a")
    (tmp_path / "b" / shard).replace(tmp_path / "a" / shard)
    with pytest.raises(CheckpointError, match="belongs to a different save"):
        load_checkpoint_in_model(_empty_model(), tmp_path / "a")


def test_folder_without_weights_lists_its_contents(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no model weights hasten recognises.*found: config\.json"):
        load_checkpoint_in_model(_empty_model(), tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_in_model(_empty_model(), tmp_path / "nowhere.safetensors")


class _Payload:
    """Creates a file when unpickled: what a malicious checkpoint would do."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"embed.weight": torch.zeros(50, 16), "extra": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"Refused to load .*pytorch_model\.bin.*weights_only=True.*safetensors"):
        load_checkpoint_in_model(_empty_model(), folder)
    with pytest.raises(CheckpointError, match="Refused to load"):
        load(folder / "pytorch_model.bin")
    assert not marker.exists()


def test_truncated_bin_is_a_checkpoint_error(tmp_path):
    torch.save({"w": torch.zeros(100)}, tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[:200])
    with pytest.raises(CheckpointError, match="could not be read as a PyTorch checkpoint"):
        load_state_dict(tmp_path / "pytorch_model.bin")


# --------------------------------------------------------------------------------- load semantics


@contextlib.contextmanager
def caplog_at_warning():
    """The log records of hasten's big-model loggers at WARNING and above, inside the block."""
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("hasten.big_modeling")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_missing_and_unexpected_keys(tmp_path, trained):
    state = dict(trained[0].state_dict())
    del state["blocks.0.fc1.bias"]
    state["stray.weight"] = torch.zeros(1)
    save_model_weights(state, tmp_path)
    with pytest.raises(
        CheckpointError, match=r"has 'stray\.weight', which TiedLM does not have \(strict=True\)"
    ) as raised:
        load_checkpoint_in_model(_empty_model(), tmp_path, strict=True)
    assert isinstance(raised.value, (RuntimeError, ValueError, AttributeError))  # each type Accelerate may raise there
    with caplog_at_warning() as records:
        load_checkpoint_in_model(_empty_model(), tmp_path)
    unused = [r.getMessage() for r in records if "stray.weight" in r.getMessage()]
    assert unused and "were not used when initializing TiedLM" in unused[0]  # the words transformers' users grep for
    state.pop("stray.weight")
    save_model_weights(state, tmp_path)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors of TiedLM \(strict=True\): blocks\.0\.fc1\.bias"):
        load_checkpoint_in_model(_empty_model(), tmp_path, device_map={"": "cpu"}, strict=True)
    with caplog_at_warning() as records:
        load_checkpoint_in_model(_empty_model(), tmp_path)
    assert any("blocks.0.fc1.bias" in record.getMessage() for record in records)


def test_tied_alias_is_not_missing(tmp_path, trained):
    save_model_weights(trained[0].state_dict(), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint_in_model(_empty_model(), tmp_path)


def test_loading_into_a_real_model_copies_in_place(tmp_path, trained):
    model, ids, expected = trained
    save_model_weights(model.state_dict(), tmp_path)
    target = TiedLM()
    params = {name: id(p) for name, p in target.named_parameters()}
    load_checkpoint_in_model(target, tmp_path, strict=True)
    assert params == {name: id(p) for name, p in target.named_parameters()}
    with torch.no_grad():
        assert torch.equal(target(ids), expected)


def test_dtype_and_keep_in_fp32_modules(tmp_path, trained):
    save_model_weights(trained[0].state_dict(), tmp_path)
    model = _empty_model()
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"}, dtype="float16", keep_in_fp32_modules=["norm"])
    assert model.blocks[0].fc1.weight.dtype == torch.float16
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, trained[0].embed.weight.to(torch.float16))
    assert model.head.weight is model.embed.weight
    model = _empty_model()  # as in Accelerate, keep_in_fp32_modules applies to float16 only
    load_checkpoint_in_model(model, tmp_path, device_map={"": "cpu"}, dtype="bfloat16", keep_in_fp32_modules=["norm"])
    assert model.norm.weight.dtype == torch.bfloat16


def test_load_state_dict_with_device_map(tmp_path, trained):
    save_model_weights(trained[0].state_dict(), tmp_path)
    state = load_state_dict(
        tmp_path / "model.safetensors", device_map={"embed": "cpu", "blocks": "disk", "norm": "meta", "head": "cpu"}
    )
    assert state["blocks.0.fc1.weight"].device.type == "cpu"  # disk entries are read on the CPU, as in Accelerate
    assert state["norm.weight"].device.type == "meta"
    assert state["head.weight"] is state["embed.weight"]


def test_disk_map_needs_offload_folder(tmp_path, trained):
    save_model_weights(trained[0].state_dict(), tmp_path)
    with pytest.raises(ConfigError, match="puts modules on 'disk' but no offload_folder"):
        load_checkpoint_in_model(_empty_model(), tmp_path, device_map={"": "disk"})


# ------------------------------------------------------------------------------------ distributed


@pytest.mark.slow
def test_distributed_loading_two_processes(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = SCRIPTS / "distributed_loading.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        str(script),
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("all checks passed") == 2
