"""Moved to ``hf_varlen.integrations.hub.attention``; this path warns and is removed next release."""

from .._moved import moved

moved(__name__, "hf_varlen.integrations.hub.attention")
