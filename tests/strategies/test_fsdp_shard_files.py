"""Reading a sharded (DCP) checkpoint whole straight from its files (strategies/fsdp/shard_files.py), in one process.

Whatever a tensor is (dtype, shape, a scalar, empty, saved as a non-contiguous view), what is read equals what
``torch.distributed.checkpoint.load`` gives; an item whose bytes cannot go straight into place (a chunk that is not
contiguous in the full tensor) is decoded and copied; a file cut short is refused naming it, and a chunk that no file
holds is refused before anything is read. The launches that read FSDP2 and FSDP x TP shards whole are in
test_resume_matrix.py, test_fsdp_engine_change.py and test_parallelism.py (merge-weights).
"""

import io
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hasten.errors import CheckpointError
from hasten.strategies.fsdp import shard_files
from hasten.strategies.fsdp.shard_files import read_full_tensors


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(6, 5, generator=generator)
    return {
        "model.weight": matrix,
        "model.half": torch.randn(4, 3, generator=generator).half(),
        "model.brain": torch.randn(2, 7, generator=generator).to(torch.bfloat16),
        "model.counts": torch.randint(0, 1000, (9,), generator=generator),
        "model.mask": torch.rand(3, 3, generator=generator) > 0.5,
        "model.step": torch.tensor(7.0),
        "model.empty": torch.empty(0, 4),
        "model.transposed": torch.randn(5, 6, generator=generator).t(),  # saved as a view with strides (1, 5)
        "model.narrow": torch.randn(4, 4, 2, generator=generator)[:, 1:3],  # DCP clones it: contiguous
    }


def _save(folder, tensors) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)


def _dcp_load(folder, like) -> dict[str, torch.Tensor]:
    state = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in like.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def test_every_tensor_reads_as_torch_distributed_checkpoint_loads_it(tmp_path):
    tensors = _tensors()
    _save(tmp_path / "shards", tensors)
    read = read_full_tensors(tmp_path / "shards")
    expected = _dcp_load(tmp_path / "shards", tensors)
    assert read.keys() == tensors.keys()
    for key, value in expected.items():
        assert read[key].dtype == value.dtype and torch.equal(read[key], value), key
        assert torch.equal(read[key], tensors[key]), key


def _item(tmp_path, value, padding: int = 13):
    """A file holding ``value`` saved by ``torch.save`` after ``padding`` bytes, as a DCP item is, and its place."""
    blob = io.BytesIO()
    torch.save(value, blob)
    path = tmp_path / "item.distcp"
    path.write_bytes(b"x" * padding + blob.getvalue())
    return path, SimpleNamespace(offset=padding, length=len(blob.getvalue()), transform_descriptors=None)


def test_a_chunk_that_is_not_contiguous_in_the_full_tensor_is_decoded_and_copied(tmp_path):
    full = torch.zeros(4, 6)
    chunk = torch.arange(8.0).reshape(4, 2)
    path, info = _item(tmp_path, chunk)
    region = full[:, 2:4]
    with open(path, "rb", buffering=0) as handle:
        assert shard_files._storage_start(shard_files._Window(handle, info.offset, info.length), region) is None
        shard_files._read_item(handle, info, region, "item")
    assert torch.equal(full[:, 2:4], chunk) and full[:, :2].eq(0).all() and full[:, 4:].eq(0).all()


def test_a_contiguous_chunk_is_read_straight_into_its_place(tmp_path):
    full = torch.zeros(6, 2)
    chunk = torch.arange(6.0).reshape(3, 2)
    path, info = _item(tmp_path, chunk)
    region = full[3:]
    with open(path, "rb", buffering=0) as handle:
        assert shard_files._storage_start(shard_files._Window(handle, info.offset, info.length), region) is not None
        shard_files._read_item(handle, info, region, "item")
    assert torch.equal(full[3:], chunk) and full[:3].eq(0).all()


def test_a_file_cut_short_is_refused_naming_it(tmp_path):
    tensors = {"model.weight": torch.randn(64, 64)}
    _save(tmp_path / "shards", tensors)
    (victim,) = (tmp_path / "shards").glob("*.distcp")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        read_full_tensors(tmp_path / "shards")


def test_a_chunk_no_file_holds_is_refused_before_anything_is_read(tmp_path):
    tensors = {"model.weight": torch.randn(4, 4)}
    _save(tmp_path / "shards", tensors)
    meta = shard_files._reader(tmp_path / "shards").read_metadata().state_dict_metadata
    with pytest.raises(CheckpointError, match="model.weight at offsets"):
        shard_files._check_complete(tmp_path / "shards", meta, per_file={})


def test_a_missing_file_is_refused_naming_it(tmp_path):
    _save(tmp_path / "shards", {"model.weight": torch.randn(4, 4)})
    (victim,) = (tmp_path / "shards").glob("*.distcp")
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name} is missing"):
        read_full_tensors(tmp_path / "shards")


def test_an_item_the_metadata_does_not_describe_is_refused(tmp_path):
    _save(tmp_path / "shards", {"model.weight": torch.randn(4, 4)})
    path = tmp_path / "shards" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file
    (index,) = metadata.storage_data
    metadata.storage_data[type(index)(index.fqn, torch.Size([2, 0]), 1)] = metadata.storage_data[index]
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"model.weight at offsets \(2, 0\) that its metadata does not list"):
        read_full_tensors(tmp_path / "shards")


def test_an_item_that_is_not_one_tensor_is_refused_naming_it(tmp_path):
    path, info = _item(tmp_path, {"weight": torch.ones(2, 2)})
    region = torch.zeros(2, 2)
    with open(path, "rb", buffering=0) as handle:
        assert shard_files._storage_start(shard_files._Window(handle, info.offset, info.length), region) is None
        with pytest.raises(CheckpointError, match="the item holds dict, not a tensor of shape"):
            shard_files._read_item(handle, info, region, "the item")
    assert region.eq(0).all()
