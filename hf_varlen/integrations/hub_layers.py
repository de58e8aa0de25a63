"""Deprecated alias, kept for one release: importing it warns and gives the module below."""

from .._moved import moved

moved(__name__, "hf_varlen.integrations.hub.layers")
