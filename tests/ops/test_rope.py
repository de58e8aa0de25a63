"""Fused QK RoPE (hf_varlen.ops.rope) against the pure-PyTorch reference and HF's function.

CPU runs use the Triton interpreter (tests/conftest.py), so shapes stay tiny. Numerics follow
hf_varlen/testing.py through ``assert_numerics``: ref_hi is the reference on fp64 copies of the inputs,
ref_lo the reference in the input dtype (HF's own rounding); factor 2 for outputs, 3 for grads.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_varlen.ops.rope import apply_rotary_qk, rotary_pos_emb
from hf_varlen.ops.rope import function as rope_ops
from hf_varlen.ops.rope import kernel as rope_kernel
from hf_varlen.reference.rope import apply_rotary_qk_reference, positions_from_cu_seqlens
from hf_varlen.testing import assert_numerics

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_table(n_pos, rdim, dtype=torch.float32, interleaved=False, device=DEVICE):
    """HF-style cos/sin table (P, R): freqs duplicated as halves, or pairwise when interleaved."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float64) / rdim)
    freqs = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def hf_qk(batch, seqlen, hq, hkv, head_dim, dtype, device=DEVICE):
    """q, k as HF builds them: (B, T, H*D) projection outputs viewed as (B, H, T, D)."""
    q = torch.randn(batch, seqlen, hq * head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seqlen, hkv * head_dim, device=device, dtype=dtype)
    q = q.view(batch, seqlen, hq, head_dim).transpose(1, 2)
    k = k.view(batch, seqlen, hkv, head_dim).transpose(1, 2)
    return q, k


def leaf(x: torch.Tensor) -> torch.Tensor:
    """Detached copy with x's strides that requires grad."""
    return x.detach().clone().requires_grad_()


def check_fwd_bwd(
    q, k, cos, sin, ref_fn=apply_rotary_qk_reference, kernel_fn=apply_rotary_qk, **kw
):
    """Kernel outputs and q/k grads (random upstream grads) vs ref_hi (fp64) and ref_lo."""
    qk, kk = leaf(q), leaf(k)
    q_out, k_out = kernel_fn(qk, kk, cos, sin, **kw)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    refs = {}
    for name, up in (("hi", lambda t: t.double()), ("lo", lambda t: t)):
        qr, kr = leaf(up(q)), leaf(up(k))
        qo, ko = ref_fn(qr, kr, up(cos), up(sin), **kw)
        torch.autograd.backward((qo, ko), (up(gq), up(gk)))
        refs[name] = (qo, ko, qr.grad, kr.grad)
    for i, (name, x) in enumerate(
        (("q_out", q_out), ("k_out", k_out), ("dq", qk.grad), ("dk", kk.grad))
    ):
        factor = 2.0 if i < 2 else 3.0
        assert_numerics(name, x, refs["hi"][i], refs["lo"][i], factor=factor)
    return q_out, k_out


def packed_positions(batch, seqlen, lengths, device=DEVICE):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert cu[-1] == batch * seqlen
    pos = positions_from_cu_seqlens(cu, batch * seqlen).view(batch, seqlen)
    return cu.to(device), pos.to(device)


# ---------------------------------------------------------------------------------------------
# Numerics: outputs and gradients vs the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["gathered", "position_ids", "cu_seqlens"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, interleaved, mode):
    torch.manual_seed(0)
    batch, seqlen = 2, 11
    q, k = hf_qk(batch, seqlen, 4, 2, 32, dtype)
    cu, pos = packed_positions(batch, seqlen, [3, 1, 0, 9, 9])
    cos, sin = rope_table(16, 32, dtype, interleaved)
    kw = {"interleaved": interleaved}
    if mode == "gathered":
        cos, sin = cos[pos], sin[pos]
    elif mode == "position_ids":
        kw["position_ids"] = pos
    else:
        kw["cu_seqlens"] = cu
    check_fwd_bwd(q, k, cos, sin, **kw)


@pytest.mark.parametrize(
    "hq,hkv,head_dim,rdim",
    [(6, 2, 64, 64), (4, 1, 80, 80), (3, 3, 48, 32), (8, 8, 16, 16), (2, 1, 96, 64)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_head_dims_and_partial_rotary(dtype, hq, hkv, head_dim, rdim):
    torch.manual_seed(1)
    q, k = hf_qk(1, 9, hq, hkv, head_dim, dtype)
    cos, sin = rope_table(9, rdim, dtype)
    check_fwd_bwd(q, k, cos, sin, rotary_dim=rdim)


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_is_exact_transpose_for_any_cos_sin(interleaved):
    """Random cos/sin whose halves differ: the conjugate launch must still be the true adjoint."""
    torch.manual_seed(2)
    q, k = hf_qk(2, 7, 2, 1, 16, torch.float32)
    cos, sin = torch.randn(2, 7, 12, device=DEVICE), torch.randn(2, 7, 12, device=DEVICE)
    check_fwd_bwd(q, k, cos, sin, interleaved=interleaved, rotary_dim=12)


def test_fp32_table_with_bf16_qk():
    torch.manual_seed(3)
    q, k = hf_qk(1, 10, 2, 2, 16, torch.bfloat16)
    cos, sin = rope_table(10, 16, torch.float32)
    q_out, _ = check_fwd_bwd(q, k, cos, sin)
    assert q_out.dtype == torch.bfloat16


def test_non_contiguous_upstream_grad():
    torch.manual_seed(4)
    q, k = hf_qk(2, 6, 4, 2, 16, torch.float32)
    cos, sin = rope_table(6, 16)
    qk, kk = leaf(q), leaf(k)
    q_out, k_out = apply_rotary_qk(qk, kk, cos, sin)
    gq = torch.randn(2, 4, 6, 32, device=DEVICE)[..., ::2]  # (B, H, T, D) with a strided last dim
    gk = torch.randn(2, 6, 2, 16, device=DEVICE).transpose(1, 2).contiguous()  # (B, H, T, D)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    qr, kr = leaf(q), leaf(k)
    torch.autograd.backward(apply_rotary_qk_reference(qr, kr, cos, sin), (gq, gk))
    torch.testing.assert_close(qk.grad, qr.grad)
    torch.testing.assert_close(kk.grad, kr.grad)


# ---------------------------------------------------------------------------------------------
# Positions restart inside packs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_position_paths_agree_bitwise(interleaved):
    """cu_seqlens (in-kernel search), position_ids and gathered cos/sin give identical bits."""
    torch.manual_seed(5)
    lengths = [5, 1, 0, 9, 4, 1]  # an empty document and one-token documents
    cu, pos = packed_positions(1, 20, lengths)
    assert pos[0, 5].item() == 0 and pos[0, 6].item() == 0 and pos[0, 15].item() == 0
    q, k = hf_qk(1, 20, 4, 2, 16, torch.bfloat16)
    cos, sin = rope_table(32, 16, torch.bfloat16, interleaved)
    by_cu = apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu, inplace=False, interleaved=interleaved)
    by_ids = apply_rotary_qk(
        q, k, cos, sin, position_ids=pos, inplace=False, interleaved=interleaved
    )
    gathered = apply_rotary_qk(q, k, cos[pos], sin[pos], inplace=False, interleaved=interleaved)
    for a, b, c in zip(by_cu, by_ids, gathered):
        assert torch.equal(a, b) and torch.equal(a, c)
    # Every document equals the same document rotated alone from position 0.
    for start, length in zip(cu[:-1].tolist(), lengths):
        if length:
            sl = slice(start, start + length)
            alone = apply_rotary_qk(q[:, :, sl], k[:, :, sl], cos[:length], sin[:length],
                                    inplace=False, interleaved=interleaved)  # fmt: skip
            assert torch.equal(alone[0], by_cu[0][:, :, sl])
            assert torch.equal(alone[1], by_cu[1][:, :, sl])


def test_cu_seqlens_spans_batch_rows_and_packed_layout():
    """cu_seqlens counts the B * T tokens batch-major; packed (T, H, D) inputs work too."""
    torch.manual_seed(6)
    cu, pos = packed_positions(2, 8, [3, 7, 6])  # the second document crosses the row boundary
    q, k = hf_qk(2, 8, 2, 1, 16, torch.float32)
    cos, sin = rope_table(16, 16)
    check_fwd_bwd(q, k, cos, sin, cu_seqlens=cu)
    q_thd = torch.randn(16, 2, 16, device=DEVICE)
    k_thd = torch.randn(16, 1, 16, device=DEVICE)
    cu1, pos1 = packed_positions(1, 16, [3, 7, 6])
    check_fwd_bwd(q_thd, k_thd, cos, sin, cu_seqlens=cu1)
    expect = apply_rotary_qk_reference(q_thd, k_thd, cos, sin, cu_seqlens=cu1)
    q_out, k_out = apply_rotary_qk(q_thd, k_thd, cos, sin, cu_seqlens=cu1)
    assert q_out is q_thd and k_out is k_thd
    torch.testing.assert_close(q_thd, expect[0])


# ---------------------------------------------------------------------------------------------
# Strided views, in-place semantics, autograd safety
# ---------------------------------------------------------------------------------------------


def test_inplace_on_hf_view_updates_base():
    torch.manual_seed(7)
    q, k = hf_qk(2, 5, 4, 2, 16, torch.bfloat16)
    q_base, k_base = q._base, k._base
    cos, sin = rope_table(5, 16, torch.bfloat16)
    expect = apply_rotary_qk(q, k, cos, sin, inplace=False)
    versions = (q._version, k._version)
    ptrs = (q.data_ptr(), k.data_ptr())
    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    assert q_out is q and k_out is k and (q.data_ptr(), k.data_ptr()) == ptrs
    assert q._version > versions[0] and k._version > versions[1]
    assert torch.equal(q, expect[0]) and torch.equal(k, expect[1])
    assert torch.equal(q_base, expect[0].transpose(1, 2).reshape(q_base.shape))
    assert torch.equal(k_base, expect[1].transpose(1, 2).reshape(k_base.shape))


@pytest.mark.parametrize("rdim", [16, 8])
def test_inplace_false_leaves_inputs_bit_identical(rdim):
    torch.manual_seed(8)
    q, k = hf_qk(2, 5, 4, 2, 16, torch.float16)
    cos, sin = rope_table(8, rdim, torch.float16)
    cu, pos = packed_positions(2, 5, [4, 6])
    before = [t.clone() for t in (q, k, cos, sin, pos)]
    q_out, k_out = apply_rotary_qk(q, k, cos, sin, position_ids=pos, inplace=False)
    for t, b in zip((q, k, cos, sin, pos), before):
        assert torch.equal(t, b)
    assert q_out.data_ptr() != q.data_ptr() and k_out.data_ptr() != k.data_ptr()
    assert q_out.transpose(1, 2).is_contiguous()  # token-major, like HF's projections
    if rdim < 16:  # features that do not rotate are copied bit for bit
        assert torch.equal(q_out[..., rdim:], q[..., rdim:])
        assert torch.equal(k_out[..., rdim:], k[..., rdim:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_inplace_keeps_pass_through(interleaved):
    torch.manual_seed(9)
    q, k = hf_qk(1, 6, 2, 2, 32, torch.bfloat16)
    q0, k0 = q.clone(), k.clone()
    cos, sin = rope_table(6, 12, torch.bfloat16, interleaved)
    expect = apply_rotary_qk_reference(q, k, cos, sin, interleaved=interleaved)
    apply_rotary_qk(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(q[..., 12:], q0[..., 12:]) and torch.equal(k[..., 12:], k0[..., 12:])
    assert not torch.equal(q[..., :12], q0[..., :12])
    hi = apply_rotary_qk_reference(q0.double(), k0.double(), cos.double(), sin.double(),
                             interleaved=interleaved)  # fmt: skip
    assert_numerics("q", q, hi[0], expect[0])
    assert_numerics("k", k, hi[1], expect[1])


def test_inplace_under_autograd_on_non_leaf_views():
    """HF's q/k: non-leaf views of projection outputs. In place, gradients still exact."""
    torch.manual_seed(10)
    x = torch.randn(2, 5, 8, device=DEVICE, requires_grad=True)
    wq, wk = torch.randn(4 * 16, 8, device=DEVICE), torch.randn(2 * 16, 8, device=DEVICE)
    cos, sin = rope_table(5, 16)

    def run(fn):
        x.grad = None
        q = (x @ wq.T).view(2, 5, 4, 16).transpose(1, 2)
        k = (x @ wk.T).view(2, 5, 2, 16).transpose(1, 2)
        q_out, k_out = fn(q, k)
        ((q_out * torch.arange(q_out.numel(), device=DEVICE).view_as(q_out)).sum()
         + (k_out**3).sum()).backward()  # fmt: skip
        return q, q_out, x.grad.clone()

    _, _, grad_ref = run(lambda q, k: apply_rotary_qk_reference(q, k, cos, sin))
    q, q_out, grad_inplace = run(lambda q, k: apply_rotary_qk(q, k, cos, sin))
    assert q_out is q
    _, q_out, grad_outplace = run(lambda q, k: apply_rotary_qk(q, k, cos, sin, inplace=False))
    assert q_out is not q
    torch.testing.assert_close(grad_inplace, grad_ref)
    torch.testing.assert_close(grad_outplace, grad_ref)


def test_inplace_on_leaf_requiring_grad_falls_back_out_of_place():
    torch.manual_seed(11)
    q = torch.randn(1, 2, 5, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 5, 1, 16, device=DEVICE, requires_grad=True).transpose(1, 2)  # view of leaf
    before = q.detach().clone(), k.detach().clone()
    cos, sin = rope_table(5, 16)
    q_out, k_out = apply_rotary_qk(q, k, cos, sin, inplace=True)
    assert q_out is not q and k_out is not k
    assert torch.equal(q.detach(), before[0]) and torch.equal(k.detach(), before[1])
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None


@pytest.mark.parametrize("grad_mode", [True, False])
def test_inplace_never_silently_corrupts_saved_tensors(grad_mode):
    """exp() saves its output; rotating that output in place must make backward raise."""
    x = torch.randn(1, 2, 5, 16, device=DEVICE, requires_grad=True)
    y = x.exp()
    k = torch.randn(1, 1, 5, 16, device=DEVICE)
    cos, sin = rope_table(5, 16)
    with torch.set_grad_enabled(grad_mode):
        apply_rotary_qk(y, k, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------
# Kernel-hub entry: HF's apply_rotary_pos_emb signature
# ---------------------------------------------------------------------------------------------


def _hf_apply_rotary_pos_emb():
    mod = pytest.importorskip("transformers.models.llama.modeling_llama")
    fn = mod.apply_rotary_pos_emb
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_pos_emb_matches_hf(dtype, unsqueeze_dim):
    hf = _hf_apply_rotary_pos_emb()
    torch.manual_seed(12)
    q, k = hf_qk(2, 7, 4, 2, 16, dtype)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cu, pos = packed_positions(2, 7, [7, 3, 4])
    cos, sin = rope_table(8, 16, dtype)
    cos, sin = cos[pos], sin[pos]
    kw = {"unsqueeze_dim": unsqueeze_dim}
    check_fwd_bwd(q, k, cos, sin, ref_fn=hf, kernel_fn=rotary_pos_emb, **kw)


def test_rotary_pos_emb_inplace_only_without_autograd():
    torch.manual_seed(13)
    q, k = hf_qk(1, 6, 2, 1, 16, torch.bfloat16)
    cos, sin = rope_table(6, 16, torch.bfloat16)
    cos, sin = cos[None], sin[None]
    qg, kg = leaf(q), leaf(k)
    before = qg.detach().clone()
    q_out, _ = rotary_pos_emb(qg, kg, cos, sin)  # training: out of place, no CopySlices
    assert q_out is not qg and torch.equal(qg.detach(), before)
    with torch.no_grad():
        q_out, k_out = rotary_pos_emb(q, k, cos, sin)  # inference: in place
    assert q_out is q and k_out is k


def test_rotary_pos_emb_promotes_like_hf():
    """bf16 q with fp32 cos/sin (autocast training) gives fp32 outputs, as HF's math does."""
    hf = _hf_apply_rotary_pos_emb()
    torch.manual_seed(14)
    q, k = hf_qk(1, 6, 2, 1, 16, torch.bfloat16)
    cos, sin = rope_table(6, 16, torch.float32)
    cos, sin = cos[None], sin[None]
    q0 = q.clone()
    with torch.no_grad():
        q_out, k_out = rotary_pos_emb(q, k, cos, sin)
    expect = hf(q0, k, cos, sin)
    assert q_out.dtype == torch.float32 and torch.equal(q, q0)
    torch.testing.assert_close(q_out, expect[0])
    check_fwd_bwd(q, k, cos, sin, ref_fn=hf, kernel_fn=rotary_pos_emb)


# ---------------------------------------------------------------------------------------------
# Bad input, indexing, edge cases
# ---------------------------------------------------------------------------------------------


def _bad_cases():
    q, k = hf_qk(2, 5, 4, 2, 16, torch.float32)
    cos, sin = rope_table(5, 16)
    g_cos, g_sin = cos[None].expand(2, -1, -1), sin[None].expand(2, -1, -1)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)
    return (
        [
            ("q", dict(q=q.double()), TypeError, "q and k must share one dtype"),
            ("k dtype", dict(k=k.half()), TypeError, "share one dtype"),
            ("cos dtype", dict(cos=g_cos.double(), sin=g_sin.double()), TypeError, "cos and sin"),
            ("k ndim", dict(k=k[0]), ValueError, "both be"),
            ("k tokens", dict(k=k[:, :, :3]), ValueError, "match q in batch, tokens"),
            ("k head dim", dict(k=k[..., :8]), ValueError, "match q in batch, tokens and head dim"),
            ("odd rotary", dict(rotary_dim=7), ValueError, "rotary_dim must be even"),
            (
                "rotary > D",
                dict(cos=g_cos.repeat(1, 1, 2), sin=g_sin.repeat(1, 1, 2)),
                ValueError,
                "rotary_dim must be even and in",
            ),
            ("cos width", dict(rotary_dim=8), ValueError, "last dim of cos/sin must equal"),
            ("cos/sin shapes", dict(sin=g_sin[:1]), ValueError, "cos and sin shapes differ"),
            (
                "gathered T",
                dict(cos=g_cos[:, :4], sin=g_sin[:, :4]),
                ValueError,
                "gathered cos/sin",
            ),
            (
                "both positions",
                dict(cos=cos, sin=sin, position_ids=pos, cu_seqlens=cu),
                ValueError,
                "not both",
            ),
            ("table with 3-D cos", dict(cu_seqlens=cu), ValueError, r"\(P, R\) table"),
            (
                "pos dtype",
                dict(cos=cos, sin=sin, position_ids=pos.float()),
                TypeError,
                "position_ids",
            ),
            (
                "pos shape",
                dict(cos=cos, sin=sin, position_ids=pos[:, :4]),
                ValueError,
                "position_ids must be",
            ),
            (
                "cu dtype",
                dict(cos=cos, sin=sin, cu_seqlens=cu.float()),
                TypeError,
                "cu_seqlens must",
            ),
            (
                "cu ndim",
                dict(cos=cos, sin=sin, cu_seqlens=cu[None]),
                ValueError,
                "cu_seqlens must be",
            ),
            ("not a tensor", dict(cos=[1.0]), TypeError, "cos must be a torch.Tensor"),
            ("cos grad", dict(cos=g_cos.clone().requires_grad_()), ValueError, "cos/sin"),
            ("overlap", dict(k=k[:, :1].expand(2, 2, 5, 16)), ValueError, "overlapping memory"),
            ("q is k", dict(k=q), ValueError, "share memory"),
        ],
        q,
        k,
        g_cos,
        g_sin,
    )


def test_bad_inputs_raise_before_launch():
    cases, q, k, g_cos, g_sin = _bad_cases()
    q0, k0 = q.clone(), k.clone()
    for label, override, exc, match in cases:
        args = {"q": q, "k": k, "cos": g_cos, "sin": g_sin, **override}
        tensors = [args.pop(name) for name in ("q", "k", "cos", "sin")]
        with pytest.raises(exc, match=match):
            apply_rotary_qk(*tensors, **args)
        assert torch.equal(q, q0) and torch.equal(k, k0), label
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rotary_pos_emb(q, k, g_cos, g_sin, unsqueeze_dim=0)
    # A valid call in the same process still works after the errors.
    check_fwd_bwd(q, k, g_cos, g_sin)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(rope_ops, "_INTERPRET", False)  # read once at import, like every op
    q, k = hf_qk(1, 3, 2, 1, 8, torch.float32)
    cos, sin = rope_table(3, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        apply_rotary_qk(q, k, cos, sin)


def test_empty_tokens():
    q, k = hf_qk(2, 0, 2, 1, 8, torch.float32)
    cos, sin = rope_table(0, 8)
    q_out, k_out = apply_rotary_qk(q, k, cos, sin, inplace=False)
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_long_indexing_selected_only_past_int32():
    """Host-side choice, evaluated on meta tensors (no memory): int32 for ordinary shapes."""

    def needs_long(seqlen, hq=32, hkv=8, head_dim=128):
        q = torch.empty(1, seqlen, hq, head_dim, device="meta").transpose(1, 2)
        k = torch.empty(1, seqlen, hkv, head_dim, device="meta").transpose(1, 2)
        cos = torch.empty(1, seqlen, head_dim, device="meta")
        cfg = rope_ops._pick_config(hq, hkv, head_dim // 2)
        xs = [(x.shape, x.stride()) for x in (q, k, q, k)]
        cs = [(cos.shape, cos.stride())] * 2
        return rope_ops._needs_long_indexing(
            xs, cs, rope_ops._POS_GATHERED, 1, seqlen, cfg, head_dim // 2, 1
        )

    assert not needs_long(16 * 1024) and not needs_long(256 * 1024)
    assert not needs_long(2**31 // (32 * 128) - 1024)
    assert needs_long(2**31 // (32 * 128) + 1)  # q (1, 32, 524289, 128): past 2^31 elements


@pytest.mark.parametrize("mode", ["gathered", "cu_seqlens"])
def test_long_indexing_path_matches_int32_path(mode):
    """The int64 variant (forced on small tensors) gives the int32 variant's bits."""
    torch.manual_seed(15)
    q, k = hf_qk(2, 6, 2, 1, 16, torch.bfloat16)
    cos, sin = rope_table(12, 16, torch.bfloat16, interleaved=True)
    cu, pos = packed_positions(2, 6, [5, 7])
    if mode == "gathered":
        cos, sin, cu = cos[pos], sin[pos], None
    st = rope_ops._check_inputs(q, k, cos, sin, None, cu, True, None)
    for conjugate in (False, True):
        outs = []
        for force in (False, True):
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            rope_ops._launch(q, k, q_out, k_out, cos, sin, None, cu, st, conjugate=conjugate,
                             force_long_indexing=force)  # fmt: skip
            outs.append((q_out, k_out))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ---------------------------------------------------------------------------------------------
# GPU: bf16 numerics on CUDA, compile count, tensors past 2^31 elements
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gathered", "position_ids", "cu_seqlens"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_bf16_numerics(mode, interleaved):
    torch.manual_seed(16)
    batch, seqlen = 2, 1500
    q, k = hf_qk(batch, seqlen, 32, 8, 128, torch.bfloat16, device="cuda")
    lengths = [37, 700, 1, 262, 1000, 1000]
    cu, pos = packed_positions(batch, seqlen, lengths, device="cuda")
    cos, sin = rope_table(2048, 128, torch.bfloat16, interleaved, device="cuda")
    kw = {"interleaved": interleaved}
    if mode == "gathered":
        cos, sin = cos[pos], sin[pos]
    elif mode == "position_ids":
        kw["position_ids"] = pos
    else:
        kw["cu_seqlens"] = cu
    check_fwd_bwd(q, k, cos, sin, **kw)


@pytest.mark.gpu
def test_gpu_rotary_pos_emb_matches_hf_bf16():
    hf = _hf_apply_rotary_pos_emb()
    torch.manual_seed(17)
    q, k = hf_qk(1, 4096, 32, 8, 128, torch.bfloat16, device="cuda")
    cu, pos = packed_positions(1, 4096, [1000, 3000, 96], device="cuda")
    cos, sin = rope_table(4096, 128, torch.bfloat16, device="cuda")
    check_fwd_bwd(q, k, cos[pos], sin[pos], ref_fn=hf, kernel_fn=rotary_pos_emb)


def _compiled_variants(kernel) -> int | None:
    caches = getattr(kernel, "device_caches", None)
    if not caches:
        return None
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.gpu
def test_gpu_no_recompile_across_token_counts():
    cos, sin = rope_table(8192, 128, torch.bfloat16, device="cuda")
    counts = []
    for seqlen in (100, 1000, 4096, 4097, 8000):
        q, k = hf_qk(1, seqlen, 32, 8, 128, torch.bfloat16, device="cuda")
        cu = torch.tensor([0, seqlen // 3, seqlen], dtype=torch.int32, device="cuda")
        apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu)
        apply_rotary_qk(q, k, cos[:seqlen], sin[:seqlen])
        counts.append(_compiled_variants(rope_kernel.rope_qk_kernel))
    if counts[0] is None:
        pytest.skip("this triton version does not expose its kernel cache")
    assert counts == [counts[0]] * len(counts), f"compiled variants per T: {counts}"


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_past_int32_elements():
    """q (1, 32, T, 128) with T * 32 * 128 > 2^31: int64 path, checked on slices against the
    reference, including a document boundary beyond the 2^31st element."""
    torch.manual_seed(18)
    seqlen = 2**31 // (32 * 128) + 64
    free = torch.cuda.mem_get_info()[0]
    if free < 40 * 2**30:
        pytest.skip(f"needs ~40 GiB free GPU memory, {free / 2**30:.0f} GiB free")
    q, k = hf_qk(1, seqlen, 32, 8, 128, torch.bfloat16, device="cuda")
    assert q.numel() > 2**31
    cu = torch.tensor([0, 100_000, seqlen - 40, seqlen], dtype=torch.int32, device="cuda")
    cos, sin = rope_table(seqlen, 128, torch.float32, device="cuda")
    st = rope_ops._check_inputs(q, k, cos, sin, None, cu, False, None)
    cfg = rope_ops._pick_config(32, 8, 64)
    xs = [(x.shape, x.stride()) for x in (q, k, q, k)]
    cs = [(cos.shape, cos.stride()), (sin.shape, sin.stride())]
    assert rope_ops._needs_long_indexing(xs, cs, st.pos_mode, 1, seqlen, cfg, 64, 1)
    pos = positions_from_cu_seqlens(cu, seqlen)
    slices = [slice(0, 64), slice(99_970, 100_030), slice(seqlen - 100, seqlen)]
    saved = [(q[:, :, s].clone(), k[:, :, s].clone()) for s in slices]

    q_leaf, k_leaf = q.detach().requires_grad_(), k.detach().requires_grad_()  # out of place
    q_out, k_out = apply_rotary_qk(q_leaf, k_leaf, cos, sin, cu_seqlens=cu)
    g = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q_leaf, k_leaf), g)
    for s, (qs, ks) in zip(slices, saved):
        c, si = cos[pos[s]], sin[pos[s]]
        for name, got, x, up in (("q", (q_out, dq), qs, g[0]), ("k", (k_out, dk), ks, g[1])):
            refs = {}
            for prec, cast in (("hi", torch.float64), ("lo", None)):  # lo: HF's promotion
                xr = (x.clone() if cast is None else x.to(cast)).requires_grad_()
                cc, ss = (c, si) if cast is None else (c.to(cast), si.to(cast))
                out = apply_rotary_qk_reference(xr, xr, cc, ss)[0]
                (grad,) = torch.autograd.grad(out, xr, up[:, :, s].to(out.dtype))
                refs[prec] = (out, grad)
            assert_numerics(f"{name}_out{s}", got[0][:, :, s], refs["hi"][0], refs["lo"][0])
            assert_numerics(f"d{name}{s}", got[1][:, :, s], refs["hi"][1], refs["lo"][1], factor=3)
    del q_out, k_out, dq, dk, g
    with torch.no_grad():  # in place, int64 path
        apply_rotary_qk(q, k, cos, sin, cu_seqlens=cu)
    s = slices[-1]
    expect = apply_rotary_qk_reference(saved[-1][0].double(), saved[-1][1].double(), cos[pos[s]].double(),
                                 sin[pos[s]].double())  # fmt: skip
    lo = apply_rotary_qk_reference(saved[-1][0], saved[-1][1], cos[pos[s]], sin[pos[s]])
    assert_numerics("q in place tail", q[:, :, s], expect[0], lo[0])
    assert_numerics("k in place tail", k[:, :, s], expect[1], lo[1])
    assert math.isfinite(q[:, :, -1].float().sum().item())
