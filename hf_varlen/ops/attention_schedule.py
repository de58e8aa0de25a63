"""Tile schedule of the Triton varlen attention: per-row visibility bounds, tile lists, configs.

The kernels see the packed token stream cut into tiles of consecutive rows (up to ``TILE_M``
query tokens, or ``BLOCK_N`` key tokens in the dK/dV pass) and, for every row, the contiguous
range of rows on the other side that it may see. Because documents are contiguous and visibility
never crosses a document, "same document AND causal AND window" is one interval:

    query t (document d, lengths L_q, L_k, shift = L_k - L_q, diag = t - q_end + k_end):
        lo_q[t] = max(k_start, diag - left)        hi_q[t] = min(k_end - 1, diag + right)
    key s (document d):
        qlo_k[s] = max(q_start, s - k_end + q_end - right)
        qhi_k[s] = min(q_end - 1, s - k_end + q_end + left)

(left/right = -1 drop that term; causal means right = 0). The offsets are first clamped into
[0, T] and made non-decreasing on the device (no sync, ``common.clamp_offsets``), so even
malformed cu_seqlens (negative, past T, decreasing) give bounds and tiles inside the packed
tensors: the kernels never read or write out of bounds; they compute garbage-in-garbage-out but
finite values (validation is the host's job where offsets are there). A tile's work is the span
[min lo, max hi] of its rows; the mask inside it is ``lo <= col <= hi`` per row.

Tiles never cross a document boundary (``tile_list``): a tile across one would multiply each
document's rows by the other's keys. A document's partial tile sits where it costs least (its
first query rows, its last keys). The tile count is bounded by ceil(T / TILE) + n_docs + 1, so
grids are known on the host from T and the document count (shapes), never from a device read.

Heaviest-first: each tile list is sorted by span, descending, so the long documents' heavy tiles
(last causal query tiles; first key tiles) start first and the many light tiles fill in behind
them (LPT). Long-document path (``LongPath``): documents whose rows span >= ``min_span`` are
tiled with bigger blocks for a second, persistent launch (one program per SM looping over them),
the others with the short config (``split_tiles``), so one call mixes both.

Bounds and tile lists are built with torch ops on the device once per batch and cached on the
cu_seqlens tensor objects, so every layer of a forward (and the backward) reuses them. Everything
here is traceable (no ``.item()``, no data-dependent branch; the only branch is on the number of
documents, a shape): under torch.compile nothing is cached and the compiler sees the torch ops.

Shapes: cu_seqlens_* (n_docs + 1,) int32; lo_q/hi_q (T_q,) int32; qlo_k/qhi_k (T_k,) int32;
segment bounds (n_docs + 3,) int64; tiles (n_slots + 1, 2) int32 [start, end) rows, the last
entry an empty tile that is never launched. Rows outside every document get the empty interval
(EMPTY_LO, -1).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import torch

from .common import TensorCache, clamp_offsets

EMPTY_LO = 2**31 - 1  # lower bound of a row that sees nothing (hi = -1)


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes of the three kernels; chosen from head_dim / dtype / device only.

    ``*_min_tokens``: query heads of a KV group are folded into one tile only while the tile (or
    inner step) keeps at least this many tokens (see ``fold_factor``).
    """

    fwd_block_m: int  # rows (tokens x folded heads) per forward tile
    fwd_block_n: int  # key rows per inner step
    fwd_warps: int
    fwd_stages: int
    fwd_min_tokens: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    dq_stages: int
    dq_min_tokens: int
    kv_block_n: int  # key tokens per dK/dV tile
    kv_block_m: int  # query rows (tokens x folded heads) per inner step of dK/dV
    kv_warps: int
    kv_stages: int
    kv_min_tokens: int
    # The fused (FA2-style, atomic dQ) backward instead of the split dQ + dK/dV kernels, where the
    # caller did not ask for a deterministic backward (attention_bwd.attention_backward). Off by
    # default until the H200 shows where it wins; a tuning override may set it (16th entry).
    bwd_fused: bool = False


# Tuned on the H200 (scripts/bench_attention.py --tune) over packs of real alpaca and lima lengths
# and 1 x 32K + 32K alpaca; one config per head_dim/dtype serves short and long documents.
_CUDA_CONFIGS = {
    64: KernelConfig(128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 2, 8),
    128: KernelConfig(128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 2, 8),
    # head_dim 256: smaller tiles so the fp32 accumulators fit in registers / shared memory
    256: KernelConfig(64, 32, 4, 2, 16, 64, 32, 4, 1, 32, 32, 32, 4, 1, 8),
}
_INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1, 4, 16, 16, 1, 1, 4, 16, 16, 1, 1, 4)


@dataclass(frozen=True)
class LongPath:
    """The long-document path: tiles whose span (keys a query tile sees, or query rows that see a
    key tile) is >= ``min_span`` run with ``cfg``'s bigger blocks, in a second, persistent launch
    (a fixed grid of one program per SM looping over those tiles, heaviest first); the others run
    with the short config as before. One call can mix both (``split_tiles``)."""

    cfg: KernelConfig
    min_span: int


# Tuned on the H200 (scripts/bench_attention.py --tune --tune-set long) over 1 x 32K + 32K alpaca
# and 8 x 8K (docs/BENCHMARKS.md): head_dim 128 with 32/8 heads (run G: bigger steps, 8 warps),
# head_dim 64 with 16/16 heads (run H: fold 1, its only measured fold). head_dim 256: not
# measured, no long path.
_CUDA_LONG: dict[int, LongPath] = {
    64: LongPath(KernelConfig(128, 64, 4, 3, 128, 128, 32, 8, 3, 128, 64, 64, 4, 2, 64), 1024),
    128: LongPath(KernelConfig(256, 64, 8, 3, 64, 128, 64, 8, 3, 64, 128, 64, 8, 3, 16), 1024),
}
# Different tiles from the short interpreter config (the split's lcm logic runs), a small span
# (CPU tests with documents of > 64 tokens take the long path).
_INTERPRETER_LONG = LongPath(
    KernelConfig(32, 32, 1, 1, 4, 32, 32, 1, 1, 4, 32, 16, 1, 1, 4), min_span=64
)


@functools.lru_cache(maxsize=4)
def _load_overrides(path: str) -> dict:
    with open(path) as f:
        raw = json.load(f)
    out: dict = {}
    for k, v in raw.items():
        if k == "long_min_span":
            continue
        cfg = KernelConfig(*v[:15], *map(bool, v[15:]))
        if k.startswith("long"):
            out["long", int(k[4:])] = LongPath(cfg, int(raw.get("long_min_span", 2048)))
        else:
            out[int(k)] = cfg
    return out


def _overrides() -> dict:
    """Configs from $HF_VARLEN_TRITON_ATTN_CONFIG, for tuning runs: JSON {"128": [15 ints
    (+ bwd_fused 0/1)], "long128": [15 ints], "long_min_span": int, ...}."""
    path = os.environ.get("HF_VARLEN_TRITON_ATTN_CONFIG")
    return _load_overrides(path) if path else {}


def _key(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def pick_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """Block sizes for head_dim/dtype/device (never for T, max_seqlen or the document count)."""
    if device.type != "cuda":  # the CPU interpreter: small tiles keep the numpy emulation fast
        return _INTERPRETER_CONFIG
    key = _key(head_dim)
    return _overrides().get(key) or _CUDA_CONFIGS[key]


def pick_long_path(head_dim: int, dtype: torch.dtype, device: torch.device) -> LongPath | None:
    """The long-document path for head_dim/dtype/device, or None (every tile takes the short
    config). On CUDA fp16/bf16 only: the long blocks were measured there, and in fp32 their
    tiles need twice the registers and shared memory."""
    if device.type != "cuda":
        return _INTERPRETER_LONG
    if dtype == torch.float32:
        return None
    key = _key(head_dim)
    return _overrides().get(("long", key)) or _CUDA_LONG.get(key)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (big-tile kernels hold one program per SM);
    3 under the interpreter, so CPU tests run programs that take several tiles each."""
    if device.type != "cuda":
        return 3
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def fold_factor(group: int, block_m: int, min_tokens: int) -> int:
    """How many query heads of one KV group share a tile: the largest divisor of ``group`` that
    leaves at least ``min_tokens`` tokens per tile (K/V are loaded once for all folded heads)."""
    best = 1
    for f in range(1, group + 1):
        if group % f == 0 and block_m // f >= min_tokens:
            best = f
    return best


def kernel_tiling(cfg: KernelConfig, kernel: str, group: int) -> tuple[int, int]:
    """(fold, rows per tile of the launch order) of one kernel ("fwd", "dq" or "kv") under cfg:
    query tokens per tile for the forward and dQ, key tokens per tile for dK/dV."""
    if kernel == "kv":
        return fold_factor(group, cfg.kv_block_m, cfg.kv_min_tokens), cfg.kv_block_n
    block, min_tokens = (
        (cfg.fwd_block_m, cfg.fwd_min_tokens)
        if kernel == "fwd"
        else (cfg.dq_block_m, cfg.dq_min_tokens)
    )
    fold = fold_factor(group, block, min_tokens)
    return fold, block // fold


def launch_passes(plan, kernel: str, cfg: KernelConfig, long: LongPath | None, group: int,
                  device: torch.device) -> list:  # fmt: skip
    """The launches of one kernel over a plan: [(tiles, config, fold, persistent)], the short
    config's over every document, or, with a long path, the short config's over the short
    documents and the long config's, persistent ((n_long, programs)), over the long ones
    (``split_tiles``)."""
    fold, tile = kernel_tiling(cfg, kernel, group)
    side = "k" if kernel == "kv" else "q"
    if long is None:
        return [(plan.tiles(side, tile), cfg, fold, None)]
    fold_l, tile_l = kernel_tiling(long.cfg, kernel, group)
    tiles_s, tiles_l, n_long = plan.split(side, tile, tile_l, long.min_span)
    persistent = (n_long, persistent_programs(device))
    return [(tiles_s, cfg, fold, None), (tiles_l, long.cfg, fold_l, persistent)]


@dataclass
class Plan:
    """Row bounds and segment bounds of one batch plus its tile lists (memoised per tile size)."""

    lo_q: torch.Tensor
    hi_q: torch.Tensor
    qlo_k: torch.Tensor
    qhi_k: torch.Tensor
    seg_q: torch.Tensor  # segment_bounds of the query side
    seg_k: torch.Tensor
    _tiles: dict = field(default_factory=dict)

    def _side(self, side: str):
        if side == "q":  # query tiles end at their document's end: see tile_list
            return self.lo_q, self.hi_q, self.seg_q, True
        return self.qlo_k, self.qhi_k, self.seg_k, False

    def tiles(self, side: str, tile: int) -> torch.Tensor:
        """``tile_list`` of the query rows (side "q") or the key rows ("k"), memoised."""
        if (side, tile) not in self._tiles:
            lo, hi, seg, end_aligned = self._side(side)
            self._tiles[side, tile] = tile_list(lo, hi, seg, tile, end_aligned)[0]
        return self._tiles[side, tile]

    def split(self, side: str, tile_s: int, tile_l: int, min_span: int):
        """``split_tiles`` of one side, memoised."""
        key = ("split", side, tile_s, tile_l, min_span)
        if key not in self._tiles:
            lo, hi, seg, end_aligned = self._side(side)
            self._tiles[key] = split_tiles(lo, hi, seg, tile_s, tile_l, min_span, end_aligned)
        return self._tiles[key]


def _doc_of(cu: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document index of each row (clamped) and whether the row lies inside some document."""
    rows = torch.arange(n_rows, device=cu.device, dtype=cu.dtype)
    doc = torch.searchsorted(cu, rows, right=True).to(torch.int64) - 1
    inside = (doc >= 0) & (doc < cu.numel() - 1)
    # row_bounds returns before this for n_docs == 0, so numel - 2 >= 0 (no Python max: under
    # torch.compile numel is symbolic and must not be specialised)
    return doc.clamp_(0, cu.numel() - 2), inside


def row_bounds(
    cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row visibility intervals (see module doc), int32, on cu_q's device."""
    # Memory safety for any offsets: every bound below lies in [0, T - 1] or is the empty interval.
    cq, ck = clamp_offsets(cu_q, t_q), clamp_offsets(cu_k, t_k)

    def finish(lo, hi, inside):
        empty = (lo > hi) | ~inside
        lo = torch.where(empty, EMPTY_LO, lo)
        hi = torch.where(empty, -1, hi)
        return lo.to(torch.int32), hi.to(torch.int32)

    if cu_q.numel() < 2:  # no documents: every row sees nothing
        e = [
            torch.full((n,), v, dtype=torch.int32, device=cu_q.device)
            for n, v in ((t_q, EMPTY_LO), (t_q, -1), (t_k, EMPTY_LO), (t_k, -1))
        ]
        return e[0], e[1], e[2], e[3]

    doc, inside = _doc_of(cq, t_q)
    t = torch.arange(t_q, device=cu_q.device, dtype=torch.int64)
    k_start, k_end, q_end = ck[doc], ck[doc + 1], cq[doc + 1]
    diag = t - q_end + k_end
    lo = k_start if left < 0 else torch.maximum(k_start, diag - left)
    hi = k_end - 1 if right < 0 else torch.minimum(k_end - 1, diag + right)
    lo_q, hi_q = finish(lo, hi, inside)

    doc, inside = _doc_of(ck, t_k)
    s = torch.arange(t_k, device=cu_k.device, dtype=torch.int64)
    q_start, q_end, k_end = cq[doc], cq[doc + 1], ck[doc + 1]
    base = s - k_end + q_end
    qlo = q_start if right < 0 else torch.maximum(q_start, base - right)
    qhi = q_end - 1 if left < 0 else torch.minimum(q_end - 1, base + left)
    qlo_k, qhi_k = finish(qlo, qhi, inside)
    return lo_q, hi_q, qlo_k, qhi_k


def segment_bounds(cu: torch.Tensor, n_rows: int) -> torch.Tensor:
    """(n_docs + 3,) int64: 0, the clamped offsets, n_rows. Segment i is rows [b[i], b[i + 1]):
    the rows before the first document, each document, the rows after the last one."""
    zero = torch.zeros(1, dtype=torch.int64, device=cu.device)
    return torch.cat([zero, clamp_offsets(cu, n_rows), zero + n_rows])


def tile_list(
    lo: torch.Tensor,
    hi: torch.Tensor,
    bounds: torch.Tensor,
    tile: int,
    end_aligned: bool,
    take: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows cut into tiles of <= ``tile`` rows that never cross a segment boundary, heaviest
    first: (tiles (n_slots + 1, 2) int32 [start, end) rows, n_real (1,) int32).

    Tiles that hold one document waste no matrix work on rows of another (a row's keys are its
    document's, so a tile across a boundary multiplies each document's rows by the other's
    keys). The partial tile of a document goes where it costs least: at the document's start
    for query tiles (``end_aligned``: causal rows there see few keys), at its end for key tiles
    (keys there are seen by few queries). ``take`` ((n_seg,) bool): tile only these segments.

    n_slots = ceil(T / tile) + n_seg - 1 bounds the tile count from T and the document count
    alone (each segment adds at most one partial tile), so grids need no host read. The first
    n_real entries are the real tiles, sorted by span (max hi - min lo + 1 over the tile's rows),
    descending; then empty tiles (start = end = T), which programs skip. The last entry is
    always empty and never launched: grids count ``tiles.shape[0] - 1`` (see ``tile_spans``)."""
    n, n_seg = lo.numel(), bounds.numel() - 1
    dev = lo.device
    count = (bounds[1:] - bounds[:-1] + tile - 1) // tile  # (n_seg,) tiles per segment
    if take is not None:
        count = torch.where(take, count, 0)
    last = torch.cumsum(count, 0)  # one past each segment's last tile
    n_slots = -(-n // tile) + n_seg - 1
    slot = torch.arange(n_slots, device=dev)
    seg = torch.searchsorted(last, slot, right=True)
    real = seg < n_seg
    seg = seg.clamp_(max=n_seg - 1)
    i, a, e, c = slot - (last - count)[seg], bounds[seg], bounds[seg + 1], count[seg]
    if end_aligned:
        end = e - (c - 1 - i) * tile
        start = torch.maximum(a, end - tile)
    else:
        start = a + i * tile
        end = torch.minimum(e, start + tile)
    start, end = torch.where(real, start, n), torch.where(real, end, n)
    order = torch.argsort(tile_spans(lo, hi, start, end), descending=True, stable=True)
    empty = torch.full((1, 2), n, dtype=torch.int32, device=dev)
    tiles = torch.cat([torch.stack([start[order], end[order]], 1).to(torch.int32), empty])
    return tiles, last[-1:].to(torch.int32)


def tile_spans(lo, hi, start, end) -> torch.Tensor:
    """(n_slots,) int64: max hi - min lo + 1 (>= 0) over the rows [start, end) of each tile
    (starts non-decreasing; empty tiles give 0).

    Why tile lists end in an extra entry: under torch.compile n_slots is symbolic, and an op over
    an n-sized dimension may specialise n == 1 against n >= 2 (a recompile whenever a pack
    crosses one tile); the rows outside every tile gather in that extra slot here."""
    n, n_slots = lo.numel(), start.numel()
    rows = torch.arange(n, device=lo.device)
    slot = torch.searchsorted(start, rows, right=True) - 1
    inside = (slot >= 0) & (rows < end[slot.clamp(min=0)])
    idx = torch.where(inside, slot, n_slots)
    # int32 bounds lie in [0, T) or are the empty pair (EMPTY_LO, -1); int64 here, no overflow
    lo_t = torch.full((n_slots + 1,), EMPTY_LO, dtype=torch.int64, device=lo.device)
    hi_t = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=lo.device)
    lo_t = lo_t.scatter_reduce(0, idx, lo.to(torch.int64), "amin")
    hi_t = hi_t.scatter_reduce(0, idx, hi.to(torch.int64), "amax")
    return (hi_t - lo_t + 1).clamp_min(0)[:n_slots]


def split_tiles(
    lo: torch.Tensor,
    hi: torch.Tensor,
    bounds: torch.Tensor,
    tile_s: int,
    tile_l: int,
    min_span: int,
    end_aligned: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents split between a short-tile launch and a long-tile launch: (tiles_s, tiles_l,
    n_long). A segment is long when one of its rows spans >= ``min_span`` rows of the other side
    (for causal attention: a document of >= min_span keys); its rows are tiled with ``tile_l``
    for the long launch, every other segment's with ``tile_s`` (an exact partition: each row is
    in one tile of one launch). tiles_*: ``tile_list``'s; n_long (1,) int32: the long launch's
    real tiles (the persistent launch's work)."""
    n, n_seg = lo.numel(), bounds.numel() - 1
    rows = torch.arange(n, device=lo.device)
    seg = (torch.searchsorted(bounds, rows, right=True) - 1).clamp_(0, n_seg - 1)
    row_span = (hi.to(torch.int64) - lo.to(torch.int64) + 1).clamp_min(0)
    span = torch.zeros(n_seg, dtype=torch.int64, device=lo.device)
    long_seg = span.scatter_reduce(0, seg, row_span, "amax") >= min_span
    tiles_s, _ = tile_list(lo, hi, bounds, tile_s, end_aligned, take=~long_seg)
    tiles_l, n_long = tile_list(lo, hi, bounds, tile_l, end_aligned, take=long_seg)
    return tiles_s, tiles_l, n_long


# Plans keyed on the cu_seqlens tensor objects (all layers of a forward and the backward share them;
# a model with sliding and full layers needs two per batch).
_PLANS = TensorCache(size=16)


def get_plan(
    cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int, left: int, right: int
) -> Plan:
    """Bounds (and, lazily, tile orders) for this batch, built on the device once and cached.

    Only plain eager tensors are cached: inside a traced op (fake / functional tensors, or while
    torch.compile traces) the plan is rebuilt from torch ops, which the compiler sees and
    deduplicates across layers (no Python-side state in a graph)."""

    def build():
        bounds = row_bounds(cu_q, cu_k, t_q, t_k, left, right)
        return Plan(*bounds, segment_bounds(cu_q, t_q), segment_bounds(cu_k, t_k))

    if type(cu_q) is not torch.Tensor or type(cu_k) is not torch.Tensor:
        return build()
    return _PLANS.get_or_compute((cu_q, cu_k), build, extra=(t_q, t_k, left, right))
