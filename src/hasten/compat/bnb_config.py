"""``BnbQuantizationConfig``, Accelerate's bitsandbytes quantization settings (``accelerate.utils.dataclasses``).

The settings are built and checked as in Accelerate (libraries create and pass them around); quantizing a model
with them (``load_and_quantize_model``, :mod:`hasten.compat.quantization`) is not supported by hasten.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..enums import CustomDtype
from ..errors import HastenError

_BNB_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class QuantizationConfigError(HastenError, ValueError):
    """A ``BnbQuantizationConfig`` field holds a value bitsandbytes cannot use."""


@dataclass
class BnbQuantizationConfig:
    """bitsandbytes 4-bit/8-bit quantization settings, checked as Accelerate checks them.

    The settings can be built and inspected (libraries pass them around); quantizing a model with them
    (``load_and_quantize_model``) is not supported by hasten. Exactly one of ``load_in_8bit``/``load_in_4bit``
    must be True; dtype names (``"fp32"``, ``"fp16"``, ``"bf16"``) become torch dtypes, and ``torch_dtype``
    defaults to fp16 for 8-bit and to ``bnb_4bit_compute_dtype`` for 4-bit.
    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Any = None
    skip_modules: list | None = None
    keep_in_fp32_modules: list | None = None

    def __post_init__(self):
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            _expect(isinstance(getattr(self, name), bool), f"{name} must be a boolean, got {getattr(self, name)!r}.")
        _expect(
            self.load_in_8bit != self.load_in_4bit,
            f"Set exactly one of load_in_8bit and load_in_4bit to True (they can't be both {self.load_in_8bit}).",
        )
        _expect(isinstance(self.llm_int8_threshold, (int, float)), "llm_int8_threshold must be a float or an int.")
        _expect(
            self.bnb_4bit_quant_type in ("fp4", "nf4"),
            f"bnb_4bit_quant_type must be 'fp4' or 'nf4', got {self.bnb_4bit_quant_type!r}.",
        )
        self.bnb_4bit_compute_dtype = _bnb_dtype("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype)
        for name in ("skip_modules", "keep_in_fp32_modules"):
            _expect(
                getattr(self, name) is None or isinstance(getattr(self, name), list),
                f"{name} must be a list of module names.",
            )
        self.target_dtype = CustomDtype.INT4 if self.load_in_4bit else torch.int8
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn(
                "llm_int8_threshold only applies to models loaded in 8bit; it is ignored with load_in_4bit.",
                stacklevel=3,
            )
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _bnb_dtype("torch_dtype", self.torch_dtype)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise QuantizationConfigError(f"BnbQuantizationConfig: {message}")


def _bnb_dtype(name: str, value):
    if isinstance(value, str):
        _expect(value in _BNB_DTYPES, f"{name} must be one of {sorted(_BNB_DTYPES)} or a torch.dtype, got {value!r}.")
        return _BNB_DTYPES[value]
    _expect(
        isinstance(value, torch.dtype), f"{name} must be one of {sorted(_BNB_DTYPES)} or a torch.dtype, got {value!r}."
    )
    return value
