"""transformers' ``from_pretrained(folder, device_map="auto", max_memory=...)`` on hasten, with part of a
tiny model offloaded to disk: the outputs equal the model loaded whole.

transformers imports ``accelerate`` for device maps: ``hasten.install_as_accelerate()`` answers it.

Usage: transformers_disk_offload.py FOLDER. Run by tests/big_modeling/test_big_modeling.py; prints one JSON line.
"""

import json
import sys
from pathlib import Path

import hasten

FOLDER = Path(sys.argv[1])
hasten.install_as_accelerate()

import torch  # noqa: E402 (after the alias is installed)
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0)
GPT2LMHeadModel(config).save_pretrained(FOLDER / "model")
ids = torch.randint(0, 128, (2, 16))
whole = GPT2LMHeadModel.from_pretrained(FOLDER / "model").eval()
offloaded = GPT2LMHeadModel.from_pretrained(
    FOLDER / "model", device_map="auto", max_memory={"cpu": 400_000}, offload_folder=FOLDER / "offload"
).eval()
with torch.no_grad():
    same = torch.equal(whole(ids).logits, offloaded(ids).logits)
devices = sorted({str(device) for device in offloaded.hf_device_map.values()})
print(
    json.dumps(
        {
            "devices": devices,
            "disk_entries": sum(d == "disk" for d in offloaded.hf_device_map.values()),
            "same_logits": same,
            "map": offloaded.hf_device_map,
        }
    )
)
