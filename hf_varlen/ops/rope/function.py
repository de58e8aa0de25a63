"""Fused rotary position embedding (RoPE) for q and k: one Triton launch, in place, varlen.

Math (per token at position p, per head, on the first ``R = rotary_dim`` of ``D`` features)::

    forward    y1 = x1 * c1 - x2 * s1        y2 = x2 * c2 + x1 * s2
    backward  dx1 = g1 * c1 + g2 * s2       dx2 = g2 * c2 - g1 * s1     (the transposed rotation)

where, in the half layout of HF's ``rotate_half``, ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``,
``c1 = cos[p, :R/2]``, ``c2 = cos[p, R/2:R]`` (same for s), and in the interleaved layout
``x1 = x[0:R:2]``, ``x2 = x[1:R:2]`` with cos/sin split the same way. Features R..D-1 pass through.
This is exactly ``x * cos + rotate(x) * sin`` of HF's ``apply_rotary_pos_emb`` for any cos/sin; the
backward is the same kernel with the conjugate rotation (sin -> -sin, halves swapped), which HF's
cos/sin (both halves equal) make the classic "negate sin".

Rounding: HF evaluates ``(x * cos) + (rotate_half(x) * sin)`` in the input dtype (two rounded
products, one rounded sum). The kernel computes in fp32 and rounds once, so it is at least as close
to the exact result as HF is (the numerics rule of hf_varlen/testing.py).

Shape legend: B batch, T tokens per row, Hq / Hkv query / key heads, D head dim, R rotary dim,
P rows of a cos/sin table, N packed documents.
- q: (B, Hq, T, D), usually HF's strided view ``q_proj(x).view(B, T, Hq, D).transpose(1, 2)``,
  or packed (T, Hq, D); k: (B, Hkv, T, D) or (T, Hkv, D). Any strides; nothing is copied.
- cos, sin: already gathered (B, T, R), (1, T, R) or (T, R); or a table (P, R) with positions
  from ``position_ids`` (B, T) / (1, T), or from ``cu_seqlens`` (N + 1,): positions restart at 0
  at every document of the batch-major flattened B * T tokens, found in-kernel by a binary
  search (no host sync).

In place and autograd: without autograd recording, ``inplace=True`` overwrites q and k. When
autograd records, in-place works on non-leaf tensors (``mark_dirty``), but in-place on HF's view
of the projection output makes autograd route the gradient through ``CopySlices`` and
``AsStridedBackward`` copies (backward measured 6x slower on an H200 at 64K tokens), so
``rotary_pos_emb`` (the kernel-hub entry) rotates out of place whenever autograd records. Leaves
that require grad can never be written in place: ``apply_rotary_qk`` then rotates out of place.
Nothing autograd saved is overwritten silently: in-place calls bump the version counters, so a
saved tensor that was written raises in backward as with any in-place torch op.

Indexing: int32 offsets; ``LONG_INDEXING`` (int64) is chosen on the host when any offset the launch
can form reaches 2^31 (e.g. B * T * H * D of a q with 500K+ tokens).

Registered ops (what torch.compile sees; ``triton_op`` on a GPU, so Inductor traces the launch):
``torch.ops.hf_varlen.rope_qk`` (out of place, both outputs token-major; autograd through
``register_autograd``: the backward is the same op with ``conjugate=True``) and ``rope_qk_``
(in place, ``mutates_args=("q", "k")``, no autograd: used only when autograd does not record).
The public functions call them only while torch.compile traces (``library.compiling()``); eager
calls keep the ``autograd.Function`` path, because a registered op's dispatch costs ~20 us more
host time per call (CPU, torch 2.13, tiny tensor with autograd recording: 28 us vs 8 us) and the
eager step is host-bound. Under tracing: ``rotary_pos_emb`` always rotates out of place (its
in-place shortcut needs storage addresses, which a traced graph has not; Inductor plans the
buffers); ``apply_rotary_qk(inplace=True)`` uses ``rope_qk_`` when autograd does not record (the
overlap checks need storage addresses and are skipped) and, when it records, rotates out of place
(whether q is a view of a leaf cannot be asked while tracing): as documented, use the returned
tensors. The config cache is an ``lru_cache`` on ints only.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.autograd.graph import increment_version

from .._triton_common import INT32_LIMIT, kernel_op, launcher
from .._triton_common import INTERPRET as _INTERPRET
from ..common import check_int
from ..library import compiling
from .kernel import rope_qk_kernel

__all__ = ["apply_rotary_qk", "rotary_pos_emb"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POS_GATHERED, _POS_IDS, _POS_CU = 0, 1, 2


# ----------------------------------------------------------------------------------------------
# Host side: configuration, validation, launch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    """Tile of one program: BLOCK_T tokens x BLOCK_H heads x the rotary features."""

    block_t: int
    block_h: int
    num_warps: int


_TILE_ELEMENTS = 4096  # per half tile: ~16 KB of bf16 q/k in flight per program
_config_override: _Config | None = None  # set by scripts/bench_rope.py --sweep only


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pick_config(hq: int, hkv: int, block_half: int) -> _Config:
    """Depends on head counts and head dim only (never on T): no recompiles as T varies."""
    # int(): under tracing with dynamic shapes a head count may arrive as a SymInt, which the
    # lru_cache cannot hash (head counts never vary, so specialising on them costs nothing)
    return _config_override or _default_config(int(hq), int(hkv), int(block_half))


@functools.lru_cache(maxsize=64)
def _default_config(hq: int, hkv: int, block_half: int) -> _Config:
    # Measured on H200 (scripts/bench_rope.py --sweep, q 32 x 128, k 8 x 128): 16 tokens x 4 heads
    # x 64 pairs with 4 warps was the best tile at 16K and 64K tokens. Groups are no wider than
    # the smaller head count, so GQA's few k heads waste no lanes.
    block_h = min(4, _next_pow2(min(hq, hkv) if hkv else hq))
    block_t = max(1, min(64, _TILE_ELEMENTS // (block_h * block_half)))
    return _Config(block_t, block_h, 4)


@dataclass(frozen=True)
class _Static:
    """Non-tensor settings of one call (shared by forward and backward)."""

    interleaved: bool
    rotary_dim: int
    pos_mode: int


def _as_bhtd(x: torch.Tensor) -> torch.Tensor:
    """(T, H, D) packed -> (1, H, T, D) view; (B, H, T, D) unchanged."""
    return x.transpose(0, 1)[None] if x.dim() == 3 else x


def _empty_token_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New tensor shaped like x whose memory is (B, T, H, D)-ordered, as HF's projections are, so
    the views and reshapes that follow (attention, the projections' backward) stay copy-free."""
    if x.dim() == 3:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    b, h, t, d = x.shape
    return torch.empty((b, t, h, d), dtype=dtype, device=x.device).transpose(1, 2)


def _needs_long_indexing(xs, cs, pos_mode, batch, seqlen, cfg, block_half, block_pass):
    """True when an offset the launch can form (padded blocks included) may reach 2^31.
    ``xs``: (shape, strides) of the (B, H, T, D) tensors; ``cs``: the same for cos and sin.
    Plain arithmetic, strides fetched once: this runs on every call. Each offset is compared with
    the limit on its own, never with another: under torch.compile T is symbolic, and "which tensor
    reaches furthest" is a guard whose answer flips with T (a recompile), while "below 2^31" holds
    for every pack."""
    offs = []
    pad_d = 2 * block_half + block_pass
    for (b, h, t, d), (sb, sh, st, sd) in xs:
        offs.append(
            (b - 1) * sb + (h + cfg.block_h) * sh + (t + cfg.block_t) * st + (d + pad_d) * sd
        )
    for shape, stride in cs:  # gathered rows (B, T, R) or table rows (P, R), padded in tokens
        if len(shape) == 2:
            offs.append((shape[0] + cfg.block_t) * stride[0] + pad_d * stride[1])
        else:
            offs.append(
                (shape[0] - 1) * stride[0] + (seqlen + cfg.block_t) * stride[1] + pad_d * stride[2]
            )
    if pos_mode == _POS_CU:
        offs.append((batch + 1) * seqlen + cfg.block_t)
    return any(off >= INT32_LIMIT for off in offs)


def _search_steps(n_docs) -> int:
    """Binary-search steps over n_docs offsets. A symbolic count (torch.compile with a dynamic
    number of documents) must not be specialised: then the int32 bound, 31 steps (extra steps
    leave the search where it converged)."""
    return max(1, n_docs.bit_length()) if isinstance(n_docs, int) else 31


def _launch(q, k, q_out, k_out, cos, sin, pos, cu, st: _Static, *, conjugate: bool,
            force_long_indexing: bool = False, traced: bool = False) -> None:  # fmt: skip
    """Write rot(q) into q_out and rot(k) into k_out (the same tensors when in place); k and
    k_out may be None to rotate q alone. ``traced``: launch through ``launcher`` (inside the
    registered ops). In place means ``q_out is q`` (identity, not storage: works on fake tensors)."""
    in_place = q_out is q
    kernel = launcher(rope_qk_kernel, q) if traced else rope_qk_kernel
    hkv = None
    if k is None:  # no k heads: q stands in as a never-read dummy
        k, k_out, hkv = q, q_out, 0
    if q.dim() == 3:
        q, k, q_out, k_out = (_as_bhtd(x) for x in (q, k, q_out, k_out))
    batch, hq, seqlen, head_dim = q.shape
    hkv = k.shape[1] if hkv is None else hkv
    if batch == 0 or seqlen == 0:
        return
    half = st.rotary_dim // 2
    block_half = _next_pow2(half)
    n_pass = head_dim - st.rotary_dim
    copy_pass = n_pass > 0 and not in_place
    block_pass = _next_pow2(n_pass) if copy_pass else 1
    cfg = _pick_config(hq, hkv, block_half)

    # Strides read once (each .stride() call costs host time on every launch).
    sq, sk = q.stride(), k.stride()
    sqo = sq if q_out is q else q_out.stride()
    sko = sk if k_out is k else k_out.stride()
    sc, ss = cos.stride(), sin.stride()
    if cos.dim() == 2:  # (T, R) gathered or (P, R) table: no batch stride
        sc3, ss3 = (0, *sc), (0, *ss)
    else:  # (B or 1, T, R): a single row broadcasts over the batch
        sc3 = (sc[0] if cos.shape[0] > 1 else 0, sc[1], sc[2])
        ss3 = (ss[0] if sin.shape[0] > 1 else 0, ss[1], ss[2])
    stride_pb, stride_pt = (0, 0)
    if pos is not None:
        stride_pb = pos.stride(0) if pos.shape[0] > 1 else 0
        stride_pt = pos.stride(1)
    n_docs = cu.shape[0] - 1 if cu is not None else 1
    long_indexing = force_long_indexing or _needs_long_indexing(
        ((q.shape, sq), (k.shape, sk), (q_out.shape, sqo), (k_out.shape, sko)),
        ((cos.shape, sc), (sin.shape, ss)), st.pos_mode, batch, seqlen, cfg, block_half,
        block_pass,
    )  # fmt: skip
    n_groups = _cdiv(hq, cfg.block_h) + _cdiv(hkv, cfg.block_h)
    grid = (n_groups * _cdiv(seqlen, cfg.block_t) * batch,)
    # Triton launches on the current device: switch only when q lives elsewhere.
    on_other_gpu = q.is_cuda and q.device.index != torch.cuda.current_device()
    # fmt: off
    with torch.cuda.device(q.device) if on_other_gpu else nullcontext():
        kernel[grid](
            q, q_out, k, k_out, cos, sin,
            pos if pos is not None else cos, cu if cu is not None else cos,  # unused dummies
            seqlen, hq, hkv, n_docs, _search_steps(n_docs),
            *sq, *sqo, *sk, *sko, *sc3, *ss3, stride_pb, stride_pt,
            HALF=half, PASS=n_pass, COPY_PASS=copy_pass,
            BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
            POS_MODE=st.pos_mode, INTERLEAVED=st.interleaved, CONJUGATE=conjugate,
            LONG_INDEXING=long_indexing, num_warps=cfg.num_warps,
        )
    # fmt: on


def _check_inputs(q, k, cos, sin, position_ids, cu_seqlens, interleaved, rotary_dim) -> _Static:
    """Validate everything before any launch; returns the call's static settings."""
    fn = "apply_rotary_qk"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(
            f"{fn}: q and k must both be (B, H, T, D) or both packed (T, H, D), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        raise TypeError(
            f"{fn}: q and k must share one dtype among float16, bfloat16, float32, got q "
            f"{q.dtype} and k {k.dtype}"
        )
    if cos.dtype not in _FLOAT_DTYPES or sin.dtype != cos.dtype:
        raise TypeError(
            f"{fn}: cos and sin must share one dtype among float16, bfloat16, float32, got cos "
            f"{cos.dtype} and sin {sin.dtype}"
        )
    dev = q.device
    others = {
        "k": k,
        "cos": cos,
        "sin": sin,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
    }
    for name, t in others.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {dev}")
    if dev.type != "cuda" and not _INTERPRET:
        raise ValueError(
            f"{fn}: needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), got q on "
            f"{q.device}"
        )
    batch, hq, seqlen, head_dim = _as_bhtd(q).shape
    kb, hkv, kt, kd = _as_bhtd(k).shape
    if (kb, kt, kd) != (batch, seqlen, head_dim) or hq == 0 or hkv == 0:
        raise ValueError(
            f"{fn}: k must match q in batch, tokens and head dim (and both have heads), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if cos.shape != sin.shape:
        raise ValueError(
            f"{fn}: cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(f"{fn}: gradients w.r.t. cos/sin are not supported; pass them detached")
    rdim = check_int(f"{fn}: rotary_dim", cos.shape[-1] if rotary_dim is None else rotary_dim, 2)
    if rdim % 2 or rdim > head_dim:
        raise ValueError(f"{fn}: rotary_dim must be even and in [2, D={head_dim}], got {rdim}")
    if cos.shape[-1] != rdim:
        raise ValueError(
            f"{fn}: the last dim of cos/sin must equal rotary_dim={rdim}, got shape "
            f"{tuple(cos.shape)}"
        )
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError(f"{fn}: pass position_ids or cu_seqlens, not both")

    if position_ids is None and cu_seqlens is None:
        ok = (cos.dim() == 2 and cos.shape[0] == seqlen) or (
            cos.dim() == 3 and cos.shape[0] in (1, batch) and cos.shape[1] == seqlen
        )
        if not ok:
            raise ValueError(
                f"{fn}: gathered cos/sin must be (B={batch}, T={seqlen}, R), (1, T, R) or (T, R), "
                f"got {tuple(cos.shape)}; to index a (P, R) table pass position_ids or cu_seqlens"
            )
        return _Static(bool(interleaved), rdim, _POS_GATHERED)
    if cos.dim() != 2:
        raise ValueError(
            f"{fn}: with position_ids or cu_seqlens, cos/sin must be a (P, R) table, got "
            f"{tuple(cos.shape)}"
        )
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise TypeError(
                f"{fn}: position_ids must be an int32/int64 tensor, got {position_ids!r:.80}"
            )
        if (
            position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch)
            or (position_ids.shape[1] != seqlen)
        ):
            raise ValueError(
                f"{fn}: position_ids must be (B={batch}, T={seqlen}) or (1, T), got "
                f"{tuple(position_ids.shape)}"
            )
        return _Static(bool(interleaved), rdim, _POS_IDS)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(f"{fn}: cu_seqlens must be an int32/int64 tensor, got {cu_seqlens!r:.80}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{fn}: cu_seqlens must be 1-D (N + 1,) with N >= 1, got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    return _Static(bool(interleaved), rdim, _POS_CU)


def _check_writable(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(
                f"apply_rotary_qk: inplace=True but {name} has overlapping memory (strides "
                f"{t.stride()}); pass inplace=False"
            )
    if q.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError(
            "apply_rotary_qk: inplace=True but q and k share memory; pass inplace=False"
        )


def _is_grad_leaf(t: torch.Tensor) -> bool:
    """A leaf (or a view of a leaf) that requires grad: autograd forbids writing it in place."""
    return t.requires_grad and (t.is_leaf or (t._is_view() and t._base.is_leaf))


# ----------------------------------------------------------------------------------------------
# Autograd and public API
# ----------------------------------------------------------------------------------------------


class _RotaryQK(torch.autograd.Function):
    """Out of place: one launch forward, one launch backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, pos, cu, st, out_dtype):
        q_out, k_out = _empty_token_major(q, out_dtype), _empty_token_major(k, out_dtype)
        _launch(q, k, q_out, k_out, cos, sin, pos, cu, st, conjugate=False)
        ctx.save_for_backward(cos, sin, pos, cu)
        ctx.st, ctx.in_dtype = st, q.dtype
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin, pos, cu = ctx.saved_tensors
        # Never written in place: autograd may hand the same gradient to other consumers.
        dq, dk = _empty_token_major(dq_out, ctx.in_dtype), _empty_token_major(dk_out, ctx.in_dtype)
        _launch(dq_out, dk_out, dq, dk, cos, sin, pos, cu, ctx.st, conjugate=True)
        return dq, dk, None, None, None, None, None, None


# In place under autograd. A Function that writes a view input in place may return only that one
# tensor (autograd's rule), and HF's q and k are views. So one launch rotates q and k, the node
# of q is _RotateQInplace (q marked dirty) and a second node, _RotatedKInplace, marks k dirty
# without touching it again. The backward runs one conjugate launch per node.
class _RotateQInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_alias, cos, sin, pos, cu, st):
        _launch(q, k_alias, q, k_alias, cos, sin, pos, cu, st, conjugate=False)
        return _rotated_in_place(ctx, q, cos, sin, pos, cu, st)

    @staticmethod
    def backward(ctx, dq_out):
        return _conjugate_one(ctx, dq_out), None, None, None, None, None, None


class _RotatedKInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, cos, sin, pos, cu, st):
        return _rotated_in_place(ctx, k, cos, sin, pos, cu, st)

    @staticmethod
    def backward(ctx, dk_out):
        return _conjugate_one(ctx, dk_out), None, None, None, None, None


def _rotated_in_place(ctx, x: torch.Tensor, cos, sin, pos, cu, st) -> torch.Tensor:
    """The node of one tensor rotated in place: ``x`` marked dirty, what ``_conjugate_one``
    needs saved; returns ``x`` (the Function's one output)."""
    ctx.mark_dirty(x)
    ctx.save_for_backward(cos, sin, pos, cu)
    ctx.st = st
    return x


def _conjugate_one(ctx, dx_out: torch.Tensor) -> torch.Tensor:
    cos, sin, pos, cu = ctx.saved_tensors
    dx = _empty_token_major(dx_out, dx_out.dtype)
    _launch(dx_out, None, dx, None, cos, sin, pos, cu, ctx.st, conjugate=True)
    return dx


# Registered ops: what torch.compile traces (see the module docstring).
@kernel_op("rope_qk")
def _rope_qk_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    pos: torch.Tensor | None, cu: torch.Tensor | None, interleaved: bool, rotary_dim: int,
    pos_mode: int, conjugate: bool, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    st = _Static(interleaved, rotary_dim, pos_mode)
    q_out, k_out = _empty_token_major(q, out_dtype), _empty_token_major(k, out_dtype)
    _launch(q, k, q_out, k_out, cos, sin, pos, cu, st, conjugate=conjugate, traced=True)
    return q_out, k_out


@kernel_op("rope_qk_", mutates_args=("q", "k"))
def _rope_qk_inplace_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    pos: torch.Tensor | None, cu: torch.Tensor | None, interleaved: bool, rotary_dim: int,
    pos_mode: int,
) -> None:  # fmt: skip
    st = _Static(interleaved, rotary_dim, pos_mode)
    _launch(q, k, q, k, cos, sin, pos, cu, st, conjugate=False, traced=True)


def _rope_qk_setup_context(ctx, inputs, output) -> None:
    q, _, cos, sin, pos, cu, interleaved, rotary_dim, pos_mode, conjugate, _ = inputs
    ctx.save_for_backward(cos, sin, pos, cu)
    ctx.static = (interleaved, rotary_dim, pos_mode)
    ctx.conjugate, ctx.in_dtype = conjugate, q.dtype


def _rope_qk_op_backward(ctx, dq_out, dk_out):
    cos, sin, pos, cu = ctx.saved_tensors
    # the conjugate of the conjugate is the rotation itself (backward of the backward)
    dq, dk = _rope_qk_op(
        dq_out, dk_out, cos, sin, pos, cu, *ctx.static, not ctx.conjugate, ctx.in_dtype
    )
    return dq, dk, None, None, None, None, None, None, None, None, None


_rope_qk_op.register_autograd(_rope_qk_op_backward, setup_context=_rope_qk_setup_context)


def _rotary_qk_traced(q, k, cos, sin, pos, cu, st: _Static, inplace: bool, out_dtype):
    """``_rotary_qk`` through the registered ops (under torch.compile)."""
    args = (cos, sin, pos, cu, st.interleaved, st.rotary_dim, st.pos_mode)
    records = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if inplace and not records:
        _rope_qk_inplace_op(q, k, *args)
        return q, k
    return _rope_qk_op(q, k, *args, False, out_dtype)


def _rotary_qk(q, k, cos, sin, pos, cu, st: _Static, inplace: bool, out_dtype: torch.dtype):
    if compiling():
        return _rotary_qk_traced(q, k, cos, sin, pos, cu, st, inplace, out_dtype)
    records = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if inplace and records and (_is_grad_leaf(q) or _is_grad_leaf(k)):
        inplace = False
    if not inplace:
        if records:
            return _RotaryQK.apply(q, k, cos, sin, pos, cu, st, out_dtype)
        q_out, k_out = _empty_token_major(q, out_dtype), _empty_token_major(k, out_dtype)
        _launch(q, k, q_out, k_out, cos, sin, pos, cu, st, conjugate=False)
        return q_out, k_out
    _check_writable(q, k)
    if records:
        q = _RotateQInplace.apply(q, k.detach(), cos, sin, pos, cu, st)
        return q, _RotatedKInplace.apply(k, cos, sin, pos, cu, st)
    _launch(q, k, q, k, cos, sin, pos, cu, st, conjugate=False)
    for t in (q, k):  # like any in-place op: autograd's saved-tensor checks must see the write
        increment_version(t)
    return q, k


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    inplace: bool = True,
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by RoPE in one Triton launch; returns ``(q_out, k_out)``.

    Args:
        q: (B, Hq, T, D) in HF's layout (any strides, e.g. ``q_proj(x).view(B, T, Hq, D)
            .transpose(1, 2)``) or packed (T, Hq, D); float16, bfloat16 or float32.
        k: (B, Hkv, T, D) or (T, Hkv, D), same dtype as q; Hkv may differ from Hq (GQA/MQA).
        cos, sin: gathered per token, (B, T, R), (1, T, R) or (T, R) (what HF's rotary module
            returns), or a (P, R) table when ``position_ids`` or ``cu_seqlens`` is given. Their
            dtype may differ from q's (math is fp32; outputs keep q's dtype). No gradient flows
            to them.
        position_ids: (B, T) or (1, T) int32/int64 rows of the table, e.g. a packed batch's
            positions that restart at 0 at every document. Values must lie in [0, P).
        cu_seqlens: (N + 1,) int32/int64 document boundaries over the B * T tokens flattened
            batch-major (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == B * T``); each token's
            position is its offset inside its document, computed in the kernel.
        inplace: overwrite q and k and return them. When autograd records and q or k is a leaf
            (or a view of a leaf) that requires grad, which cannot be written in place, new
            tensors are returned instead (also whenever autograd records under torch.compile):
            always use the returned tensors.
        interleaved: rotate pairs (x[2i], x[2i+1]) (GPT-J/NeoX-interleaved) instead of the
            halves (x[:R/2], x[R/2:R]) of HF's ``rotate_half``; cos/sin follow the same layout.
        rotary_dim: R, the number of leading features that rotate (even, <= D); the rest pass
            through. Defaults to ``cos.shape[-1]``, which must equal it.

    Out-of-place outputs are laid out token-major, (B, T, H, D) in memory, like HF's projections.
    Raises ValueError/TypeError on bad input before launching anything.
    """
    st = _check_inputs(q, k, cos, sin, position_ids, cu_seqlens, interleaved, rotary_dim)
    return _rotary_qk(q, k, cos, sin, position_ids, cu_seqlens, st, inplace, q.dtype)


def rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (the kernel-hub
    ``rotary_pos_emb`` function entry). Returns ``(q_embed, k_embed)``.

    q (B, Hq, T, D) and k (B, Hkv, T, D) with ``unsqueeze_dim=1``, or (B, T, H, D) with
    ``unsqueeze_dim=2``; cos/sin (B, T, R) or (1, T, R) as HF's rotary module returns them
    (R < D rotates the first R features). The result has HF's dtype,
    ``torch.promote_types(q.dtype, cos.dtype)`` (fp32 under autocast with fp32 cos/sin).

    It rotates in place only when that is both safe and free: autograd is not recording (HF's
    caller drops the un-rotated q and k and the KV cache stores the rotated ones), the dtype does
    not change, and q/k have no self-overlapping memory. When autograd records it rotates out of
    place: in-place on HF's view of the projection output would send the gradient through
    ``CopySlices``, four extra passes over q and k in the backward.
    """
    if unsqueeze_dim in (2, -2):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    elif unsqueeze_dim not in (1, -3):
        raise ValueError(
            f"rotary_pos_emb: unsqueeze_dim must be 1 or 2 (or -3/-2), got {unsqueeze_dim}"
        )
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(
            f"rotary_pos_emb: q must be a 4-D tensor, got {getattr(q, 'shape', type(q).__name__)}"
        )
    st = _check_inputs(q, k, cos, sin, None, None, False, None)
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    records = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    inplace = (
        not compiling()
        and not records
        and out_dtype == q.dtype
        and torch._debug_has_internal_overlap(q) != 1
        and torch._debug_has_internal_overlap(k) != 1
        and q.data_ptr() != k.data_ptr()
    )
    q_out, k_out = _rotary_qk(q, k, cos, sin, None, None, st, inplace, out_dtype)
    if unsqueeze_dim in (2, -2):
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out
