"""Triton varlen attention (hf_varlen/ops/attention/, backend "triton") against the reference.

CPU: the kernels run under TRITON_INTERPRET=1 (set by conftest.py) in fp32/fp16 with small shapes
(the interpreter's bf16 tl.dot is broken). GPU (marked): bf16 numerics through the public
functional, head dims up to 256, int64 offsets, 10,000 tiny documents, compile count, determinism.
"""

from __future__ import annotations

import pytest
import torch
from attn_cases import check_backend_against_reference, cu_from_lengths, make_qkv, record_calls

from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.ops.attention.schedule import EMPTY_LO, get_plan, heaviest_first, row_bounds
from hf_varlen.reference.attention import attention_reference, visibility_mask
from hf_varlen.testing import assert_numerics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(fn, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def check(lengths, h_q, h_kv, d, dtype, *, lengths_k=None, seed=0, **kw):
    """Kernel vs reference (hi: fp64, lo: input dtype) under the numerics rule, fwd and bwd."""
    lengths_k = lengths_k or lengths
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths), h_q, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(lengths_k), h_kv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(lengths_k), h_kv, d, generator=g).to(DEVICE, dtype)
    cu_q, cu_k = cu_from_lengths(lengths, DEVICE), cu_from_lengths(lengths_k, DEVICE)
    grad_out = torch.randn(q.shape, generator=g).to(DEVICE, dtype)
    got = _run(
        lambda a, b, c: triton_varlen_attention(a, b, c, cu_q, cu_k, **kw), q, k, v, grad_out
    )
    ref = lambda a, b, c: attention_reference(a, b, c, cu_q, cu_k, **kw)  # noqa: E731
    lo = _run(ref, q, k, v, grad_out)
    hi = _run(ref, *(t.double() for t in (q, k, v, grad_out)))
    # Each output and gradient sums over a document's rows (out, dq over its keys; dk, dv over its
    # queries). In fp32 the kernel rounds every partial sum in the output's dtype, in its own
    # (blockwise) order, so the rule's reduction floor applies (hf_varlen/testing.py, ``terms``);
    # the fp32 reference's one-matmul error alone is no yardstick for that (dv of [9, 20] x 80:
    # 3.7x it on one seed, 0.96-2.1x on three others, the split and fused backward alike). In
    # fp16/bf16 the kernel accumulates in fp32 and rounds once: one term.
    terms = max(1, *lengths, *lengths_k) if dtype == torch.float32 else 1
    for name, x, h, low, factor in zip(("out", "dq", "dk", "dv"), got, hi, lo, (2, 3, 3, 3)):
        assert_numerics(f"triton {name} {lengths[:6]} {kw}", x, h, low, factor=factor, terms=terms)
    return got


# ---- the tile schedule (pure torch) -------------------------------------------------------------


@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, -1)), (False, (2, 5))]
)
def test_row_bounds_match_visibility_mask(causal, window):
    lq, lk = [5, 0, 9, 1, 4], [5, 2, 6, 1, 7]
    cu_q, cu_k = cu_from_lengths(lq), cu_from_lengths(lk)
    left, right = window
    if causal:
        right = 0
    lo, hi, qlo, qhi = row_bounds(cu_q, cu_k, sum(lq), sum(lk), left, right)
    dense = torch.zeros(sum(lq), sum(lk), dtype=torch.bool)
    for i in range(len(lq)):
        q0, k0 = sum(lq[:i]), sum(lk[:i])
        m = visibility_mask(lq[i], lk[i], causal=causal, window_size=window)
        dense[q0 : q0 + lq[i], k0 : k0 + lk[i]] = m
    cols = torch.arange(sum(lk))
    rows = torch.arange(sum(lq))
    assert torch.equal((cols[None] >= lo[:, None]) & (cols[None] <= hi[:, None]), dense)
    assert torch.equal((rows[None] >= qlo[:, None]) & (rows[None] <= qhi[:, None]), dense.T)
    empty = ~dense.any(1)
    assert (lo[empty] == EMPTY_LO).all() and (hi[empty] == -1).all()


def test_heaviest_first_and_plan_cache():
    lengths = [3, 200, 5, 40]
    cu = cu_from_lengths(lengths)
    lo, hi, _, _ = row_bounds(cu, cu, 248, 248, -1, 0)
    order = heaviest_first(lo, hi, 16)
    assert order[-1] == 16  # the never-launched extra entry (see heaviest_first)
    order = order[:-1]
    assert sorted(order.tolist()) == list(range(16))  # a permutation of all ceil(248/16) tiles
    span = [
        int(hi[t * 16 : t * 16 + 16].max() - lo[t * 16 : t * 16 + 16].min() + 1) for t in range(16)
    ]
    assert [span[t] for t in order.tolist()] == sorted(span, reverse=True)
    assert order[0] == 12  # the last tile of the 200-token document holds the most work
    plan = get_plan(cu, cu, 248, 248, -1, 0)
    assert get_plan(cu, cu, 248, 248, -1, 0) is plan  # same tensor object: reused by every layer
    assert get_plan(cu.clone(), cu, 248, 248, -1, 0) is not plan
    assert plan.order_q(16) is plan.order_q(16)


# ---- numerics against the reference (interpreter on CPU) ----------------------------------------


@pytest.mark.parametrize("lengths", [[1, 2, 113], [5, 17, 33, 7, 1], [70]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(lengths, dtype):
    check(lengths, 4, 2, 32, dtype)


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_mqa_causality(h_q, h_kv, causal):
    check([11, 1, 30], h_q, h_kv, 16, torch.float32, causal=causal)


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_head_dims(d):
    check([9, 20], 2, 1, d, torch.float16)


@pytest.mark.parametrize(
    "window,causal", [((7, -1), True), ((7, 3), False), ((1, 1), False), ((4000, -1), True)]
)
def test_sliding_window(window, causal):
    check([40, 3, 20], 4, 2, 16, torch.float32, causal=causal, window_size=window)


def test_softcap_and_scale():
    check([20, 35], 4, 2, 16, torch.float32, softcap=0.5, softmax_scale=0.3)


@pytest.mark.parametrize("causal", [True, False])
def test_different_query_and_key_lengths(causal):
    # bottom-right causal alignment; the 12-query / 7-key document has queries that see nothing
    check([4, 12, 0, 6], 2, 1, 16, torch.float32, lengths_k=[9, 7, 3, 6], causal=causal)


def test_many_tiny_documents():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 5, (150,), generator=g).tolist()
    check(lengths, 2, 1, 16, torch.float32)


def test_no_cross_contamination_bit_exact():
    lengths = [13, 9, 20]  # 16-token tiles on CPU: documents share tiles
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    g = torch.randn_like(q)
    fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu)  # noqa: E731
    base = _run(fn, q, k, v, g)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[13:22] = torch.randn_like(t[13:22]) * 3
    pert = _run(fn, q2, k2, v2, g)
    keep = torch.cat([torch.arange(0, 13), torch.arange(22, 42)]).to(DEVICE)
    for a, b in zip(base, pert):
        assert torch.equal(a[keep], b[keep])


def test_packed_equals_each_document_alone():
    lengths = [12, 50, 7]
    q, k, v = make_qkv(lengths, 4, 4, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    packed = triton_varlen_attention(q, k, v, cu, cu)
    start = 0
    for n in lengths:
        one = cu_from_lengths([n], DEVICE)
        sl = slice(start, start + n)
        alone = triton_varlen_attention(q[sl], k[sl], v[sl], one, one)
        torch.testing.assert_close(packed[sl], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_strided_views_noncontiguous_grad_and_inputs_untouched():
    lengths = [20, 13]
    total = sum(lengths)
    cu = cu_from_lengths(lengths, DEVICE)
    # HF layout: (1, H, T, D) made by transpose(1, 2) -> (T, H, D) views with a large head stride
    q = torch.randn(1, 4, total, 16, device=DEVICE).transpose(1, 2)[0]
    kv = torch.randn(1, total, 2, 2, 16, device=DEVICE)
    k, v = kv[0, :, :, 0], kv[0, :, :, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    grad = torch.randn(16, 4, total, device=DEVICE).permute(2, 1, 0)
    copies = [t.clone() for t in (q, k, v)]
    got = _run(lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu), q, k, v, grad)
    want = _run(
        lambda a, b, c: attention_reference(a, b, c, cu, cu),
        q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous(),
    )  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


def test_out_of_bounds_probe_nan_buffers():
    lengths = [9, 23]
    total = sum(lengths)
    cu = cu_from_lengths(lengths, DEVICE)
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32, DEVICE)
    g = torch.randn_like(q)
    views = []
    for t in (q, k, v, g):
        buf = torch.full((total + 40, t.shape[1] + 2, 16 + 8), float("nan"), device=DEVICE)
        buf[20 : 20 + total, 1 : 1 + t.shape[1], 4:20] = t
        views.append(buf[20 : 20 + total, 1 : 1 + t.shape[1], 4:20])
    fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu)  # noqa: E731
    got = _run(fn, *views)
    want = _run(fn, q, k, v, g)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_backward_bitwise_repeatable_in_every_mode(monkeypatch):
    lengths = [21, 40, 4]
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    g = torch.randn_like(q)
    fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu, deterministic=True)  # noqa: E731
    runs = [_run(fn, q, k, v, g), _run(fn, q, k, v, g)]
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    runs.append(_run(lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu), q, k, v, g))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


FUSED_CASES = {
    "mixed": ([1, 2, 113], 4, 2, 32, {}),
    "gqa8": ([11, 1, 30], 8, 1, 16, {}),
    "noncausal": ([11, 1, 30], 6, 2, 16, dict(causal=False)),
    "window": ([40, 3, 20], 4, 2, 16, dict(window_size=(7, 3), causal=False)),
    "softcap": ([20, 35], 4, 2, 16, dict(softcap=0.5, softmax_scale=0.3)),
    "head_dim80": ([9, 20], 2, 1, 80, {}),
    "qk_lengths": ([4, 12, 0, 6], 2, 1, 16, dict(lengths_k=[9, 7, 3, 6])),
}


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_backward_matches_reference(fused_backward, case):
    lengths, h_q, h_kv, d, kw = FUSED_CASES[case]
    check(lengths, h_q, h_kv, d, torch.float32, **kw)


def test_fused_backward_many_tiny_documents_fp16(fused_backward):
    g = torch.Generator().manual_seed(1)
    check(torch.randint(1, 5, (150,), generator=g).tolist(), 2, 1, 16, torch.float16)


def test_deterministic_request_takes_the_split_backward(fused_backward, monkeypatch):
    """The fused backward sums dQ with atomics; a deterministic request never gets it."""
    from hf_varlen.ops.attention import bwd as attention_bwd

    launched = []
    for name in ("backward_dq", "backward_delta"):
        real = getattr(attention_bwd, name)
        monkeypatch.setattr(
            attention_bwd,
            name,
            lambda *a, _n=name, _r=real, **k: (launched.append(_n), _r(*a, **k)),
        )
    lengths = [21, 40, 4]
    q, k, v = make_qkv(lengths, 4, 2, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    g = torch.randn_like(q)
    _run(lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu, deterministic=True), q, k, v, g)
    assert set(launched) == {"backward_dq"}  # twice with a long path: short and long tiles
    launched.clear()
    _run(lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu), q, k, v, g)
    assert launched == ["backward_delta"]


@pytest.mark.parametrize("backward", ["split", "fused"])
def test_int64_indexing_path_matches_reference(backward, monkeypatch, request):
    """The LONG_INDEXING kernels (int64 offsets, taken past 2^31 elements: a GPU-only size) on a
    small pack, forced on: the same numbers as the int32 path's reference check."""
    from hf_varlen.ops.attention import bwd as attention_bwd
    from hf_varlen.ops.attention import fwd as attention_fwd

    if backward == "fused":
        request.getfixturevalue("fused_backward")
    for module in (attention_fwd, attention_bwd):
        monkeypatch.setattr(module, "needs_long_indexing", lambda *tensors: True)
    check([5, 17, 33], 4, 2, 16, torch.float32)


def test_tuning_override_sets_the_fused_backward(tmp_path, monkeypatch):
    from hf_varlen.ops.attention import schedule as sched

    cfg = [128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 2, 8]
    path = tmp_path / "cfg.json"
    path.write_text(f'{{"128": {cfg + [1]}, "64": {cfg}}}')
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    assert sched._overrides()[128].bwd_fused is True
    assert sched._overrides()[64].bwd_fused is False


def test_dkdv_pipeline_stages_follow_the_gqa_fold(tmp_path, monkeypatch):
    """Head dim 128 ships 3 dK/dV stages where heads fold into the steps, 2 where none do (H200
    run N); a tuning override's 17th entry sets the unfolded depth."""
    from hf_varlen.ops.attention import schedule as sched

    c128, c64 = sched._CUDA_CONFIGS[128], sched._CUDA_CONFIGS[64]
    assert (c128.kv_stages_at(4), c128.kv_stages_at(2), c128.kv_stages_at(1)) == (3, 3, 2)
    assert (c64.kv_stages_at(4), c64.kv_stages_at(1)) == (2, 2)
    cfg = [128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 3, 8]
    path = tmp_path / "cfg.json"
    path.write_text(f'{{"128": {cfg + [0, 1]}, "64": {cfg}}}')
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    assert sched._overrides()[128].kv_stages_at(1) == 1
    assert sched._overrides()[128].kv_stages_at(4) == 3
    assert sched._overrides()[64].kv_stages_at(1) == 3
    bad = tmp_path / "bad.json"
    bad.write_text(f'{{"128": {cfg + [0, -1]}}}')
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(bad))
    with pytest.raises(ValueError, match="bad.json: 128: .*kv_stages_unfolded must be an int >= 0"):
        sched._overrides()


@pytest.mark.parametrize("h_q, h_kv, fold_stages", [(2, 2, 1), (4, 2, 2)])
def test_dkdv_launch_takes_the_stages_of_its_fold(h_q, h_kv, fold_stages, monkeypatch):
    """The backward launches dK/dV with ``kv_stages_at(fold)``: unfolded MHA steps get
    kv_stages_unfolded, folded GQA steps kv_stages."""
    import dataclasses

    from hf_varlen.ops.attention import bwd as attention_bwd
    from hf_varlen.ops.attention import launch as attention
    from hf_varlen.ops.attention import schedule as attention_schedule

    cfg = dataclasses.replace(attention_schedule._INTERPRETER_CONFIG, kv_stages=2,
                              kv_stages_unfolded=1)  # fmt: skip
    monkeypatch.setattr(attention, "pick_config", lambda *a: cfg)
    monkeypatch.setattr(attention, "pick_long_path", lambda *a: None)
    stages = record_calls(
        monkeypatch, attention_bwd, "backward_dkdv", lambda *a, **k: (k["fold"], k["num_stages"])
    )
    check([21, 40, 4], h_q, h_kv, 16, torch.float32)
    fold = h_q // h_kv
    assert stages and set(stages) == {(fold, fold_stages)}


def test_lse_is_returned():
    lengths = [6, 1, 0, 9]
    q, k, v = make_qkv(lengths, 2, 1, 16, torch.float32, DEVICE)
    cu = cu_from_lengths(lengths, DEVICE)
    out, lse = triton_varlen_attention(q, k, v, cu, cu, return_lse=True)
    assert lse.shape == (2, 16) and lse.dtype == torch.float32
    s = torch.einsum("hd,hd->h", q[6].double(), k[6].double()) * 16**-0.5  # a 1-token document
    torch.testing.assert_close(lse[:, 6].double(), s, rtol=1e-5, atol=1e-5)


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(cu_q=a["cu_q"].long()), TypeError, "cu_seqlens_q must be int32"),
        (lambda a: a.update(cu_k=a["cu_k"][None]), ValueError, "cu_seqlens_k must be 1-D"),
        (lambda a: a.update(cu_k=a["cu_k"][:2]), ValueError, "same length"),
        (lambda a: a.update(k=a["k"][:, :1].expand(-1, 3, -1), v=a["v"][:, :1].expand(-1, 3, -1)),
         ValueError, "multiple of the number of KV heads"),
        (lambda a: a.update(v=a["v"].half()), TypeError, "share a dtype"),
        (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q.dtype must be one of"),
        (lambda a: a.update(q=a["q"][..., :8]), ValueError, "head_dim of q"),
        (lambda a: a.update(q=torch.zeros(10, 4, 300), k=torch.zeros(10, 2, 300), v=torch.zeros(10, 2, 300)),
         ValueError, "head_dim must be in"),
        (lambda a: a.update(q=a["q"][0]), ValueError, "q must be a 3-D tensor"),
        (lambda a: a.update(dropout_p=0.1), ValueError, "dropout_p"),
        (lambda a: a.update(window_size=(3,)), ValueError, "window_size must be a pair"),
        (lambda a: a.update(window_size=(-2, 0)), ValueError, "window_size entries must be >= -1"),
        (lambda a: a.update(softcap=-1.0), ValueError, "softcap must be >= 0"),
    ],
)  # fmt: skip
def test_bad_input_raises_before_launch(mutate, exc, match):
    q, k, v = make_qkv([4, 6], 4, 2, 16, torch.float32, DEVICE)
    cu = cu_from_lengths([4, 6], DEVICE)
    args = dict(q=q, k=k, v=v, cu_q=cu, cu_k=cu)
    mutate(args)
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_q", "cu_k")]
    with pytest.raises(exc, match=match):
        triton_varlen_attention(*pos, **args)
    assert torch.isfinite(triton_varlen_attention(q, k, v, cu, cu)).all()  # still usable


# ---- GPU: bf16, large shapes, compile count ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1, 2, 113, 1023, 1024, 2048], [2048], [300] * 7 + [5]])
@pytest.mark.parametrize("h_q,h_kv", [(32, 8), (16, 16), (40, 8), (8, 1)])
def test_gpu_bf16_matches_reference(lengths, h_q, h_kv):
    check_backend_against_reference("triton", lengths, h_q, h_kv, 128, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims_dtypes(d, dtype):
    check_backend_against_reference("triton", [77, 500, 3, 1000], 8, 2, d, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(window=(128, -1)), dict(window=(64, 32), causal=False),
                                dict(softcap=30.0), dict(causal=False)])  # fmt: skip
def test_gpu_window_softcap_noncausal(kw):
    check_backend_against_reference(
        "triton", [700, 90, 1500, 1], 16, 4, 128, torch.bfloat16, "cuda", **kw
    )


@pytest.mark.gpu
def test_gpu_ten_thousand_tiny_documents():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 5, (10_000,), generator=g).tolist()
    check_backend_against_reference("triton", lengths, 16, 4, 128, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_int64_offsets_past_2_pow_31():
    # T * H_q * D > 2^31: offsets need int64 (LONG_INDEXING); check the last documents exactly.
    h_q, h_kv, d = 32, 8, 128
    total = 2**31 // (h_q * d) + 4096
    lengths = [512] * (total // 512) + [total % 512]
    cu = cu_from_lengths(lengths, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = triton_varlen_attention(q, k, v, cu, cu)
    out.backward(torch.ones_like(out))
    tail = slice(total - 512 - total % 512, total)
    cu_t = cu_from_lengths([512, total % 512], "cuda")
    qt, kt, vt = (t.detach()[tail].float().requires_grad_(True) for t in (q, k, v))
    ref = attention_reference(qt, kt, vt, cu_t, cu_t)
    ref.backward(torch.ones_like(ref))
    for name, x, r in (
        ("out", out[tail], ref),
        ("dq", q.grad[tail], qt.grad),
        ("dk", k.grad[tail], kt.grad),
    ):
        err = (x.float() - r).abs().max().item()
        assert err < 0.05 * max(1.0, r.abs().max().item()), f"{name}: max error {err}"


def _n_compiled() -> int:
    from hf_varlen.ops.attention import bwd as attention_bwd
    from hf_varlen.ops.attention import fwd as attention_fwd

    kernels = (
        attention_fwd._attn_fwd_kernel,
        attention_bwd._attn_bwd_dq_kernel,
        attention_bwd._attn_bwd_dkdv_kernel,
    )
    return sum(len(entry[0]) for kern in kernels for entry in kern.device_caches.values())


@pytest.mark.gpu
def test_gpu_no_recompile_across_packs():
    def step(lengths):
        q, k, v = make_qkv(lengths, 32, 8, 128, torch.bfloat16, "cuda")
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        cu = cu_from_lengths(lengths, "cuda")
        triton_varlen_attention(q, k, v, cu, cu).sum().backward()

    step([100, 28])
    before = _n_compiled()
    g = torch.Generator().manual_seed(3)
    for n_docs in (1, 7, 64, 333):
        lengths = torch.randint(1, 700, (n_docs,), generator=g).tolist()
        step(lengths)  # varying T (odd and even), max_seqlen and document count
    assert _n_compiled() == before


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths,h_q,h_kv,d,kw",
    [
        ([1, 2, 113, 1023, 1024, 2048], 32, 8, 128, {}),
        ([4096], 16, 16, 64, {}),
        ([700, 90, 1500, 1], 16, 4, 128, dict(softcap=30.0)),
        ([700, 90, 1500, 1], 16, 4, 128, dict(window=(64, 32), causal=False)),
        ([77, 500, 3, 1000], 8, 2, 256, {}),
    ],
)
def test_gpu_fused_backward_bf16_matches_reference(fused_backward, lengths, h_q, h_kv, d, kw):
    check_backend_against_reference("triton", lengths, h_q, h_kv, d, torch.bfloat16, "cuda", **kw)


@pytest.mark.gpu
def test_gpu_deterministic_torch_flag():
    q, k, v = make_qkv([3000, 77, 1200], 32, 8, 128, torch.bfloat16, "cuda")
    cu = cu_from_lengths([3000, 77, 1200], "cuda")
    g = torch.randn_like(q)
    torch.use_deterministic_algorithms(True)
    try:
        fn = lambda a, b, c: triton_varlen_attention(a, b, c, cu, cu)  # noqa: E731
        first, second = _run(fn, q, k, v, g), _run(fn, q, k, v, g)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
