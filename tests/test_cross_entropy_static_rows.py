"""The fused cross-entropy without row compaction (what runs while a CUDA graph is captured).

Normally ignored rows are dropped before the matmuls, which needs their count on the host (one
sync per loss call). During CUDA-graph capture ``ops.cross_entropy_chunks.compact_rows`` is False: every
row goes through the chunk loop, ignored ones get zero loss and gradients from the row step, and
the label count stays a device tensor. Here that path is forced on CPU (fp32, torch row step) and
must follow the numerics rule with ref_lo = the compacting path (how the op normally runs) and
ref_hi = the full-logits reference in fp64, for every reduction, with a bias, with all labels
ignored, eager and through the registered op.
"""

from __future__ import annotations

import pytest
import torch

from hf_varlen.ops import cross_entropy_chunks as chunks
from hf_varlen.ops import cross_entropy_ops as ce_ops
from hf_varlen.ops.cross_entropy import fused_linear_cross_entropy
from hf_varlen.reference.cross_entropy import linear_cross_entropy_reference
from hf_varlen.testing import assert_numerics


def _inputs(n=29, hidden=8, vocab=70, *, dtype=torch.float32, all_ignored=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, w, b = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for shape in ((n, hidden), (vocab, hidden), (vocab,))
    )
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[::3] = -100
    if all_ignored:
        y[:] = -100
    return h, w, b, y


def _run(monkeypatch, compact: bool | None, reduction: str, traced: bool, **kw):
    """(loss, dh, dW, db) of the op (compact None: the fp64 full-logits reference)."""
    monkeypatch.setattr(chunks, "compact_rows", lambda hidden: compact)
    h, w, b, y = _inputs(dtype=torch.float64 if compact is None else torch.float32, **kw)
    if compact is None:
        loss = linear_cross_entropy_reference(h, w, y, bias=b, reduction=reduction)
    elif traced:  # the registered op, as torch.compile calls it
        cfg = ce_ops.cfg_of(-100, reduction, None, 1.0, 0.0, 0.0, 8, "torch")
        loss = ce_ops.fused_linear_ce_traced(h, w, b, y, cfg)
    else:
        loss = fused_linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, chunk_size=8, backend="torch"
        )
    scale = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).view(loss.shape)
    (loss * scale).sum().backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "op"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("all_ignored", [False, True], ids=["some", "all-ignored"])
def test_uncompacted_rows_equal_compacted(monkeypatch, reduction, traced, all_ignored):
    hi = _run(monkeypatch, None, reduction, traced, all_ignored=all_ignored)
    lo = _run(monkeypatch, True, reduction, traced, all_ignored=all_ignored)
    x = _run(monkeypatch, False, reduction, traced, all_ignored=all_ignored)
    for i, name in enumerate(("loss", "dh", "dW", "db")):
        factor = 2 if i == 0 else 3
        assert_numerics(f"{reduction} {name}", x[i], hi[i], lo[i], factor=factor)
    if all_ignored:
        assert float(x[0].abs().sum()) == 0.0 and float(x[1].abs().sum()) == 0.0


def test_uncompacted_rows_read_nothing_back(monkeypatch):
    monkeypatch.setattr(chunks, "compact_rows", lambda hidden: False)
    h, _, _, y = _inputs()
    n_valid, idx, rows, labels = chunks.kept_rows(h, y, -100)
    assert isinstance(n_valid, torch.Tensor) and n_valid.dim() == 0  # a device count, no int()
    assert idx is None and rows is h and labels is y
    assert int(n_valid) == int((y != -100).sum())


def test_rows_are_compacted_outside_a_capture():
    h, _, _, y = _inputs()
    assert chunks.compact_rows(h)
    n_valid, idx, rows, _ = chunks.kept_rows(h, y, -100)
    assert n_valid == int((y != -100).sum()) and rows.shape[0] == n_valid and idx is not None
