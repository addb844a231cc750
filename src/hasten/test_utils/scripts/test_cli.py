"""The script a launch test starts (Accelerate's ``test_utils/scripts/test_cli.py``): it reports the accelerators
the process sees, so a test can tell that ``launch`` ran it, and with which devices."""

from __future__ import annotations

from hasten import environment


def main() -> None:
    """Print ``Successfully ran on <count> <GPU|XPU>s``."""
    import torch

    kind = environment.accelerator_type()
    count = torch.xpu.device_count() if kind == "xpu" else torch.cuda.device_count() if kind == "cuda" else 0
    print(f"Successfully ran on {count} {'XPU' if kind == 'xpu' else 'GPU'}s")


if __name__ == "__main__":
    main()
