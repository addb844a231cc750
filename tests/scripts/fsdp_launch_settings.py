"""Print the FSDP plugin that ``hasten launch`` settings produce in each process (run by
tests/strategies/test_fsdp.py)."""

import json

from hasten import Accelerator

acc = Accelerator()
plugin = acc.state.fsdp_plugin
fields = (
    "sharding_strategy",
    "reshard_after_forward",
    "auto_wrap_policy",
    "transformer_cls_names_to_wrap",
    "state_dict_type",
    "cpu_offload",
    "activation_checkpointing",
    "use_orig_params",
)
print(
    "SETTINGS",
    acc.process_index,
    acc.distributed_type.value,
    json.dumps({name: getattr(plugin, name) for name in fields}, sort_keys=True),
)
