"""Tile schedule of the Triton varlen attention: per-row visibility bounds, compact tile order, configs.

The kernels never look at documents. They see the packed token stream cut into fixed tiles
(``TILE_M`` query tokens, or ``BLOCK_N`` key tokens in the dK/dV pass) and, for every row, the
contiguous range of rows on the other side that it may see. Because documents are contiguous and
visibility never crosses a document, "same document AND causal AND window" is one interval:

    query t (document d, lengths L_q, L_k, shift = L_k - L_q, diag = t - q_end + k_end):
        lo_q[t] = max(k_start, diag - left)        hi_q[t] = min(k_end - 1, diag + right)
    key s (document d):
        qlo_k[s] = max(q_start, s - k_end + q_end - right)
        qhi_k[s] = min(q_end - 1, s - k_end + q_end + left)

(left/right = -1 drop that term; causal means right = 0). The offsets are first clamped into
[0, T] and made non-decreasing on the device (no sync, ``common.clamp_offsets``), so even malformed cu_seqlens (negative, past T, decreasing) give
bounds inside the packed tensors: the kernels never read or write out of bounds; they compute
garbage-in-garbage-out but finite values (validation is the host's job where offsets are there). A tile's work is the span
[min lo, max hi] of its rows, so several short documents share one tile and the block-diagonal mask
inside it is just ``lo <= col <= hi`` per row. Tiles cover only real tokens: the grid is
ceil(T / TILE) x heads, known on the host from T alone (no device->host sync), with no empty
programs beyond the last partial tile.

Heaviest-first: the launch order is a permutation of the tiles sorted by their span, descending, so
the long documents' heavy tiles (last causal query tiles; first key tiles) start first and the many
light tiles fill in behind them (LPT). Bounds and orders are built with a few torch ops on the device
once per batch and cached on the cu_seqlens tensor objects, so every layer of a forward (and the
backward) reuses them. Everything here is traceable (no ``.item()``, no data-dependent branch; the
only branch is on the number of documents, a shape): under torch.compile nothing is cached and the
compiler sees the torch ops.

Shapes: cu_seqlens_* (n_docs + 1,) int32; lo_q/hi_q (T_q,) int32; qlo_k/qhi_k (T_k,) int32;
order_q(tile) (ceil(T_q / tile) + 1,) int32; order_k(tile) (ceil(T_k / tile) + 1,) int32
(the last entry is an empty tile that is never launched; see ``heaviest_first``).
Rows outside every document (past cu[-1]) get the empty interval (EMPTY_LO, -1).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field

import torch

from ..common import TensorCache, clamp_offsets

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
    # caller did not ask for a deterministic backward (bwd.attention_backward). Off by
    # default until the H200 shows where it wins; a tuning override may set it (16th entry).
    bwd_fused: bool = False
    # Pipeline stages of the dK/dV kernel where no query heads fold into its steps (fold 1: MHA,
    # or a GQA group with no divisor that keeps kv_min_tokens, e.g. 40/8 heads); 0 = kv_stages.
    # At head dim 128 the best depth depends on the fold (H200, scripts/bench_attention.py: 3 stages took
    # 32/8/128's fold-4 dK/dV 12-19% faster, 40/8/128's fold-1 one 9-22% slower f+b).
    kv_stages_unfolded: int = 0
    # Stream the inner loops' blocks (K/V of the forward and dQ steps, Q/dO of the dK/dV steps)
    # through Hopper tensor descriptors (TMA) where the layout allows (tma.py): the copy
    # engine computes the addresses, so the registers they took are free for the accumulators.
    # Off in the shipped configs: slower or even on the H200 (tma.py says why); a
    # tuning override may set it (18th entry).
    tma: bool = False

    def __post_init__(self):
        if not isinstance(self.kv_stages_unfolded, int) or self.kv_stages_unfolded < 0:
            raise ValueError(
                f"KernelConfig.kv_stages_unfolded must be an int >= 0 (0 = kv_stages), got "
                f"{self.kv_stages_unfolded!r}"
            )

    def kv_stages_at(self, fold: int) -> int:
        """Pipeline stages of the dK/dV kernel at this GQA fold."""
        return self.kv_stages_unfolded if fold == 1 and self.kv_stages_unfolded else self.kv_stages


# Tuned on the H200 (scripts/bench_attention.py --tune) over packs of real alpaca and lima lengths
# and 1 x 32K + 32K alpaca; tiles of long documents take the long path below where there is one.
# Head dim 128's dK/dV runs 3 pipeline stages where query heads fold into its steps and 2 where
# none do (the short-tile sweep at 32/8/128, fold 4, dK/dV alone alpaca64k 1.028 -> 0.878
# ms, lima64k 2.274 -> 1.996, alpaca16k 0.320 -> 0.260 against 2 stages; f+b alpaca64k 3.309 ->
# 3.143, lima64k 5.903 -> 5.540; at 40/8/128, fold 1, 3 stages made f+b alpaca64k 4.893 -> 5.957).
# Head dim 64 keeps 2 (3 stages were within -4% / +3% f+b at 32/8/64 and 16/16/64).
_CUDA_CONFIGS = {
    64: KernelConfig(128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 2, 8),
    128: KernelConfig(128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 3, 8, kv_stages_unfolded=2),
    # head_dim 256: smaller tiles so the fp32 accumulators fit in registers / shared memory
    256: KernelConfig(64, 32, 4, 2, 16, 64, 32, 4, 1, 32, 32, 32, 4, 1, 8),
}
_INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1, 4, 16, 16, 1, 1, 4, 16, 16, 1, 1, 4)


@dataclass(frozen=True)
class LongPath:
    """The long-document path: tiles whose span (keys a query tile sees, or query rows that see a
    key tile) is >= ``min_span`` run with ``cfg``'s bigger blocks in a second launch; the others
    run with the short config as before. One call can mix both (``split_orders``).

    ``programs_per_sm`` (forward, dQ, dK/dV) picks how that launch covers its tiles (the grid is
    fixed by T either way, never by how many tiles are long):
    - n > 0: persistent, n programs per SM loop over the long tiles, heaviest first. n must not
      exceed the programs that fit on one SM at once, or the programs past one wave start only
      after a whole loop of a resident one.
    - 0: one program per tile of the long tiling; the programs past the long tiles exit at once.
      Where the hardware scheduler keeps more programs per SM busy than a persistent grid does
      (head dim 64's kernels on the H200), this is the faster one."""

    cfg: KernelConfig
    min_span: int
    programs_per_sm: tuple[int, int, int] = (1, 1, 1)

    def __post_init__(self):
        p = self.programs_per_sm
        if len(p) != 3 or any(not isinstance(n, int) or n < 0 for n in p):
            raise ValueError(
                f"LongPath.programs_per_sm must be 3 ints >= 0 (forward, dQ, dK/dV; 0 = one "
                f"program per tile), got {p!r}"
            )

    def programs(self, kernel: str) -> int:
        """Persistent programs per SM of ``kernel``'s long launch ("fwd", "dq" or "kv"); 0: one
        program per tile instead."""
        return self.programs_per_sm[("fwd", "dq", "kv").index(kernel)]


# Tuned on the H200 (scripts/bench_attention.py --tune --tune-set long) over 1 x 32K + 32K alpaca
# and 8 x 8K (docs/BENCHMARKS.md): head_dim 128 with 32/8 heads (bigger steps, 8 warps),
# head_dim 64 with 16/16 heads and 32/8 heads (folding 2 / 2 / 4 heads of a KV
# group into the forward / dQ / dK-dV tiles took 8 x 8K from 45.1 to 39.8 ms f+b and 32K + 32K
# from 82.7 to 74.4 ms against fold 1; 16/16 heads have no group to fold). Head dim 64 launches
# one program per long tile (its 4-warp kernels at one persistent program per SM took
# 1.4-1.9x that time; f+b 1.5x faster on 8 x 8K, 32K + 32K and 128K); head dim 128 stays
# persistent (one program per tile was 2-5% faster on long documents, 1-3% slower on
# short packs). head_dim 256: not measured, no long path.
_CUDA_LONG: dict[int, LongPath] = {
    64: LongPath(
        KernelConfig(128, 64, 4, 3, 64, 128, 32, 8, 3, 64, 64, 64, 4, 2, 16), 1024, (0, 0, 0)
    ),
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
    programs = tuple(raw.get("long_programs_per_sm", (1, 1, 1)))
    for k, v in raw.items():
        if k in ("long_min_span", "long_programs_per_sm"):
            continue
        if not (k.isdigit() or (k.startswith("long") and k[4:].isdigit())):
            raise ValueError(
                f'{path}: unknown key {k!r}: the keys are head dims ("128"), "long<head dim>",'
                ' "long_min_span" and "long_programs_per_sm"'
            )
        try:
            cfg = KernelConfig(
                *v[:15], *map(bool, v[15:16]), *map(int, v[16:17]), *map(bool, v[17:18])
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {k}: {exc}") from None
        if k.startswith("long"):
            try:
                out["long", int(k[4:])] = LongPath(
                    cfg, int(raw.get("long_min_span", 2048)), programs
                )
            except ValueError as exc:
                raise ValueError(f"{path}: long_programs_per_sm: {exc}") from None
        else:
            out[int(k)] = cfg
    return out


def _overrides() -> dict:
    """Configs from $HF_VARLEN_TRITON_ATTN_CONFIG, for tuning runs: JSON {"128": [15 ints
    (+ bwd_fused 0/1, + kv_stages_unfolded, + tma 0/1)], "long128": [15 ints (+ the same)],
    "long_min_span": int,
    "long_programs_per_sm": [fwd, dq, kv], ...}."""
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


def persistent_programs(device: torch.device, per_sm: int = 1) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM (LongPath.programs_per_sm; 0: none, one
    program per tile instead); 3 under the interpreter, so CPU tests run programs that take
    several tiles each."""
    if per_sm == 0:
        return 0
    if device.type != "cuda":
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * per_sm


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


def kernel_launch(cfg: KernelConfig, kernel: str, group: int) -> tuple:
    """Everything that makes one kernel's launch under cfg: (fold, tile, block sizes, warps,
    stages, tma)."""
    fold, tile = kernel_tiling(cfg, kernel, group)
    if kernel == "fwd":
        rest = (cfg.fwd_block_m, cfg.fwd_block_n, cfg.fwd_warps, cfg.fwd_stages)
    elif kernel == "dq":
        rest = (cfg.dq_block_m, cfg.dq_block_n, cfg.dq_warps, cfg.dq_stages)
    else:
        rest = (cfg.kv_block_n, cfg.kv_block_m, cfg.kv_warps, cfg.kv_stages_at(fold))
    return (fold, tile, *rest, cfg.tma)


def launch_passes(plan, kernel: str, cfg: KernelConfig, long: LongPath | None, group: int,
                  device: torch.device) -> list:  # fmt: skip
    """The launches of one kernel over a plan: [(order, config, fold, bound)], the short config's
    over every tile (bound None), or, with a long path, the short config's over the short tiles
    and the long config's over the long ones (``split_orders``), bound = (n_long, persistent
    programs or 0: fwd.launch_grid)."""
    fold, tile = kernel_tiling(cfg, kernel, group)
    side = "k" if kernel == "kv" else "q"
    if long is None:
        order = plan.order_k(tile) if side == "k" else plan.order_q(tile)
        return [(order, cfg, fold, None)]
    fold_l, tile_l = kernel_tiling(long.cfg, kernel, group)
    order_s, order_l, n_long = plan.split(side, tile, tile_l, long.min_span)
    bound = (n_long, persistent_programs(device, long.programs(kernel)))
    return [(order_s, cfg, fold, None), (order_l, long.cfg, fold_l, bound)]


@dataclass
class Plan:
    """Row bounds of one batch plus its heaviest-first tile orders (memoised per tile size)."""

    lo_q: torch.Tensor
    hi_q: torch.Tensor
    qlo_k: torch.Tensor
    qhi_k: torch.Tensor
    _orders: dict = field(default_factory=dict)

    def order_q(self, tile: int) -> torch.Tensor:
        if ("q", tile) not in self._orders:
            self._orders["q", tile] = heaviest_first(self.lo_q, self.hi_q, tile)
        return self._orders["q", tile]

    def order_k(self, tile: int) -> torch.Tensor:
        if ("k", tile) not in self._orders:
            self._orders["k", tile] = heaviest_first(self.qlo_k, self.qhi_k, tile)
        return self._orders["k", tile]

    def split(self, side: str, tile_s: int, tile_l: int, min_span: int):
        """``split_orders`` over the query rows (side "q") or the key rows ("k"), memoised."""
        key = ("split", side, tile_s, tile_l, min_span)
        if key not in self._orders:
            lo, hi = (self.lo_q, self.hi_q) if side == "q" else (self.qlo_k, self.qhi_k)
            self._orders[key] = split_orders(lo, hi, tile_s, tile_l, min_span)
        return self._orders[key]


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

    def spans(own, other, n_rows, before, after):
        # The rows of one side (queries: own=cq) see, on the other side, the interval around their
        # bottom-right aligned diagonal: ``before`` rows back, ``after`` rows on (-1: unbounded).
        # The keys' query interval is the same rule with the window mirrored (right, left).
        doc, inside = _doc_of(own, n_rows)
        rows = torch.arange(n_rows, device=own.device, dtype=torch.int64)
        start, end, own_end = other[doc], other[doc + 1], own[doc + 1]
        diag = rows - own_end + end
        lo = start if before < 0 else torch.maximum(start, diag - before)
        hi = end - 1 if after < 0 else torch.minimum(end - 1, diag + after)
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

    lo_q, hi_q = spans(cq, ck, t_q, left, right)
    qlo_k, qhi_k = spans(ck, cq, t_k, right, left)
    return lo_q, hi_q, qlo_k, qhi_k


def heaviest_first(lo: torch.Tensor, hi: torch.Tensor, tile: int) -> torch.Tensor:
    """Tile indices (tiles of ``tile`` consecutive rows) sorted by span, largest first, int32,
    followed by one extra entry: (n_tiles + 1,), where the last entry is n_tiles, an empty tile
    that is never launched (grids count ``order.numel() - 1`` tiles).

    Why the extra entry: under torch.compile n_tiles is symbolic, and any op over an n_tiles-sized
    dimension (a (n_tiles, tile) view, a slice, an elementwise op) specialises n_tiles == 1 against
    n_tiles >= 2 — a recompile whenever a pack crosses one tile, once per tile size of the three
    kernels. n_tiles + 1 >= 2 is known from T >= 2, so it adds no guard."""
    # Stable: ties keep index order, so the empty extra tile (span 0, the highest index) is last.
    return torch.argsort(tile_spans(lo, hi, tile), descending=True, stable=True).to(torch.int32)


def tile_spans(lo: torch.Tensor, hi: torch.Tensor, tile: int) -> torch.Tensor:
    """(n_tiles + 1,) int32: max hi - min lo + 1 (>= 0) over each tile's rows; the extra last
    entry (the empty tile) is 0."""
    n = lo.numel()
    n_tiles = -(-n // tile)
    tile_of = torch.arange(n, device=lo.device) // tile
    # int32 throughout: bounds lie in [0, T) or are the empty pair (EMPTY_LO, -1), so even an
    # empty tile's span, -1 - EMPTY_LO + 1 = -(2**31 - 1), fits.
    lo_t = torch.full((n_tiles + 1,), EMPTY_LO, dtype=torch.int32, device=lo.device)
    hi_t = torch.full((n_tiles + 1,), -1, dtype=torch.int32, device=lo.device)
    lo_t = lo_t.scatter_reduce(0, tile_of, lo.to(torch.int32), "amin")
    hi_t = hi_t.scatter_reduce(0, tile_of, hi.to(torch.int32), "amax")
    return (hi_t - lo_t + 1).clamp_min(0)


def split_orders(
    lo: torch.Tensor, hi: torch.Tensor, tile_s: int, tile_l: int, min_span: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows split between a short-tile launch and a long-tile launch: (order_s, order_l, n_long).

    Both tilings start at row 0, so with G = lcm(tile_s, tile_l) every G-row block is a whole
    number of tiles of either size. A block is long when one of its long-size tiles has a span of
    >= ``min_span``; its rows belong to the long launch, every other row to the short one (an exact
    partition: each row is computed once). Not the block's own span: G can be far larger than
    either tile (a fold of 5 heads gives 25-token tiles, lcm(25, 256) = 6400), and a block that
    long spans >= min_span over many short documents. order_s: heaviest_first's shape (n_s + 1,),
    the long blocks' short tiles replaced by the empty tile n_s (their programs do nothing).
    order_l: (n_l + 1,), the long tiles first, heaviest first; n_long (1,) int32: how many (the
    long launch's work)."""
    g = math.lcm(tile_s, tile_l)
    spans = {t: tile_spans(lo, hi, t) for t in {tile_s, tile_l}}
    span_l = spans[tile_l]
    # (n_g + 1,): a block is long if any of its long-size tiles is; the extra entry never is (the
    # extra tile's span is 0, and nothing maps to the last block index past the rows)
    n_g = -(-lo.numel() // g)
    block_of = torch.arange(span_l.numel(), device=lo.device) * tile_l // g
    long_g = torch.zeros(n_g + 1, dtype=torch.int32, device=lo.device)
    long_g = long_g.scatter_reduce(0, block_of, (span_l >= min_span).to(torch.int32), "amax") > 0

    def side(tile):
        span = spans[tile]
        idx = torch.arange(span.numel(), device=lo.device)
        is_long = long_g[idx * tile // g]  # the extra entry maps into [0, n_g]: never long
        return span, is_long

    span_s, long_s = side(tile_s)
    n_s = span_s.numel() - 1
    order_s = torch.argsort(torch.where(long_s, -1, span_s), descending=True, stable=True)
    order_s = torch.where(long_s[order_s], n_s, order_s).to(torch.int32)
    span_l, long_l = side(tile_l)
    order_l = torch.argsort(torch.where(long_l, span_l, -1), descending=True, stable=True)
    n_long = long_l.sum(dtype=torch.int32).reshape(1)
    return order_s, order_l.to(torch.int32), n_long


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
    if type(cu_q) is not torch.Tensor or type(cu_k) is not torch.Tensor:
        return Plan(*row_bounds(cu_q, cu_k, t_q, t_k, left, right))
    return _PLANS.get_or_compute(
        (cu_q, cu_k),
        lambda: Plan(*row_bounds(cu_q, cu_k, t_q, t_k, left, right)),
        extra=(t_q, t_k, left, right),
    )
