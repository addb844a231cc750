"""Run under ``hasten launch --as_accelerate``: prints what ``accelerate`` is in this worker and in a Python
process it starts (``subprocess``), one JSON line per worker."""

import importlib.metadata
import json
import subprocess
import sys

import accelerate
from accelerate import Accelerator

CHILD = (
    "import accelerate, importlib.metadata as m, json; print(json.dumps([accelerate.__version__, "
    "m.version('accelerate'), accelerate.Accelerator.__module__]))"
)

accelerator = Accelerator()
child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
report = {
    "rank": accelerator.process_index,
    "version": accelerate.__version__,
    "distribution": importlib.metadata.version("accelerate"),
    "accelerator": type(accelerator).__module__,
    "child": json.loads(child.stdout),
}
print("ALIAS " + json.dumps(report), flush=True)
