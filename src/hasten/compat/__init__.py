"""Accelerate's less used names and paths (``accelerate.utils`` helpers, Megatron-LM, quantization, internals), with
Accelerate's signatures; refusals say why."""
