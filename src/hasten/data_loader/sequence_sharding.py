"""The loader adapter of hasten's own sequence parallelism (``sp_backend="accelerate"``): the ``sp`` ranks read the
same batches (the prepared loader shards over the data-parallel ranks only) and each keeps its part of every
sequence.

A batch is a mapping with ``input_ids`` (``[batch, seq, ...]``); it comes out as DeepSpeed's adapter gives it, so one
training loop runs under either backend: ``position_ids`` added where missing (``0..seq-1`` on each row: sequences
that are not packed), ``labels`` replaced by ``shift_labels`` (the next token's label, ``-100`` after the last), and
every tensor whose second dimension is the sequence cut to the rank's part (``seq / sp`` tokens, rank ``r`` holding
part ``r``). Other entries pass unchanged. While the model is in evaluation mode every rank gets whole sequences
(the attention then runs without splitting, as Accelerate's ``disable_in_eval``): the outputs are those of a run
without sequence parallelism, the same on the ``sp`` ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import HastenError


class SequenceShardingError(HastenError, ValueError):
    """A batch that sequence parallelism cannot split (not a mapping with ``input_ids``, or a length that the ``sp``
    ranks do not divide)."""


def split_batch(batch, rank: int, size: int, split: bool = True):
    """``batch`` as the ``rank``-th of ``size`` sequence-parallel ranks trains on it (see the module's description);
    with ``split`` False, the whole sequences in the same format."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise SequenceShardingError(
            "Sequence parallelism splits batches that are mappings with an input_ids tensor ([batch, seq]); the "
            f"loader gave {type(batch).__name__}{'' if not isinstance(batch, Mapping) else ' without input_ids'}. "
            "Collate the batches into a dict (input_ids, labels, position_ids, ...)."
        )
    ids = batch["input_ids"]
    seq = ids.shape[1]
    if split and seq % size:
        raise SequenceShardingError(
            f"A batch's sequence length {seq} is not divisible by sp_size={size}: each sequence-parallel rank takes an "
            f"equal part. Pad the sequences to a multiple of {size} (tokenizer(..., pad_to_multiple_of={size}), labels "
            "-100 on the padding)."
        )
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
    if "labels" in out and "shift_labels" not in out:
        labels = out.pop("labels")
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    if not split:
        return out
    part = seq // size
    for name, value in out.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq:
            out[name] = value[:, rank * part : (rank + 1) * part].clone()
    return out


class SequenceShardingLoader:
    """A prepared loader whose batches each ``sp`` rank receives split (:func:`split_batch`).

    It has the loader's length (one batch out per batch in) and answers every other attribute with the loader's
    (``set_epoch``, ``batch_size``, ``dataset``, ...); the loader keeps its position for checkpoints.

    Args:
        loader: the prepared loader; ``rank``/``size``: this rank's place in the ``sp`` group and the group's size.
        model: the model being trained: while it is in evaluation mode, batches pass whole.
    """

    def __init__(self, loader, rank: int, size: int, model: torch.nn.Module | None = None):
        self.loader = loader
        self.sp_rank, self.sp_world_size = rank, size
        self.model = model

    def __iter__(self):
        for batch in self.loader:
            training = self.model is None or self.model.training
            yield split_batch(batch, self.sp_rank, self.sp_world_size, split=training)

    def __len__(self) -> int:
        return len(self.loader)

    def over(self, loader) -> SequenceShardingLoader:
        """The same split over another loader (``skip_first_batches`` of this one: the view of the loader inside)."""
        return SequenceShardingLoader(loader, self.sp_rank, self.sp_world_size, model=self.model)

    def __getattr__(self, name: str):
        if name == "loader":  # before __init__ set it (copy, pickle)
            raise AttributeError(name)
        return getattr(self.loader, name)
