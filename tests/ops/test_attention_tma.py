"""Tensor-descriptor (TMA) loads of the attention kernels' streamed blocks (KernelConfig.tma,
attention_tma.py): which layouts take a descriptor, the kernels with descriptors forced on against
the reference, and bitwise against pointer loads (CPU: TRITON_INTERPRET=1 emulates descriptors;
no config ships with tma on CUDA: slower or even on the H200, docs/BENCHMARKS.md run Q)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from attn_cases import cu_from_lengths
from test_triton_attention import DEVICE, check

from hf_varlen.ops.attention import bwd as attention_bwd
from hf_varlen.ops.attention import fwd as attention_fwd
from hf_varlen.ops.attention import launch as attention
from hf_varlen.ops.attention import schedule as attention_schedule
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.ops.attention.schedule import kernel_launch
from hf_varlen.ops.attention.tma import block_descriptor


def _force_tma(monkeypatch, on: bool = True, long: bool = True):
    """Every launch of the test asks for descriptors (``on``), with or without the long path."""
    pick, pick_long = attention.pick_config, attention.pick_long_path

    def with_tma(cfg):
        return dataclasses.replace(cfg, tma=on)

    monkeypatch.setattr(attention, "pick_config", lambda *a: with_tma(pick(*a)))
    if long:
        monkeypatch.setattr(
            attention,
            "pick_long_path",
            lambda *a: (lp := pick_long(*a)) and dataclasses.replace(lp, cfg=with_tma(lp.cfg)),
        )
    else:
        monkeypatch.setattr(attention, "pick_long_path", lambda *a: None)


def _record_descriptors(monkeypatch) -> list:
    """Whether each launch got descriptors (``stream_descriptors`` returned some)."""
    used = []
    real = attention_fwd.stream_descriptors

    def spy(*args, **kwargs):
        descs = real(*args, **kwargs)
        used.append(descs is not None)
        return descs

    monkeypatch.setattr(attention_fwd, "stream_descriptors", spy)
    monkeypatch.setattr(attention_bwd, "stream_descriptors", spy)
    return used


# ---- which layouts take a descriptor ------------------------------------------------------------


def test_block_descriptor_takes_aligned_layouts():
    x = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    desc = block_descriptor(x, 32, 2, 64)
    assert desc is not None and list(desc.block_shape) == [32, 2, 64]
    assert list(desc.shape) == [40, 8, 64] and list(desc.strides) == [512, 64, 1]
    # head-major memory (as a transposed (H, T, D) projection arrives): strides (D, T * D, 1)
    head_major = torch.randn(8, 40, 64, dtype=torch.bfloat16).transpose(0, 1)
    assert list(block_descriptor(head_major, 16, 1, 64).strides) == [64, 40 * 64, 1]


@pytest.mark.parametrize(
    "why, make, block",
    [
        ("padded head dim", lambda: torch.randn(40, 8, 48), (32, 1, 64)),
        ("heads not a power of two", lambda: torch.randn(40, 8, 64), (32, 3, 64)),
        ("rows not a power of two", lambda: torch.randn(40, 8, 64), (24, 1, 64)),
        ("more heads than the tensor", lambda: torch.randn(40, 2, 64), (32, 4, 64)),
        ("box past 256", lambda: torch.randn(600, 2, 64), (512, 1, 64)),
        ("under 16 bytes a row", lambda: torch.randn(40, 8, 2, dtype=torch.bfloat16), (8, 1, 2)),
        (
            "token stride unaligned",
            lambda: torch.randn(40, 8 * 64 + 1)[:, :512].view(40, 8, 64),
            (32, 1, 64),
        ),  # fmt: skip
        ("base unaligned", lambda: torch.randn(40 * 8 * 64 + 1)[1:].view(40, 8, 64), (32, 1, 64)),
        ("last dim strided", lambda: torch.randn(40, 8, 64).transpose(1, 2), (32, 1, 8)),
        ("no rows", lambda: torch.randn(0, 8, 64), (32, 1, 64)),
    ],
)
def test_block_descriptor_refuses_what_tma_cannot_describe(why, make, block):
    assert block_descriptor(make(), *block) is None, why


def test_block_descriptor_refuses_traced_tensors():
    # what torch.compile traces: Inductor cannot take a host-built descriptor into a graph (run Q)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(40, 8, 64, dtype=torch.bfloat16)
        assert block_descriptor(fake, 32, 2, 64) is None


def test_tma_is_part_of_a_launch_and_of_the_override(tmp_path, monkeypatch):
    cfg = attention_schedule._INTERPRETER_CONFIG
    on = dataclasses.replace(cfg, tma=True)
    assert all(kernel_launch(cfg, k, 2) != kernel_launch(on, k, 2) for k in ("fwd", "dq", "kv"))
    tiles = [128, 32, 4, 3, 16, 64, 64, 4, 2, 32, 64, 32, 4, 3, 8]
    path = tmp_path / "cfg.json"
    path.write_text(
        json.dumps({"128": tiles + [0, 2, 1], "64": tiles, "long128": tiles + [0, 0, 1]})
    )
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))
    cuda = torch.device("cuda")
    assert attention_schedule.pick_config(128, torch.bfloat16, cuda).tma is True
    assert attention_schedule.pick_config(128, torch.bfloat16, cuda).kv_stages_unfolded == 2
    assert attention_schedule.pick_config(64, torch.bfloat16, cuda).tma is False
    assert attention_schedule.pick_long_path(128, torch.bfloat16, cuda).cfg.tma is True
    assert not any(c.tma for c in attention_schedule._CUDA_CONFIGS.values())  # none shipped yet


# ---- the kernels with descriptors ---------------------------------------------------------------

TMA_CASES = {
    "gqa": ([5, 30, 40, 3, 102, 2, 18], 4, 2, {}),
    "mha_window": ([20, 31, 7, 45, 12], 2, 2, {"window_size": (5, -1)}),
    "mqa_softcap_non_causal": ([20, 31, 7, 45, 12], 4, 1, {"softcap": 5.0, "causal": False}),
    "cross_lengths": ([9, 40, 3], 4, 2, {"lengths_k": [30, 12, 70]}),
}


@pytest.mark.parametrize("with_long", [True, False])
@pytest.mark.parametrize("case", TMA_CASES)
def test_tma_matches_reference(case, with_long, monkeypatch):
    lengths, h_q, h_kv, kw = TMA_CASES[case]
    _force_tma(monkeypatch, long=with_long)
    used = _record_descriptors(monkeypatch)
    check(lengths, h_q, h_kv, 16, torch.float32, **kw)
    # forward, dQ and dK/dV each launch with descriptors (twice each with the long path)
    assert used == [True] * (3 + 3 * with_long)


def test_tma_fp16(monkeypatch):
    _force_tma(monkeypatch)
    used = _record_descriptors(monkeypatch)
    check([5, 30, 40, 3, 102, 2, 18], 4, 2, 16, torch.float16)
    assert all(used)


def _run(q, k, v, cu, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = triton_varlen_attention(q, k, v, cu, cu)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_tma_is_bitwise_the_pointer_path(layout, monkeypatch):
    """Descriptors load the same values; the keys / query rows they read past a tile's span
    (zeros past T, real rows inside it) are masked to p = 0, so every output and gradient is
    bitwise the pointer loads' (the head-major layout is how a transposed projection arrives)."""
    lengths = [70, 3, 33, 1, 90, 12]
    total, h_q, h_kv, d = sum(lengths), 4, 2, 16
    g = torch.Generator().manual_seed(3)

    def make(h):
        x = torch.randn(h, total, d, generator=g).to(DEVICE, torch.float16)
        return x.transpose(0, 1) if layout == "head_major" else x.transpose(0, 1).contiguous()

    q, k, v = make(h_q), make(h_kv), make(h_kv)
    grad = torch.randn(total, h_q, d, generator=g).to(DEVICE, torch.float16)
    cu = cu_from_lengths(lengths, DEVICE)
    _force_tma(monkeypatch, on=False)
    plain = _run(q, k, v, cu, grad)
    monkeypatch.undo()
    _force_tma(monkeypatch, on=True)
    used = _record_descriptors(monkeypatch)
    with_tma = _run(q, k, v, cu, grad)
    assert used and all(used)
    for name, a, b in zip(("out", "dq", "dk", "dv"), plain, with_tma):
        assert torch.equal(a, b), name


def test_tma_falls_back_to_pointers_where_the_layout_has_no_descriptor(monkeypatch):
    """A padded head dim (D 12 in 16-wide blocks) and a fold that is not a power of two (3 query
    heads per KV head) load through pointers, with the same results."""
    _force_tma(monkeypatch, long=False)
    used = _record_descriptors(monkeypatch)
    check([5, 30, 40, 3], 6, 2, 12, torch.float32)
    assert used == [False] * 3
    used.clear()
    check([5, 30, 40, 3], 6, 2, 16, torch.float32)
    # forward and dQ stream K/V (one head a block); dK/dV folds 3 heads: 5 tokens x 3 + 1 padding row
    assert attention_schedule.fold_factor(3, 16, 4) == 3
    assert used == [True, True, False]


def _tma_override(tmp_path, monkeypatch) -> None:
    """The shipped tiles with tma on, short and long path, through the tuning override."""
    path = tmp_path / "tma.json"
    cfgs = {}
    for dim in (64, 128):
        short = dataclasses.astuple(attention_schedule._CUDA_CONFIGS[dim])
        long = dataclasses.astuple(attention_schedule._CUDA_LONG[dim].cfg)
        cfgs[str(dim)] = [*short[:15], int(short[15]), short[16], 1]
        cfgs[f"long{dim}"] = [*long[:15], int(long[15]), long[16], 1]
    cfgs["long_min_span"] = 1024
    path.write_text(json.dumps(cfgs))
    monkeypatch.setenv("HF_VARLEN_TRITON_ATTN_CONFIG", str(path))


def _gpu_lengths() -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 300, (40,), generator=g).tolist() + [3000]


@pytest.mark.gpu
def test_gpu_tma_matches_reference(tmp_path, monkeypatch):
    """Descriptors forced on, short and long path, bf16 / fp16, GQA folds 4 and 1 (40/8 heads:
    the forward folds 5, which loads K/V by descriptor all the same), head dims 128 and 64, a
    softcap."""
    _tma_override(tmp_path, monkeypatch)
    used = _record_descriptors(monkeypatch)
    check(_gpu_lengths(), 32, 8, 128, torch.bfloat16)
    check(_gpu_lengths(), 40, 8, 128, torch.bfloat16)
    check(_gpu_lengths(), 16, 16, 64, torch.float16, softcap=20.0)
    check([5, 9], 32, 8, 128, torch.bfloat16)  # 14 tokens: boxes longer than the tensor
    assert used and all(used)


@pytest.mark.gpu
def test_gpu_tma_fused_backward_matches_reference(tmp_path, monkeypatch, fused_backward):
    """The fused backward with descriptors: dQ reduced into its fp32 buffer one block at a time
    (cp.reduce.async.bulk, which the interpreter cannot run: only here is it tested)."""
    _tma_override(tmp_path, monkeypatch)
    used = _record_descriptors(monkeypatch)
    check(_gpu_lengths(), 32, 8, 128, torch.bfloat16)
    check(_gpu_lengths(), 16, 16, 64, torch.float16)
    assert used and all(used)


def test_tma_with_the_fused_backward(monkeypatch, fused_backward):
    """The fused (atomic dQ) backward with descriptors: Q/dO streamed, the dQ buffer described
    too (on the GPU its blocks are reduced in bulk; the interpreter adds them per element)."""
    _force_tma(monkeypatch)
    used = _record_descriptors(monkeypatch)
    check([5, 30, 40, 3, 102, 2, 18], 4, 2, 16, torch.float32)
    assert used == [True] * 4  # forward (short + long), dK/dV (short + long): no dQ kernel
