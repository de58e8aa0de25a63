"""CUDA-graph capture of the packed path (issue 14, item 2): nothing on it syncs with the host or
serves a value cached before the capture, so one captured forward + backward replays correctly on
new packs of the same static shape (same T, same cu_seq_lens length, other document lengths).

GPU only (a capture needs CUDA). Pattern: warm-up on a side stream, capture once, then for each new
pack copy its data into the static tensors, replay, and compare with eager on the same pack under
the numerics rule (ref_lo: eager in bf16 on the same backend; ref_hi: eager in fp32).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import hf_varlen
from hf_varlen.ops.cross_entropy import fused_linear_cross_entropy
from hf_varlen.reference.cross_entropy import linear_cross_entropy_reference
from hf_varlen.testing import assert_numerics

pytestmark = pytest.mark.gpu


def _capture(step):
    """Warm ``step`` up on a side stream, capture it; returns (graph, its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def test_fused_cross_entropy_replays_new_labels():
    """The row count of ignored labels differs between packs: the captured op must not have baked
    in the warm-up's count or row selection (by default it never compacts rows: nothing is read
    back)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 512, 64, 1000
    h = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / 8).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)

    def step():
        h.grad = w.grad = None
        loss = fused_linear_cross_entropy(h, w, y, reduction="mean")
        loss.backward()
        return loss

    graph, loss = _capture(step)
    grads = (h.grad, w.grad)  # the graph's own gradient buffers: replays write them
    for share in (0.1, 0.5, 1.0):  # ignored share of the labels in each new pack
        h.data.copy_(torch.randn(n, hidden, device="cuda", generator=gen))
        y.copy_(torch.randint(0, vocab, (n,), device="cuda", generator=gen))
        y[torch.rand(n, device="cuda", generator=gen) < share] = -100
        graph.replay()
        x = (loss.detach().clone(), *(g.clone() for g in grads))
        lo_loss = fused_linear_cross_entropy(h, w, y, reduction="mean")
        lo = (lo_loss.detach(), *torch.autograd.grad(lo_loss, (h, w)))  # .grad left alone
        h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
        hi_loss = linear_cross_entropy_reference(h64, w64, y, reduction="mean")
        hi_loss.backward()
        hi = (hi_loss.detach(), h64.grad, w64.grad)
        for i, name in enumerate(("loss", "dh", "dW")):
            assert_numerics(
                f"ignored {share} {name}", x[i], hi[i], lo[i], factor=2 if i == 0 else 3
            )


def _pack(lengths, vocab=97):
    rows = [{"input_ids": [random.randrange(vocab) for _ in range(n)]} for n in lengths]
    batch = hf_varlen.PackingCollator()(rows)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _lengths(rng, total, n_docs):
    cuts = sorted(rng.sample(range(2, total - 1), n_docs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def test_varlen_packed_llama_step_replays_new_packs(tiny_model):
    """A tiny Llama's forward + backward through varlen_packed (triton backend) and the fused loss,
    captured once and replayed on packs of the same T and document count but other boundaries."""
    model = tiny_model("llama", max_position_embeddings=512)
    hi_model = copy.deepcopy(model).cuda().float()
    model = model.cuda().bfloat16().train()
    hf_varlen.set_backend("triton", model=model)
    hf_varlen.set_backend("reference", model=hi_model)
    hf_varlen.install_fused_cross_entropy(model)
    total, n_docs, rng = 160, 5, random.Random(0)
    static = _pack(_lengths(rng, total, n_docs))
    # The max lengths are Python ints baked into the capture: give the bound every pack respects.
    static["max_length_q"] = static["max_length_k"] = total

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**static).loss
        loss.backward()
        return loss

    graph, loss = _capture(step)
    params = dict(model.named_parameters())
    grads = [p.grad for p in params.values()]  # the graph's own gradient buffers
    for i in range(3):
        new = _pack(_lengths(rng, total, n_docs))
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
            static[key].copy_(new[key])
        graph.replay()
        x = [loss.detach().clone()] + [g.clone() for g in grads]
        eager = {**new, "max_length_q": total, "max_length_k": total}
        lo_loss = model(**eager).loss
        lo = [lo_loss.detach(), *torch.autograd.grad(lo_loss, list(params.values()))]
        hi_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        hi_model.zero_grad(set_to_none=True)
        hi_loss = hi_model(**eager).loss
        hi_loss.backward()
        hi_params = dict(hi_model.named_parameters())
        hi = [hi_loss.detach()] + [hi_params[n].grad for n in params]
        names = ["loss", *params]
        for j, name in enumerate(names):
            assert_numerics(f"pack {i} {name}", x[j], hi[j], lo[j], factor=2 if j == 0 else 3)
