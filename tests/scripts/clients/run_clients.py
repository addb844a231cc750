"""Runs client parts in one launch (on hasten through the alias, or on the reference copy of Accelerate).

Usage: ``run_clients.py OUT_DIR PART...``. Each part runs in turn in the same processes; each process writes
``OUT_DIR/<part>_rank<r>.json`` (``{"ok": true, "numbers": {...}}`` or ``{"ok": false, "error": traceback}``) and
the main process ``OUT_DIR/<part>.safetensors`` (the final weights), so one part failing does not hide the others.
tests/compat/test_clients.py runs the same parts on both sides and compares.
"""

import json
import sys
import traceback
from pathlib import Path

import diffusion
import embeddings
import hf_trainers
import lora
from safetensors.torch import save_file

import accelerate
from accelerate import PartialState

PARTS = {**hf_trainers.PARTS, **diffusion.PARTS, **lora.PARTS, **embeddings.PARTS}


def main(out: Path, names: list[str]) -> None:
    process = PartialState(cpu=True)  # Accelerate's bare PartialState() gives each torchrun CPU process its own world
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            numbers, weights = PARTS[name](folder)
            result = {"ok": True, "accelerator": accelerate.Accelerator.__module__, "numbers": numbers}
            if process.is_main_process:
                save_file(weights, str(out / f"{name}.safetensors"))
        except Exception:  # noqa: BLE001 - a failing part is reported in its result, the next part still runs
            result = {"ok": False, "error": traceback.format_exc()}
        (out / f"{name}_rank{process.process_index}.json").write_text(json.dumps(result, indent=1))
        process.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
