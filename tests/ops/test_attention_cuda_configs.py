"""The triton attention kernel's shipped CUDA tile configs and head folds, on CPU.

On CPU the kernel picks the small interpreter config, so the block sizes and GQA folds that ship
for CUDA (head dims 64 / 128 / 256, and the long-document path of 64 and 128) are otherwise only
run on a GPU. Here each shipped config is pinned (``pick_config`` / ``pick_long_path`` as the
launcher looks them up, answered with what they return for a CUDA device) and small fp16 packs run
forward and backward under TRITON_INTERPRET=1 against the fp64 oracle, by the numerics rule of
hf_varlen.testing (hi: the reference in fp64, lo: the reference in fp16; gradients 3x). Warps and
pipeline stages mean nothing to the interpreter; block sizes, folds, tile orders, the short /
long split and the persistent loop do.

The head counts are chosen for the folds they give under each config (``fold_factor``), e.g.
8 / 1 heads at head dim 64 fold 8 query heads into a forward tile, 2 into a dQ tile and 4 into a
dK/dV step; 10 / 2 at head dim 128 fold 5 into the forward tile (25-token tiles) and none in the
backward, which runs the dK/dV kernel's unfolded stage count.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys

import pytest
import torch

from hf_varlen.ops import triton_varlen_attention
from hf_varlen.reference.attention import attention_reference
from hf_varlen.testing import assert_numerics

pytest.importorskip("triton")

CUDA = torch.device("cuda")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU


@functools.cache
def _defined(name: str):
    """The schedule function ``name`` as defined, found in whichever module of ``hf_varlen.ops``
    defines it, so this file follows a move of the schedule (looked up once, before any test
    pins the selectors)."""
    importlib.import_module("hf_varlen.ops.attention")
    for mod_name, mod in list(sys.modules.items()):
        fn = getattr(mod, name, None) if mod_name.startswith("hf_varlen.ops") else None
        if callable(fn) and getattr(fn, "__module__", None) == mod_name:
            return fn
    raise AssertionError(f"no module of hf_varlen.ops defines {name}")


def _pin(monkeypatch, attr: str, value) -> list:
    """Every module of ``hf_varlen.ops`` that holds the selector ``attr`` answers ``value``;
    returns the list of the calls it answered."""
    real, calls = _defined(attr), []
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("hf_varlen.ops") and getattr(mod, attr, None) is real:
            monkeypatch.setattr(mod, attr, lambda *a, **k: calls.append(a) or value)
    return calls


def shipped(head_dim: int):
    """(short config, long path or None) that ships for CUDA fp16 at ``head_dim``."""
    return (
        _defined("pick_config")(head_dim, torch.float16, CUDA),
        _defined("pick_long_path")(head_dim, torch.float16, CUDA),
    )


@pytest.fixture
def pin(monkeypatch):
    """pin(short, long, h_q, h_kv, folds): the kernels launch with these configs (long None: no
    long path); ``folds`` (forward, dQ, dK/dV) are the head folds the heads must give under the
    config that decides them, so that a retuned config cannot silently stop covering a fold.
    After the test, both selectors must have been asked."""
    monkeypatch.delenv("HF_VARLEN_TRITON_ATTN_CONFIG", raising=False)  # the shipped ones
    asked = []

    def apply(short, long, h_q, h_kv, folds):
        cfg = short if long is None else long.cfg
        got = tuple(_defined("kernel_tiling")(cfg, k, h_q // h_kv)[0] for k in ("fwd", "dq", "kv"))
        assert got == folds, f"{h_q}/{h_kv} heads fold {got} under {cfg}, not {folds}"
        asked.extend((_pin(monkeypatch, "pick_config", short),
                      _pin(monkeypatch, "pick_long_path", long)))  # fmt: skip

    yield apply
    assert all(asked), "the launcher never asked the pinned selectors"


def _fwd_bwd(fn, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def check(lengths, h_q, h_kv, d, *, seed=0, **kw):
    """fp16 kernel vs the reference (hi: fp64, lo: fp16), forward and backward."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, grad_out = (
        torch.randn(t, h, d, generator=g).to(DEVICE, torch.float16) for h in (h_q, h_kv, h_kv, h_q)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(DEVICE)
    got = _fwd_bwd(
        lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu, **kw), q, k, v, grad_out
    )
    ref = lambda a, b, c: attention_reference(a, b, c, cu, cu, **kw)  # noqa: E731
    lo = _fwd_bwd(ref, q, k, v, grad_out)
    hi = _fwd_bwd(ref, *(x.double() for x in (q, k, v, grad_out)))
    for name, x, h, low, factor in zip(("out", "dq", "dk", "dv"), got, hi, lo, (2, 3, 3, 3)):
        assert_numerics(f"{name} {lengths} {h_q}/{h_kv}/{d} {kw}", x, h, low, factor=factor)


@pytest.mark.parametrize(
    "d,h_q,h_kv,folds,lengths,kw",
    [
        # fold 8 / 2 / 4 (forward / dQ / dK-dV); a T that is no multiple of any tile
        (64, 8, 1, (8, 2, 4), [1, 37, 70, 5], {}),
        # fold 5 / 1 / 1: 25-token forward tiles, the dK/dV kernel's unfolded stage count;
        # sliding window and softcap through the same tiles
        (128, 10, 2, (5, 1, 1), [50, 3, 44], dict(window_size=(9, -1), softcap=20.0)),
        # fold 2 / 2 / 2 at head dim 256's smaller tiles, non-causal
        (256, 4, 2, (2, 2, 2), [20, 29], dict(causal=False)),
    ],
    ids=["d64-8x1", "d128-10x2-window-softcap", "d256-4x2-noncausal"],
)
def test_shipped_short_config(pin, d, h_q, h_kv, folds, lengths, kw):
    short, _ = shipped(d)
    pin(short, None, h_q, h_kv, folds)
    check(lengths, h_q, h_kv, d, **kw)


@pytest.mark.parametrize(
    "d,h_q,h_kv,folds,lengths",
    [
        # one program per long tile (head dim 64's launch mode), fold 2 in every long kernel
        (64, 4, 2, (2, 2, 2), [150, 9, 20]),
        # persistent long launches (head dim 128's), fold 4 / 2 / 4
        (128, 8, 2, (4, 2, 4), [7, 160, 12]),
    ],
    ids=["d64-one-program-per-tile", "d128-persistent"],
)
def test_shipped_long_path(pin, d, h_q, h_kv, folds, lengths):
    """The shipped long-document configs, with ``min_span`` lowered so that a small pack's long
    document takes them (the CUDA threshold needs documents of >= 1024 tokens) while its short
    documents keep the shipped short config in the same call."""
    short, long = shipped(d)
    assert long is not None, f"head dim {d} ships a long path"
    pin(short, dataclasses.replace(long, min_span=64), h_q, h_kv, folds)
    check(lengths, h_q, h_kv, d)


def test_shipped_configs_are_the_cuda_ones():
    """What this file pins is what a CUDA device gets, not the interpreter's config."""
    cpu = _defined("pick_config")(64, torch.float16, torch.device("cpu"))
    for d in (64, 128, 256):
        short, _ = shipped(d)
        assert short != cpu and short.fwd_block_m >= 64, (d, short)
    assert shipped(64)[1].programs_per_sm == (0, 0, 0)  # one program per long tile
    assert shipped(128)[1].programs_per_sm != (0, 0, 0)  # persistent
    assert shipped(256)[1] is None
