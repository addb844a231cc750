"""gather_for_metrics on one process: Accelerate's result, without a process group (tests/compat has the
differential cases against Accelerate on 1 and 2 processes)."""

import torch
from torch.utils.data import DataLoader

from hasten import Accelerator


def test_one_process_cuts_more_rows_than_the_last_batch_to_the_real_samples():
    """The Trainer repeats the evaluation loss to the batch size: 37 samples in batches of 8 give 37 rows, not 40.
    Before, this raised "Default process group has not been initialized"."""
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(torch.arange(37), batch_size=8))
    rows = [accelerator.gather_for_metrics(torch.full((8,), float(batch[0]))) for batch in loader]
    assert [len(r) for r in rows] == [8, 8, 8, 8, 5]
    assert accelerator.gather_for_metrics(torch.arange(3)).tolist() == [0, 1, 2], "outside a loop: the data as it is"
    names = [accelerator.gather_for_metrics([f"s{int(i)}" for i in batch] + ["extra"] * 3) for batch in loader]
    assert names[-1] == ["s32", "s33", "s34", "s35", "s36"]
