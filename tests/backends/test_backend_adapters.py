"""The CUDA-only backend adapters (``torch``, ``fa4``, ``flash_attn``, ``xformers``) on CPU.

Their libraries need a GPU (or are not installed), so the translation each adapter does, from
``(q, k, v, VarlenMetadata, AttentionParams)`` to its library's call, is otherwise only checked on
the GPU. Here the library function each adapter calls is replaced by a stand-in that records its
arguments and computes what the library computes, by the library's own conventions, with the
fp64 reference:

- the recorded arguments: cu_seqlens int32 on q's device (clamped into [0, T] where the library
  trusts them), max lengths as Python ints, scale, causality and window in the library's spelling
  (FA4's None for unbounded, torch's window-only causality), softcap, dropout, determinism,
  layouts (packed (T, H, D), xformers' 5-D GQA view with K/V broadcast, not copied), GQA;
- the adapter returns what the stand-in returned (FA4 / FA3's (out, lse) unpacked);
- forward and backward through the stand-in equal the reference on the original inputs bit for
  bit (the same fp64 computation when the translation is right), so a wrong mapping (a window
  side, the GQA head order) changes the numbers;
- an explicitly chosen backend whose library is missing raises one error naming it (no fallback).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.attention.varlen as torch_varlen_module

import hf_varlen
from hf_varlen.backends import (
    AttentionParams,
    VarlenMetadata,
    get_spec,
    register_backend,
    registry,
)
from hf_varlen.reference.attention import attention_reference

LENGTHS = [5, 1, 9]
# (causal, window_size, softcap): the FA-2 style keywords a caller gives
CASES = {
    "causal": (True, (-1, -1), 0.0),
    "full": (False, (-1, -1), 0.0),
    "causal-window": (True, (3, -1), 0.0),
    "window-both-sides": (False, (2, 4), 0.0),
    "window-left-only": (False, (3, -1), 0.0),
    "causal-softcap": (True, (-1, -1), 2.5),
}


def _inputs(h_q=4, h_kv=2, d=8, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v, grad_out = (
        torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (h_q, h_kv, h_kv, h_q)
    )
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return q, k, v, grad_out, cu


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() sees it installed
    mod.__dict__.update(attrs)
    return mod


def _reference(q, k, v, cu_q, cu_k, *, scale, causal, window, softcap=0.0):
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    return attention_reference(q, k, v, cu_q, cu_k, **kw)


# ---- the stand-ins: record, then compute as the library would ----------------------------------


def _torch_stand_in(calls, gqa_flag: bool):
    """torch.nn.attention.varlen.varlen_attn: causality is a window with right == 0; with
    ``enable_gqa`` (torch >= 2.13) K/V keep their heads, without it they must match q's."""

    def record(args, scale, window_size, extra):
        q, k, v, cu_q, cu_k, max_q, max_k = args
        if not extra.get("enable_gqa", False):
            assert k.shape[1] == q.shape[1], "GQA without enable_gqa"
        out = _reference(q, k, v, cu_q, cu_k, scale=scale, causal=False, window=window_size)
        names = ("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k")
        calls.append(dict(zip(names, args), scale=scale, window=window_size, extra=extra, out=out))
        return out

    if gqa_flag:

        def varlen_attn(*args, scale=None, window_size=(-1, -1), enable_gqa=None):
            flag = {} if enable_gqa is None else {"enable_gqa": enable_gqa}  # only if passed
            return record(args, scale, tuple(window_size), flag)

    else:  # torch 2.11's signature

        def varlen_attn(*args, scale=None, window_size=(-1, -1)):
            return record(args, scale, tuple(window_size), {})

    return varlen_attn


def _fa_stand_in(calls, *, none_for_unbounded: bool, returns_lse: bool):
    """flash_attn_varlen_func of FA2 / FA3 (window -1 = unbounded) or FA4 (None = unbounded);
    FA3 and FA4 return (out, lse)."""
    named = {"softmax_scale": "scale", "causal": "causal", "window_size": "window"}
    named |= {"softcap": "softcap", "deterministic": "deterministic"}

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw
    ):
        got = {named[key]: value for key, value in kw.items() if key in named}
        left, right = got.setdefault("window", (-1, -1))
        if none_for_unbounded:
            assert -1 not in got["window"], f"FA4 spells unbounded None, got {got['window']}"
            left, right = (-1 if w is None else w for w in (left, right))
        out = _reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale=got.get("scale"),
            causal=got.get("causal", False), window=(left, right), softcap=got.get("softcap", 0.0),
        )  # fmt: skip
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        extra = {key: value for key, value in kw.items() if key not in named}
        calls.append(dict(zip(("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k"), args), **got))
        calls[-1].update(extra=extra, out=out)
        return (out, torch.zeros(q.shape[1], q.shape[0])) if returns_lse else out

    return flash_attn_varlen_func


class _Bias:
    """xformers' block-diagonal attention biases: the document lengths, from host lists."""

    causal = False

    def __init__(self, lq, lk):
        self.lq, self.lk = list(lq), list(lk)

    @classmethod
    def from_seqlens(cls, lq, lk):
        return cls(lq, lk)


class _CausalBias(_Bias):
    causal = True


def _xformers_stand_in(calls):
    """memory_efficient_attention on (B, T, H_kv, G, D): head (h, g) of q attends with K/V head
    (h, g), which the adapter must make K/V head h of every g (GQA)."""

    def memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None):
        b, t, h, g, d = q.shape
        cu_q = torch.tensor([0, *np.cumsum(attn_bias.lq).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *np.cumsum(attn_bias.lk).tolist()], dtype=torch.int32)
        flat = [x[0].reshape(x.shape[1], h * g, x.shape[-1]) for x in (q, k, v)]
        out = _reference(
            *flat, cu_q, cu_k, scale=scale, causal=attn_bias.causal, window=(-1, -1)
        ).reshape(b, t, h, g, v.shape[-1])
        calls.append(dict(q=q, k=k, v=v, bias=attn_bias, p=p, scale=scale, out=out))
        return out

    return memory_efficient_attention


@pytest.fixture
def stand_ins(monkeypatch):
    """install(name, variant) puts the stand-in where adapter ``name`` finds its library; returns
    the list the stand-in records its calls in."""

    def install(name: str, variant: str = "") -> list:
        calls: list = []
        if name == "torch":
            fn = _torch_stand_in(calls, gqa_flag=variant != "no-gqa-flag")
            monkeypatch.setattr(torch_varlen_module, "varlen_attn", fn)
        elif name == "fa4":
            fn = _fa_stand_in(calls, none_for_unbounded=True, returns_lse=True)
            monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn"))
            monkeypatch.setitem(
                sys.modules,
                "flash_attn.cute",
                _module("flash_attn.cute", flash_attn_varlen_func=fn),
            )
        elif name == "flash_attn" and variant == "fa3":
            fn = _fa_stand_in(calls, none_for_unbounded=False, returns_lse=True)
            monkeypatch.setitem(
                sys.modules,
                "flash_attn_interface",
                _module("flash_attn_interface", flash_attn_varlen_func=fn),
            )
        elif name == "flash_attn":  # FA2: no flash_attn_interface installed
            fn = _fa_stand_in(calls, none_for_unbounded=False, returns_lse=False)
            monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
            monkeypatch.setitem(
                sys.modules, "flash_attn", _module("flash_attn", flash_attn_varlen_func=fn)
            )
        elif name == "xformers":
            fmha = types.SimpleNamespace(
                attn_bias=types.SimpleNamespace(
                    BlockDiagonalMask=_Bias,
                    BlockDiagonalCausalFromBottomRightMask=_CausalBias,
                )
            )
            ops = _module(
                "xformers.ops", fmha=fmha, memory_efficient_attention=_xformers_stand_in(calls)
            )
            monkeypatch.setitem(sys.modules, "xformers", _module("xformers", ops=ops))
            monkeypatch.setitem(sys.modules, "xformers.ops", ops)
        else:
            raise AssertionError(name)
        return calls

    return install


# (backend, stand-in variant)
ADAPTERS = [
    ("torch", ""),
    ("torch", "no-gqa-flag"),
    ("fa4", ""),
    ("flash_attn", "fa2"),
    ("flash_attn", "fa3"),
    ("xformers", ""),
]
ADAPTER_IDS = [f"{n}-{v}" if v else n for n, v in ADAPTERS]


def _supported(name: str, causal, window, softcap) -> bool:
    """Whether the backend's spec accepts these features (the public layer refuses the rest, so
    the adapter never sees them)."""
    spec = get_spec(name)
    params = AttentionParams.create(head_dim=8, causal=causal, window_size=window, softcap=softcap)
    return (
        (spec.sliding_window or not params.sliding_window)
        and (spec.softcap or not softcap)
        and (spec.non_causal or params.causal)
    )


def _grads(fn, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad_out)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "name,variant,case",
    [
        pytest.param(n, v, c, id=f"{n}{'-' + v if v else ''}-{c}")
        for (n, v) in ADAPTERS
        for c, kw in CASES.items()
        if _supported(n, *kw)
    ],
)
def test_adapter_forward_and_backward_equal_the_reference(stand_ins, name, variant, case):
    causal, window, softcap = CASES[case]
    calls = stand_ins(name, variant)
    q, k, v, grad_out, cu = _inputs()
    params = AttentionParams.create(
        head_dim=8, causal=causal, window_size=window, softcap=softcap, softmax_scale=0.3
    )
    meta = VarlenMetadata(cu, cu, max(LENGTHS), max(LENGTHS))
    fn = get_spec(name).fn
    got = _grads(lambda a, b, c: fn(a, b, c, meta, params), q, k, v, grad_out)
    kw = dict(scale=0.3, causal=causal, window=window, softcap=softcap)
    want = _grads(lambda a, b, c: _reference(a, b, c, cu, cu, **kw), q, k, v, grad_out)
    assert len(calls) == 1
    for label, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, ref, rtol=0, atol=0, msg=f"{name} {case} {label}")
    # what the adapter returns is the library's output, not a copy or a recomputation
    returned = calls[0]["out"]
    assert got[0].data_ptr() == returned.data_ptr() and got[0].shape == q.shape


@pytest.mark.parametrize("name,variant", ADAPTERS, ids=ADAPTER_IDS)
def test_adapter_arguments(stand_ins, name, variant):
    """Offsets, max lengths, scale, window, GQA and layout as the library is handed them."""
    calls = stand_ins(name, variant)
    q, k, v, _, cu = _inputs(h_q=6, h_kv=2)
    causal, window = (True, (4, -1)) if get_spec(name).sliding_window else (True, (-1, -1))
    params = AttentionParams.create(
        head_dim=8, causal=causal, window_size=window, softmax_scale=0.25, deterministic=True
    )
    get_spec(name).fn(q, k, v, VarlenMetadata(cu, cu, 9, 9), params)
    (c,) = calls
    if name == "xformers":  # 5-D (1, T, H_kv, G, D); K/V broadcast over G without a copy
        assert c["q"].shape == (1, 15, 2, 3, 8) and c["q"].data_ptr() == q.data_ptr()
        for got, src in ((c["k"], k), (c["v"], v)):
            assert got.shape == (1, 15, 2, 3, 8) and got.stride(3) == 0
            assert got.data_ptr() == src.data_ptr()
        assert type(c["bias"]) is _CausalBias and (c["bias"].lq, c["bias"].lk) == (LENGTHS, LENGTHS)
        assert c["p"] == 0.0 and c["scale"] == 0.25
        return
    for key in ("cu_q", "cu_k"):
        assert c[key].dtype == torch.int32 and c[key].device == q.device
        assert c[key].tolist() == cu.tolist()
    assert type(c["max_q"]) is int and type(c["max_k"]) is int and c["max_q"] == c["max_k"] == 9
    assert c["q"] is q
    if name == "torch":
        assert c["scale"] == 0.25 and tuple(c["window"]) == (4, 0)  # causal folded in
        if variant == "no-gqa-flag":  # K/V expanded to the query heads, h -> h // group
            assert c["extra"] == {} and c["k"].shape == (15, 6, 8)
            assert torch.equal(c["k"], k.repeat_interleave(3, dim=1))
        else:
            assert c["extra"] == {"enable_gqa": True} and c["k"] is k and c["v"] is v
        return
    assert c["k"] is k and c["v"] is v  # FlashAttention takes GQA as is
    assert c["scale"] == 0.25 and c["causal"] is True and c["deterministic"] is True
    assert tuple(c["window"]) == (4, 0)
    assert c["softcap"] == 0.0
    if name == "flash_attn":  # dropout is FA2's only (FA3 has none)
        assert c["extra"] == ({"dropout_p": 0.0} if variant == "fa2" else {})


def test_torch_without_gqa_passes_kv_unchanged(stand_ins):
    calls = stand_ins("torch")
    q, k, v, _, cu = _inputs(h_q=2, h_kv=2)
    get_spec("torch").fn(
        q, k, v, VarlenMetadata(cu, cu, 9, 9), AttentionParams.create(head_dim=8, causal=True)
    )
    assert calls[0]["extra"] == {} and calls[0]["k"] is k


@pytest.mark.parametrize(
    "window,want",
    [
        ((-1, 0), (None, None)),
        ((5, 0), (5, 0)),
        ((-1, -1), (None, None)),
        ((3, -1), (3, None)),
        ((-1, 2), (None, 2)),
        ((2, 4), (2, 4)),
    ],
)
def test_fa4_window_spelling(stand_ins, window, want):
    """FA4 spells an unbounded side None, and plain causal as (None, None) with causal=True."""
    calls = stand_ins("fa4")
    q, k, v, _, cu = _inputs()
    params = AttentionParams(window=window, softmax_scale=0.5, softcap=1.5)
    get_spec("fa4").fn(q, k, v, VarlenMetadata(cu, cu, 9, 9), params)
    assert tuple(calls[0]["window"]) == want
    assert calls[0]["causal"] is (window[1] == 0) and calls[0]["softcap"] == 1.5


@pytest.mark.parametrize("name,variant", [("flash_attn", "fa2"), ("xformers", "")])
def test_dropout_reaches_the_library(stand_ins, name, variant):
    calls = stand_ins(name, variant)
    q, k, v, _, cu = _inputs()
    params = AttentionParams.create(head_dim=8, causal=False, dropout_p=0.25)
    get_spec(name).fn(q, k, v, VarlenMetadata(cu, cu, 9, 9), params)
    got = calls[0]["extra"]["dropout_p"] if name == "flash_attn" else calls[0]["p"]
    assert got == 0.25
    if name == "xformers":
        assert type(calls[0]["bias"]) is _Bias  # non-causal: the plain block-diagonal mask


@pytest.mark.parametrize("name", ["torch", "fa4", "flash_attn"])
def test_bad_offsets_are_clamped_before_the_library(stand_ins, name):
    """These libraries trust the offsets: out-of-range ones reach them clamped into [0, T] and
    non-decreasing, so the kernel stays inside the packed tensors (no host read to check them)."""
    calls = stand_ins(name, "fa2" if name == "flash_attn" else "")
    q, k, v, _, _ = _inputs()
    bad = torch.tensor([0, 9, 4, 99], dtype=torch.int32)
    params = AttentionParams.create(head_dim=8, causal=True)
    get_spec(name).fn(q, k, v, VarlenMetadata(bad, bad, 9, 9), params)
    assert calls[0]["cu_q"].tolist() == calls[0]["cu_k"].tolist() == [0, 9, 9, 15]
    assert calls[0]["cu_q"].dtype == torch.int32


def test_xformers_checks_host_offsets_before_the_library(stand_ins):
    """xformers builds its bias from host lists, so its offsets are fully checked first."""
    calls = stand_ins("xformers")
    q, k, v, _, _ = _inputs()
    bad = torch.tensor([0, 9, 4, 15], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        get_spec("xformers").fn(
            q, k, v, VarlenMetadata(bad, bad, 9, 9), AttentionParams.create(head_dim=8, causal=True)
        )
    assert calls == []


# ---- through the public function ----------------------------------------------------------------


@pytest.fixture
def served_on_cpu():
    """serve(name): backend ``name``'s own spec, allowed on CPU in fp64 (the public layer's
    checks, then the adapter, then the stand-in); the real spec is registered back afterwards."""
    saved = []

    def serve(name: str) -> None:
        spec = get_spec(name)
        saved.append(spec)
        register_backend(
            dataclasses.replace(
                spec,
                devices=frozenset({"cpu"}),
                dtypes=frozenset({torch.float64}),
                probe=lambda: None,
            )
        )

    yield serve
    for spec in saved:
        register_backend(spec)


@pytest.mark.parametrize("name,variant", ADAPTERS, ids=ADAPTER_IDS)
def test_public_call_reaches_the_library(stand_ins, served_on_cpu, name, variant):
    """hf_varlen.varlen_attention with numpy max lengths and no scale: the library receives
    Python ints and the resolved scale, and the result is the reference's."""
    calls = stand_ins(name, variant)
    served_on_cpu(name)
    q, k, v, _, cu = _inputs()
    m = np.int64(max(LENGTHS))
    out = hf_varlen.varlen_attention(q, k, v, cu, cu, m, m, backend=name)
    (c,) = calls
    assert c["scale"] == 8**-0.5
    if name != "xformers":
        assert type(c["max_q"]) is int and type(c["max_k"]) is int and c["max_q"] == 9
    want = _reference(q, k, v, cu, cu, scale=8**-0.5, causal=True, window=(-1, -1))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# ---- an explicit backend whose library is missing ------------------------------------------------

MISSING = {
    # backend: (modules that fail to import, what the error names)
    "torch": (["torch.nn.attention.varlen"], "has no torch.nn.attention.varlen.varlen_attn"),
    "fa4": (["flash_attn", "flash_attn.cute"], r"flash-attn-4 \(flash_attn.cute\) not importable"),
    "flash_attn": (["flash_attn", "flash_attn_interface"], "flash-attn .* not importable"),
    "xformers": (["xformers", "xformers.ops"], "xformers not importable"),
}


@pytest.fixture
def fresh_probe(monkeypatch):
    """reprobe(name): the backend's availability is probed again in the test. Afterwards the
    test's patches are undone first, then every backend is probed afresh (the error message
    lists the available backends, so the test probed them all under its pretended GPU)."""

    def reprobe(name):
        register_backend(get_spec(name))  # re-registering drops the cached probe result

    yield reprobe
    monkeypatch.undo()
    for name in list(registry._REGISTRY):
        reprobe(name)


@pytest.mark.parametrize("name", list(MISSING))
def test_explicit_backend_with_missing_library_raises_naming_it(monkeypatch, fresh_probe, name):
    """On a (pretended) Hopper GPU whose library is not installed: one RuntimeError that names
    the backend and the missing library (a fallback to another backend would return instead)."""
    modules, reason = MISSING[name]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for mod in modules:
        monkeypatch.setitem(sys.modules, mod, None)  # importing it raises ImportError
    fresh_probe(name)
    q, k, v, _, cu = _inputs()
    q, k, v = (t.half() for t in (q, k, v))
    with pytest.raises(
        RuntimeError, match=f"backend='{name}' was requested but cannot run here: .*{reason}"
    ) as err:
        hf_varlen.varlen_attention(q, k, v, cu, cu, 9, 9, backend=name)
    assert "backend='auto'" in str(err.value)  # the way out is named too
