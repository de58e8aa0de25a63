"""The flex backend's mask inputs (``hf_varlen.backends.flex_blocks``); CPU unless marked gpu.

- Equal, tensor for tensor, to what ``create_block_mask`` finds by evaluating the backend's own
  ``mask_mod`` on every (q, kv) pair: causal and not, left / right / two-sided windows, windows
  wider than the documents, L_q != L_k (bottom-right diagonal), padding past the last document
  (one spare block), one-token and zero-length documents, many documents in one block.
- ``torch.library.opcheck`` (schema, fake vs real, dynamic shapes).
- A compiled (aot_eager, fullgraph) packed forward on the flex backend over packs of changing size:
  the tables are one opaque op node (nothing of the mask build reaches the compiler, which is what
  failed in Inductor under torch 2.11), at most 2 compilations, output equal to eager. (A pack of
  one 128-token block compiles once more: size-1 dimensions specialise.)
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from hf_varlen.backends import flex
from hf_varlen.backends.flex_blocks import document_tables

TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _padded(total, spare=0):
    return -(-total // 128) * 128 + 128 * spare


def _cases():
    rng = random.Random(0)
    fixed = [
        ([1], None, True, (-1, -1), 0),
        ([128], None, True, (-1, -1), 0),
        ([1] * 300, None, True, (-1, -1), 0),  # many one-token documents per block
        ([700, 3, 41], None, False, (-1, -1), 1),
        ([500, 260], None, True, (100, 0), 0),
        ([500, 260], None, False, (1000, 1000), 0),  # window wider than any document
        ([300, 90], [40, 400], True, (-1, -1), 0),  # L_k < L_q and L_k > L_q per document
        ([256, 256], [513, 1], False, (64, 17), 1),
        ([5, 0, 0, 200, 0, 0], None, True, (-1, -1), 0),  # zero-length documents (device offsets)
        ([0, 130], [7, 0], True, (-1, -1), 1),
    ]
    drawn = []
    for _ in range(40):
        n = rng.randint(1, 6)
        lq = [rng.randint(1, 300) for _ in range(n)]
        lk = None if rng.random() < 0.5 else [rng.randint(1, 300) for _ in range(n)]
        causal = rng.random() < 0.6
        window = rng.choice(
            [(-1, -1), (rng.randint(0, 200), 0 if causal else -1), (rng.randint(0, 200),) * 2]
        )
        drawn.append((lq, lk, causal, window, rng.randint(0, 1)))
    return fixed + drawn


def _check_tables(lq, lk, causal, window, spare, device):
    cu_q = _cu(lq).to(device)
    cu_k = cu_q if lk is None else _cu(lk).to(device)
    total_q = _padded(int(cu_q[-1]), spare)
    total_k = total_q if lk is None else _padded(int(cu_k[-1]))
    flex._MASKS.clear()
    ours = flex.document_block_mask(cu_q, cu_k, total_q, total_k, causal=causal, window_size=window)
    ref = create_block_mask(ours.mask_mod, None, None, total_q, total_k, device=device)
    for name in TABLES:
        got, want = getattr(ours, name), getattr(ref, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("lq, lk, causal, window, spare", _cases())
def test_block_tables_equal_create_block_mask(lq, lk, causal, window, spare):
    _check_tables(lq, lk, causal, window, spare, "cpu")


def test_opcheck_block_tables():
    cu_q, cu_k = _cu([200, 7, 90]), _cu([150, 60, 1])
    for args in ((cu_q, cu_q, 384, 384, -1, 0, 128), (cu_q, cu_k, 384, 256, 50, 3, 128)):
        torch.library.opcheck(document_tables, args)


def test_compiled_flex_forward_keeps_block_tables_opaque():
    from torch._dynamo.backends.debugging import aot_eager

    from hf_varlen.functional import varlen_attention
    from hf_varlen.testing import assert_numerics

    torch._dynamo.reset()
    seen, compiles = [], []

    def backend(gm, example_inputs):
        compiles.append(1)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    def attend(q, k, v, cu, max_len, backend="flex"):
        return varlen_attention(q, k, v, cu, cu, max_len, max_len, backend=backend, causal=True)

    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for lengths in ([100, 50], [300, 7, 20], [1000, 24], [60, 70, 5], [129]):
        cu = _cu(lengths)
        t = int(cu[-1])
        q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
        for x in (q, k, v, cu):  # what mark_dynamic_pack does to a batch
            torch._dynamo.maybe_mark_dynamic(x, 0)
        with torch.no_grad():
            got = compiled(q, k, v, cu, max(lengths))
            lo = attend(q, k, v, cu, max(lengths))
            hi = attend(q.double(), k.double(), v.double(), cu, max(lengths), "reference")
        assert_numerics(f"flex {lengths}", got, hi, lo)
    tables = [s for s in seen if "flex_document_tables" in s]
    assert tables and not [s for s in seen if "argsort" in s or "sort." in s], seen
    assert len(compiles) <= 2, len(compiles)


@pytest.mark.gpu
@pytest.mark.parametrize("lq, lk, causal, window, spare", _cases()[::4])
def test_gpu_block_tables_equal_create_block_mask(lq, lk, causal, window, spare):
    _check_tables(lq, lk, causal, window, spare, "cuda")


@pytest.mark.gpu
def test_gpu_inductor_flex_fp32_training_step_over_changing_packs():
    """What failed at a4f1b57 (H200, torch 2.11): Inductor, dynamic token count, fp32, forward and
    backward of the flex backend inside a compiled graph (CantSplit in the traced mask build)."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    from hf_varlen.functional import varlen_attention
    from hf_varlen.testing import assert_numerics

    torch._dynamo.reset()
    clear_compilation_metrics()
    compiles = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiles.append(1)
        return compile_fx(gm, example_inputs)

    def step(q, k, v, cu, max_len, backend="flex"):
        out = varlen_attention(q, k, v, cu, cu, max_len, max_len, backend=backend, causal=True)
        return (out.float() ** 2).sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for lengths in ([100, 50], [300, 7, 20], [1000, 24], [257], [60, 70, 5]):
        cu = _cu(lengths).cuda()
        t = int(cu[-1])
        base = [torch.randn(t, h, 64, generator=g, device="cuda") for h in (4, 2, 2)]
        runs = {}
        for name, dtype, fn, be in (
            ("x", torch.float32, compiled, "flex"),
            ("lo", torch.float32, step, "flex"),
            ("hi", torch.float64, step, "reference"),
        ):
            qkv = [x.detach().to(dtype, copy=True).requires_grad_() for x in base]
            for x in (*qkv, cu):
                torch._dynamo.maybe_mark_dynamic(x, 0)
            loss = fn(*qkv, cu, max(lengths)) if fn is compiled else fn(*qkv, cu, max(lengths), be)
            loss.backward()
            runs[name] = [x.grad for x in qkv]
        for i, which in enumerate("qkv"):
            assert_numerics(
                f"d{which} {lengths}",
                runs["x"][i],
                runs["hi"][i],
                runs["lo"][i],
                factor=3,
                terms=max(lengths),  # fp32 blockwise partial sums, as test_triton_attention.check
            )
    reasons = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
    assert len(compiles) <= 2, f"{len(compiles)} compilations; recompile reasons: {reasons}"
