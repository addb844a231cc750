"""transformers' ``from_pretrained(folder, device_map="auto", max_memory=...)`` on hasten, with part of a
tiny model offloaded to disk: the outputs equal the model loaded whole.

transformers imports ``accelerate`` for device maps. Until hasten's own alias is installed in the
environment, this script maps the few module paths it needs to hasten and puts a stand-in
``accelerate`` distribution record on ``sys.path`` (in a temporary folder; nothing is installed).

Usage: transformers_disk_offload.py FOLDER. Run by tests/test_big_modeling.py; prints one JSON line.
"""

import json
import sys
import types
from pathlib import Path

import hasten
import hasten.big_modeling
import hasten.device_map
import hasten.hooks
import hasten.utils

FOLDER = Path(sys.argv[1])


def alias_accelerate() -> None:
    """Make ``import accelerate`` (and the submodules transformers' device-map code imports) give hasten."""
    record = FOLDER / "site" / "accelerate-1.15.0.dist-info"
    record.mkdir(parents=True, exist_ok=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: accelerate\nVersion: 1.15.0\n")
    sys.path.insert(0, str(record.parent))
    sys.modules.update({"accelerate": hasten, "accelerate.utils": hasten.utils, "accelerate.hooks": hasten.hooks, "accelerate.big_modeling": hasten.big_modeling})
    for name in ("modeling", "deepspeed", "memory", "imports", "constants", "dataclasses", "operations", "other"):
        shim = types.ModuleType(f"accelerate.utils.{name}")
        shim.__getattr__ = lambda attribute: getattr(hasten.utils, attribute)
        sys.modules[shim.__name__] = shim
    sys.modules["accelerate.utils.modeling"].clean_device_map = hasten.device_map.clean_device_map


alias_accelerate()

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0)
GPT2LMHeadModel(config).save_pretrained(FOLDER / "model")
ids = torch.randint(0, 128, (2, 16))
whole = GPT2LMHeadModel.from_pretrained(FOLDER / "model").eval()
offloaded = GPT2LMHeadModel.from_pretrained(FOLDER / "model", device_map="auto", max_memory={"cpu": 400_000}, offload_folder=FOLDER / "offload").eval()
with torch.no_grad():
    same = torch.equal(whole(ids).logits, offloaded(ids).logits)
devices = sorted({str(device) for device in offloaded.hf_device_map.values()})
print(json.dumps({"devices": devices, "disk_entries": sum(d == "disk" for d in offloaded.hf_device_map.values()), "same_logits": same, "map": offloaded.hf_device_map}))
