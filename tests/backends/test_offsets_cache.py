"""Caches keyed on offsets tensors never serve a previous batch's result (issue: sdpa and flex
returned the old batch's output when cu_seqlens was edited in place without bumping its version,
through the numpy array behind torch.from_numpy or through ``cu.data[...] = ...``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attn_cases import make_qkv

import hf_varlen
from hf_varlen.ops.attention import triton_varlen_attention

OLD, NEW = [0, 4, 10], [0, 7, 10]


def _edit(route: str):
    """A cu_seqlens tensor holding OLD, and a function that rewrites it to NEW in place."""
    if route == "numpy":
        arr = np.array(OLD, dtype=np.int32)
        cu = torch.from_numpy(arr)

        def edit():
            arr[:] = NEW

    else:
        cu = torch.tensor(OLD, dtype=torch.int32)

        def edit():
            cu.data[:] = torch.tensor(NEW, dtype=torch.int32)

    return cu, edit


def _attend(backend, q, k, v, cu):
    if backend == "triton":
        return triton_varlen_attention(q, k, v, cu, cu)
    return hf_varlen.varlen_attention(q, k, v, cu, cu, 7, 7, backend=backend)


@pytest.mark.parametrize("route", ["numpy", "data"])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference", "triton"])
def test_offsets_edited_behind_the_version_counter_are_seen(backend, route):
    q, k, v = make_qkv([10], 4, 2, 16, torch.float32)
    cu, edit = _edit(route)
    version = cu._version
    _attend(backend, q, k, v, cu)  # fills the caches with OLD's documents
    edit()
    assert cu._version == version and cu.tolist() == NEW  # the edit the cache cannot see by version
    got = _attend(backend, q, k, v, cu)
    want = _attend(backend, q, k, v, torch.tensor(NEW, dtype=torch.int32))
    assert torch.equal(got, want)
    old = _attend(backend, q, k, v, torch.tensor(OLD, dtype=torch.int32))
    assert not torch.equal(got, old)
