"""The fused cross-entropy's two row policies: every row (default) and ``drop_ignored_tokens``.

By default every row goes through the chunk loop: ignored ones get zero loss and gradients from
the row step and the kept-token count stays a device tensor, so nothing is read back to the host
(graph-safe, no sync mid-forward). ``drop_ignored_tokens=True`` drops the ignored rows before the
matmuls, which needs their count on the host (one sync per call) and is refused while a CUDA graph
is captured. Both must follow the numerics rule against each other and the fp64 full-logits
reference (ref_hi), for every reduction, with a bias, with all labels ignored, eager and through
the registered op (CPU, fp32, torch row step).
"""

from __future__ import annotations

import pytest
import torch

from hf_varlen.ops.cross_entropy import chunks, fused_linear_cross_entropy
from hf_varlen.ops.cross_entropy import torch_library as ce_ops
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


def _run(drop: bool | None, reduction: str, traced: bool, ref_dtype=torch.float64, **kw):
    """(loss, dh, dW, db) of the op in fp32 (drop None: the full-logits reference in
    ``ref_dtype``)."""
    h, w, b, y = _inputs(dtype=ref_dtype if drop is None else torch.float32, **kw)
    if drop is None:
        loss = linear_cross_entropy_reference(h, w, y, bias=b, reduction=reduction)
    elif traced:  # the registered op, as torch.compile calls it
        cfg = ce_ops.cfg_of(-100, reduction, None, 1.0, 0.0, 0.0, 8, "torch", drop)
        loss = ce_ops.fused_linear_ce_traced(h, w, b, y, cfg)
    else:
        loss = fused_linear_cross_entropy(
            h, w, y, bias=b, reduction=reduction, chunk_size=8, backend="torch",
            drop_ignored_tokens=drop,
        )  # fmt: skip
    scale = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).view(loss.shape)
    (loss * scale).sum().backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "op"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("all_ignored", [False, True], ids=["some", "all-ignored"])
def test_every_row_equals_dropped_rows(reduction, traced, all_ignored):
    # Both row policies against the reference itself (fp64 high, fp32 low), so that a bug they
    # share cannot widen the bound.
    hi = _run(None, reduction, traced, all_ignored=all_ignored)
    lo = _run(None, reduction, traced, torch.float32, all_ignored=all_ignored)
    dropped = _run(True, reduction, traced, all_ignored=all_ignored)
    x = _run(False, reduction, traced, all_ignored=all_ignored)
    for i, name in enumerate(("loss", "dh", "dW", "db")):
        factor = 2 if i == 0 else 3
        assert_numerics(f"{reduction} {name}", x[i], hi[i], lo[i], factor=factor)
        assert_numerics(f"{reduction} {name} (dropped)", dropped[i], hi[i], lo[i], factor=factor)
    if all_ignored:
        assert float(x[0].abs().sum()) == 0.0 and float(x[1].abs().sum()) == 0.0


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_default_reads_no_number_back(monkeypatch, reduction):
    """The default converts no tensor to a Python number and calls nothing data-dependent
    (nonzero): on CUDA each would be a host sync in the middle of the forward."""

    def refuse(*_a, **_k):
        raise AssertionError("the default fused cross-entropy read a tensor back to the host")

    h, w, b, y = _inputs()
    for name in ("__int__", "__bool__", "__float__", "item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss = fused_linear_cross_entropy(h, w, y, bias=b, reduction=reduction, backend="torch")
    loss.sum().backward()
    monkeypatch.undo()
    n_valid, idx, rows, labels = chunks.kept_rows(h, y, -100, False)
    assert isinstance(n_valid, torch.Tensor) and n_valid.dim() == 0  # a device count, no int()
    assert idx is None and rows is h and labels is y
    assert int(n_valid) == int((y != -100).sum())


def test_dropping_compacts_the_rows():
    h, _, _, y = _inputs()
    n_valid, idx, rows, _ = chunks.kept_rows(h, y, -100, True)
    assert n_valid == int((y != -100).sum()) and rows.shape[0] == n_valid and idx is not None


def test_dropping_is_refused_inside_a_capture(monkeypatch):
    """A CUDA-graph capture cannot read the count back: an explicit drop is an error there (never
    a silent switch of policy); the default runs unchanged."""
    monkeypatch.setattr(chunks, "capturing", lambda hidden: True)
    h, w, _, y = _inputs()
    with pytest.raises(ValueError, match="drop_ignored_tokens=True .* CUDA graph capture"):
        fused_linear_cross_entropy(h, w, y, backend="torch", drop_ignored_tokens=True)
    fused_linear_cross_entropy(h, w, y, backend="torch").backward()


def test_drop_option_is_checked():
    h, w, _, y = _inputs()
    with pytest.raises(TypeError, match="drop_ignored_tokens: expected True or False"):
        fused_linear_cross_entropy(h, w, y, drop_ignored_tokens="yes")
