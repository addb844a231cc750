"""Migration of launch config files written by older hasten or Accelerate versions: keys renamed,
moved or dropped, rewritten in place before the file is checked."""

from __future__ import annotations

from .fsdp import FSDP_SHARDING_STRATEGIES

_FSDP_STRATEGY_BY_NUMBER = {i + 1: name for i, name in enumerate(FSDP_SHARDING_STRATEGIES)}
_RENAMED = {
    ("fsdp_config", "fsdp_backward_prefetch_policy"): "fsdp_backward_prefetch",
    ("fp8_config", "amax_history_len"): "amax_history_length",
    ("fp8_config", "amax_compute_algo"): "amax_compute_algorithm",
}


def migrate(data: dict) -> list[str]:
    """Rewrite keys of older (or Accelerate-written) files in place; return one note per change."""
    notes: list[str] = []
    if "fp16" in data:
        fp16 = data.pop("fp16")
        if data.get("mixed_precision") is None:
            data["mixed_precision"] = "fp16" if fp16 in (True, "true", "True", "yes") else "no"
        notes.append(f"fp16: {fp16} became mixed_precision: {data['mixed_precision']}")
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        if str(backend).upper() != "NO":
            data.setdefault("dynamo_config", {}).setdefault("dynamo_backend", backend)
        notes.append(f"dynamo_backend: {backend} moved into dynamo_config")
    if data.get("num_processes") == -1:
        data.pop("num_processes")
        notes.append("num_processes: -1 (unset) was dropped")
    for key, why in (("ipex_config", "hasten does not use IPEX"), ("tp_config", "see parallelism_config")):
        if key in data:
            section = data.pop(key) or {}
            tp_size = section.get("tp_size") if isinstance(section, dict) else None
            if key == "tp_config" and tp_size and int(tp_size) > 1:
                data.setdefault("parallelism_config", {})["parallelism_config_tp_size"] = tp_size
            notes.append(f"{key} was dropped ({why})")
    mpirun = data.get("mpirun_config")
    if isinstance(mpirun, dict) and "mpirun_ccl" in mpirun:
        mpirun.pop("mpirun_ccl")
        notes.append("mpirun_config.mpirun_ccl was dropped (oneCCL worker threads are set with CCL_WORKER_COUNT)")
    for (section, old), new in _RENAMED.items():
        values = data.get(section)
        if isinstance(values, dict) and old in values:
            values.setdefault(new, values.pop(old))
            notes.append(f"{section}.{old} was renamed {section}.{new}")
    fsdp = data.get("fsdp_config")
    if isinstance(fsdp, dict) and isinstance(fsdp.get("fsdp_sharding_strategy"), int):
        number = fsdp["fsdp_sharding_strategy"]
        if number in _FSDP_STRATEGY_BY_NUMBER:
            fsdp["fsdp_sharding_strategy"] = _FSDP_STRATEGY_BY_NUMBER[number]
            notes.append(f"fsdp_config.fsdp_sharding_strategy: {number} became {fsdp['fsdp_sharding_strategy']}")
    return notes
