"""Moved to ``hf_varlen.integrations.kernelize.peft_lora``; this path warns and is removed next release."""

from .._moved import moved

moved(__name__, "hf_varlen.integrations.kernelize.peft_lora")
