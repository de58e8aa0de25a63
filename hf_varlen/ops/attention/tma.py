"""Tensor descriptors (Hopper TMA) for the blocks the attention kernels stream in their inner loops.

A launch whose config sets ``KernelConfig.tma`` loads those blocks through a descriptor of the
whole packed tensor instead of per-lane pointers: K and V in the forward and dQ kernels, Q and dO
in the dK/dV kernel. The copy engine then moves each block into shared memory, so the kernel
spends no registers on the block's addresses and masks. Compiled for sm_90 with triton 3.6
(scripts/gpu_evidence/kernel_resources.py, docs/BENCHMARKS.md), the 32/8/128 kernels, which all sit at the
255-register cap, spill about half as much (long forward 262 -> 142 spill instructions, long dK/dV
136 -> 72; the short dK/dV's 13 and the short forward's 8 go to 0) and the dQ kernels need fewer
registers (short 255 -> 189). On the H200 that buys no time (scripts/bench_attention.py: f+b
0.95-1.68x the pointer loads, faster only on two 40/8/128 packs, by 2-5%), so no config ships
with it; it stays a tuning choice for later tritons.

Shapes: a descriptor covers a (T, H, D) tensor; its block is (rows, heads, D) at coordinates
(token, head, 0), read as (rows x heads, D) with rows token-major, heads minor: the row order of
the kernels' folded tiles (``FOLD`` heads of one KV group per token). Rows past T are zero-filled
by the hardware; rows inside T but outside a tile's span are real tokens the kernels mask, as they
mask other documents' rows of a shared tile.

A layout the hardware cannot describe (strides or base not 16-byte aligned, a padded head dim, a
block dimension that is not a power of two, more heads in a block than the tensor has, a GPU
before sm_90) and a tensor being traced by torch.compile get ``None``, and that launch loads
through pointers as before: ``tma`` is a tuning choice, never a user's.
"""

from __future__ import annotations

import torch

from .._triton_common import INTERPRET
from ..common import tracing

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a triton without host-side descriptors
    TensorDescriptor = None

MAX_BOX = 256  # the largest TMA box dimension


def tma_device(device: torch.device) -> bool:
    """Whether launches on ``device`` can take descriptors: sm_90 and newer, or the interpreter
    (which emulates them, so the CPU tests cover the descriptor path)."""
    if TensorDescriptor is None:
        return False
    if INTERPRET:
        return True
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def block_descriptor(t: torch.Tensor, rows: int, heads: int, block_d: int):
    """A descriptor of ``t`` (T, H, D) with blocks (rows, heads, D), or None where the layout
    cannot take one (see the module docstring)."""
    if TensorDescriptor is None or t.dim() != 3:
        return None
    size = t.element_size()
    if block_d != t.shape[2] or t.stride(2) != 1:
        return None
    if any(not _pow2(b) or b > MAX_BOX for b in (rows, heads, block_d)):
        return None
    # The token count is not compared with the box (a box longer than T is zero-filled): such a
    # test would put a guard on T into a compiled graph, a recompilation per pack size. Empty is
    # another matter (a descriptor needs every dimension > 0; compiled graphs assume T >= 2).
    if heads > t.shape[1] or t.shape[0] == 0:
        return None
    if block_d * size < 16 or (t.storage_offset() * size) % 16:
        return None
    if any((t.stride(i) * size) % 16 for i in (0, 1)):
        return None
    address = _data_ptr(t)
    if address is None or address % 16:
        return None
    return TensorDescriptor.from_tensor(t, [rows, heads, block_d])


def _data_ptr(t: torch.Tensor) -> int | None:
    """The address, or None for a traced (fake / functional) tensor. Traced launches take no
    descriptors: Inductor (torch 2.11) cannot carry a host-built descriptor into a graph (its
    mutation analysis loses the descriptor arguments and its graph cache fails hashing them), so
    a compiled graph loads through pointers."""
    if tracing(t):
        return None
    try:
        return t.data_ptr()
    except RuntimeError:  # a tensor without storage (functional wrappers)
        return None


def stream_descriptors(tma: bool, device, tensors, rows: int, heads: int, block_d: int):
    """Descriptors of ``tensors`` with (rows, heads, block_d) blocks when ``tma`` is asked for and
    every one of them can take one (``block_descriptor``), else None: the launch loads through
    pointers. The placeholders a kernel gets instead are the tensors themselves (never read)."""
    if not tma or not tma_device(device):
        return None
    descs = tuple(block_descriptor(t, rows, heads, block_d) for t in tensors)
    return None if any(d is None for d in descs) else descs
