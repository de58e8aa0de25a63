"""Deprecated path of ``hf_varlen.ops.attention.tma``; removed in the next release."""

from ._lazy import moved_module

__getattr__ = moved_module(__name__, f"{__package__}.attention.tma")
