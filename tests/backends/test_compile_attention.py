"""The attention path under torch.compile and fake tensors (issue 13, attention part).

CPU (CI): ``torch.library.opcheck`` of the registered attention ops (the triton ops under
TRITON_INTERPRET, where they are opaque custom ops; the opaque host-backend op on sdpa / reference),
the triton op through ``torch.compile(backend="aot_eager", fullgraph=True)``, device-built offsets
from position_ids, a ``varlen_packed`` forward under ``FakeTensorMode``, and fullgraph aot_eager
training of tiny packed Llama / Mistral / Gemma2 models over packs of changing size and document
count: no graph break, at most 2 compilations, loss and gradients equal to eager under the
numerics rule; and the same models through the triton ops as a GPU registers them (traced bodies,
launches stubbed: tests/traced_triton_compile.py), where a shape guard inside the ops would show.

Recompiles: the model tests mark the token dimension and the document count dynamic
(``hf_varlen.metadata.mark_dynamic_pack``) rather than relying on automatic dynamic shapes alone,
which compiles static first and then once more for each dimension that changes later: the number
of documents may stay the same for several packs and then change (a third compilation, seen with
the packs here). Marked, the first graph is symbolic in both; only the ``max_length_q/k`` ints
recompile once (static first, symbolic after their first change): at most 2 compilations.

GPU (``-m gpu``): Inductor fullgraph compile of tiny Llama / Qwen3 / Mistral / Gemma2 on the triton
backend (bf16), at most 2 compilations over varying packs, compiled == eager under the bf16 rule.
"""

from __future__ import annotations

import copy
import random
import zlib

import pytest
import torch
import torch._dynamo
from tiny_packed import TINY, tiny_model
from torch._dynamo.utils import counters

import hf_varlen
from hf_varlen.backends.opaque import opaque_attention, opaque_attention_backward
from hf_varlen.metadata import (
    device_offsets_from_position_ids,
    from_position_ids,
    mark_dynamic_pack,
)
from hf_varlen.ops.attention import triton_varlen_attention
from hf_varlen.ops.attention.torch_library import backward_op, forward_op
from hf_varlen.testing import assert_numerics


def _model(kind, dtype=torch.float32, device="cpu"):
    model = tiny_model(kind, max_position_embeddings=512)
    return model.to(device=device, dtype=dtype).train()


def _packs(n, seed=0, max_docs=6):
    """n lists of document lengths: different totals and document counts every time.

    A pack whose documents all have 2 tokens is drawn again. Its only loss tokens are document
    starts, which attend to themselves alone, so every q/k gradient is exactly zero: the fp32
    reference is 0 and the numerics rule would compare two kernels' cancellation noise (the
    flash backward's rowsum(dO * O) against autograd's sum(P * dP)) instead of their accuracy."""
    rng = random.Random(seed)
    packs = []
    while len(packs) < n:
        lengths = [rng.randint(2, 20) for _ in range(rng.randint(1, max_docs))]
        if max(lengths) > 2:
            packs.append(lengths)
    return packs


def _batch(lengths, style, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + sum(lengths))
    rows = [{"input_ids": torch.randint(0, 97, (n,), generator=g).tolist()} for n in lengths]
    batch = hf_varlen.PackingCollator()(rows)
    if style == "position_ids":  # what TRL's padding-free collator sends: no offsets
        batch = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _CountingBackend:
    """A torch.compile backend that counts how often dynamo compiles a graph, and keeps the shape
    guards each compilation added after dynamo's trace (AOT autograd's and Inductor's), with where
    they were added: a recompile names its failing guard, but not who added it."""

    def __init__(self, backend):
        self.backend, self.compiles, self.backend_guards = backend, 0, []

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        from torch._guards import detect_fake_mode

        fake = detect_fake_mode(example_inputs)
        env = fake.shape_env if fake is not None else None
        before = len(env.guards) if env is not None else 0
        if self.backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            compiled = aot_eager(gm, example_inputs)
        else:
            from torch._inductor.compile_fx import compile_fx

            from hf_varlen.training.compiling import token_count_patches

            # as `hf-varlen train --compile` hands it: no Inductor size heuristic guards on T
            compiled = compile_fx(gm, example_inputs, config_patches=token_count_patches())
        if env is not None:
            self.backend_guards += [
                f"compilation {self.compiles}: {g.expr} at {_where(g.sloc)}"
                for g in env.guards[before:]
            ]
        return compiled

    def explain(self) -> str:
        """Why dynamo recompiled, and the guards the compiler backend added (for a failure)."""
        from torch._dynamo.utils import get_compilation_metrics

        reasons = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
        return "recompile reasons: {}; guards added while compiling: {}".format(
            reasons or "none", self.backend_guards or "none"
        )


def _where(sloc) -> str:
    """file:line of a shape guard's framework and user locations."""
    out = []
    for loc in (sloc.framework_loc, sloc.maybe_user_loc):
        if loc is not None:
            fn = getattr(loc, "filename", None)
            out.append(f"{fn.split('site-packages/')[-1]}:{loc.lineno}" if fn else str(loc))
    return " / ".join(out) or "?"


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # compiled: the same names
    grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    return loss.detach(), grads


def _train_compiled_vs_eager(
    kind, style, backend, *, device, dtype, ref_hi_dtype, steps=20, attn=None, attn_hi=None
):
    """Train a compiled model for ``steps`` packs; at every step its loss and gradients must equal
    eager ones from the same weights (ref_lo: eager in ``dtype``; ref_hi: eager in ref_hi_dtype).
    ``attn`` / ``attn_hi``: attention backends scoped to the models (None: auto)."""
    from torch._dynamo.utils import clear_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model = _model(kind, dtype, device)
    eager_hi = copy.deepcopy(model).to(ref_hi_dtype)
    if attn is not None:
        hf_varlen.set_backend(attn, model=model)
    if attn_hi is not None:
        hf_varlen.set_backend(attn_hi, model=eager_hi)
    eager_lo = copy.deepcopy(model)
    counting = _CountingBackend(backend)
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = {"x": [], "hi": [], "lo": []}
    for step, lengths in enumerate(_packs(steps, seed=zlib.crc32(f"{kind}{style}".encode()))):
        batch = _batch(lengths, style, device, seed=step)
        eager_lo.load_state_dict(model.state_dict())
        eager_hi.load_state_dict({k: v.to(ref_hi_dtype) for k, v in model.state_dict().items()})
        x_loss, x_grads = _loss_and_grads(compiled, mark_dynamic_pack(batch))
        lo_loss, lo_grads = _loss_and_grads(eager_lo, batch)
        hi_loss, hi_grads = _loss_and_grads(eager_hi, batch)
        tag = f"{kind}/{style} step {step} {lengths}"
        for key, loss in (("x", x_loss), ("hi", hi_loss), ("lo", lo_loss)):
            losses[key].append(loss)
        assert set(x_grads) == set(lo_grads)
        for name in x_grads:
            assert_numerics(
                f"{tag} grad {name}", x_grads[name], hi_grads[name], lo_grads[name], factor=3
            )
        opt.step()  # outside the compiled region
    # The loss is one scalar per step: one sample of each error, where the rule's max runs over
    # many elements (two equally good low-precision runs differ by 2x about a third of the time).
    # Its max runs over the steps instead: the per-step losses as one tensor.
    x, hi, lo = (torch.stack(losses[k]) for k in ("x", "hi", "lo"))
    assert_numerics(f"{kind}/{style} losses over {steps} packs", x, hi, lo)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counting.compiles <= 2, (
        f"{counting.compiles} compilations over {steps} packs; {counting.explain()}"
    )
    return counting.compiles


# ---- the registered ops -------------------------------------------------------------------------


def _qkv(t=20, h=4, h_kv=2, d=16, dtype=torch.float32, requires_grad=False, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(t, n, d, generator=g, dtype=dtype).to(device).requires_grad_(requires_grad)
        for n in (h, h_kv, h_kv)
    )


CU = [0, 7, 7, 15, 20]  # includes a zero-length document
# The triton ops run where the kernels run: CUDA when present (triton_op), else the interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("window,softcap", [((-1, 0), 0.0), ((3, 0), 5.0), ((-1, -1), 0.0)])
def test_opcheck_triton_attention_ops(window, softcap):
    q, k, v = _qkv(requires_grad=True, device=DEV)
    cu = torch.tensor(CU, dtype=torch.int32, device=DEV)
    args = (q, k, v, cu, cu, 0.25, window[0], window[1], softcap, False)
    torch.library.opcheck(forward_op, args)
    out, lse = forward_op(*args)
    do = torch.randn_like(out)
    plain = [t.detach() for t in (q, k, v, out, lse)]
    torch.library.opcheck(backward_op, (do, *plain[:3], *plain[3:], cu, cu, *args[5:]))


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_opcheck_opaque_attention(backend):
    q, k, v = _qkv(requires_grad=True)
    cu = torch.tensor(CU, dtype=torch.int32)
    args = (q, k, v, cu, cu, 8, 8, backend, 3, 0, 0.25, 0.0, False)
    torch.library.opcheck(opaque_attention, args)
    do = torch.randn(20, 4, 16)
    plain = [t.detach() for t in (q, k, v)]
    torch.library.opcheck(opaque_attention_backward, (do, *plain, *args[3:]))


def test_triton_attention_compiles_fullgraph_and_matches_eager():
    q, k, v = _qkv(requires_grad=True, device=DEV)
    cu = torch.tensor(CU, dtype=torch.int32, device=DEV)

    def f(q, k, v, cu):
        return triton_varlen_attention(
            q, k, v, cu, cu, causal=True, window_size=(4, 0), softcap=3.0
        )

    want = f(q, k, v, cu)
    do = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), do)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, cu)
    got_grads = torch.autograd.grad(got, (q, k, v), do)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernels
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_triton_attention_does_not_recompile_per_pack_under_dynamo():
    """torch._dynamo, fullgraph=True, automatic dynamic shapes: packs of different token and
    document counts compile at most twice (static first, then one symbolic graph)."""
    torch._dynamo.reset()
    counting = _CountingBackend("aot_eager")

    @torch.compile(backend=counting, fullgraph=True)
    def f(q, k, v, cu):
        return triton_varlen_attention(q, k, v, cu, cu, causal=True)

    for t, cu in ((20, CU), (13, [0, 5, 13]), (17, [0, 2, 9, 11, 16, 17]), (9, [0, 9])):
        q, k, v = _qkv(t=t, device=DEV)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
        want = triton_varlen_attention(q, k, v, cu_t, cu_t, causal=True)
        torch.testing.assert_close(f(q, k, v, cu_t), want, rtol=0, atol=0)
    assert counting.compiles <= 2


def test_auto_choice_log_adds_no_guard(monkeypatch):
    """``backend="auto"`` logs its choice once per process, from eager calls only: compiled
    first, then called eagerly (which logs), the compiled function does not recompile."""
    from hf_varlen.backends import registry

    monkeypatch.setattr(registry, "_AUTO_LOGGED", set())
    torch._dynamo.reset()
    counting = _CountingBackend("eager")
    cu = torch.tensor(CU, dtype=torch.int32)
    q, k, v = _qkv(t=CU[-1], device="cpu")

    def f(q, k, v):
        return hf_varlen.varlen_attention(q, k, v, cu, cu, CU[-1], CU[-1], causal=True)

    compiled = torch.compile(f, backend=counting)
    compiled(q, k, v)
    f(q, k, v)
    compiled(q, k, v)
    assert registry._AUTO_LOGGED and counting.compiles == 1


@pytest.mark.parametrize(
    "positions", [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 0, 0, 1], [0], [0, 0, 0]]
)
def test_device_offsets_from_position_ids(positions):
    pos = torch.tensor([positions])
    exact = from_position_ids(pos).cu_seqlens_q.tolist()  # the eager path (one sync)
    fixed = device_offsets_from_position_ids(pos)
    assert fixed.dtype == torch.int32 and fixed.shape == (len(positions) + 1,)
    assert fixed.tolist() == exact + [len(positions)] * (len(positions) + 1 - len(exact))


# ---- models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["collator", "position_ids"])
def test_varlen_packed_forward_under_fake_tensor_mode(style):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _model("llama")
    batch = _batch([5, 9, 3], style)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }
        out = model(**fake)
    assert out.logits.shape == (1, 17, TINY["vocab_size"])
    assert out.logits.dtype == torch.float32 and out.loss.shape == ()


@pytest.mark.parametrize("style", ["collator", "position_ids"])
def test_compiled_llama_training_matches_eager_without_recompiles(style):
    _train_compiled_vs_eager(
        "llama", style, "aot_eager", device="cpu", dtype=torch.float32, ref_hi_dtype=torch.float64
    )


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_compiled_window_and_softcap_models_match_eager(kind):
    _train_compiled_vs_eager(
        kind,
        "collator",
        "aot_eager",
        device="cpu",
        dtype=torch.float32,
        ref_hi_dtype=torch.float64,
        steps=6,
    )


@pytest.mark.parametrize(
    "kind,style,backward",
    [
        ("llama", "collator", "split"),
        ("mistral", "collator", "split"),
        ("gemma2", "position_ids", "split"),
        ("llama", "collator", "fused"),
        ("llama", "collator", "tma"),
    ],
)
def test_traced_triton_path_does_not_recompile_per_pack(kind, style, backward):
    """The GPU's registration of the triton ops (traced triton_op bodies: tile plan, launch code)
    on CPU with the launches stubbed out (tests/traced_triton_compile.py, a subprocess without
    TRITON_INTERPRET): over 20 varying packs at most 2 compilations, the second only for the
    collator's max_length ints. (The interpreted ops the other CPU tests compile are opaque, so a
    guard inside the op bodies — e.g. on the tile count — would only show on a GPU.) "tma":
    tensor descriptors asked for (KernelConfig.tma, not shipped), which a traced launch declines
    (attention_tma: Inductor cannot carry them into a graph, BENCHMARKS run Q)."""
    pytest.importorskip("triton")
    from traced_triton_compile import run

    (got,) = run(kind, style, "20", *([] if backward == "split" else [backward]))
    assert got["graph_breaks"] == {}, got
    assert got["compiles"] <= 2, got
    assert all("max_length" in r for r in got["recompile_reasons"]), got


def test_dropout_under_compile_with_an_opaque_backend_raises():
    q, k, v = _qkv()
    cu = torch.tensor(CU, dtype=torch.int32)

    def f(q, k, v, cu):
        return hf_varlen.varlen_attention(q, k, v, cu, cu, 8, 8, dropout_p=0.1, backend="sdpa")

    torch._dynamo.reset()
    with pytest.raises(Exception, match="dropout_p=0.1"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, cu)


# ---- GPU: Inductor on the triton backend ---------------------------------------------------------


def _inductor_bf16_vs_eager(kind, style):
    _train_compiled_vs_eager(
        kind,
        style,
        "inductor",
        device="cuda",
        dtype=torch.bfloat16,
        ref_hi_dtype=torch.float32,
        steps=12,
        attn="triton",
        attn_hi="reference",  # fp32 on CUDA with every feature (the triton kernel is fp16/bf16)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gemma2"])
@pytest.mark.parametrize("style", ["collator", "position_ids"])
def test_inductor_fullgraph_triton_backend_matches_eager_bf16(kind, style):
    """bf16 model compiled by Inductor on the triton attention backend; ref_lo = eager bf16,
    ref_hi = eager fp32 (the bf16 rule), at most 2 compilations over 12 packs."""
    _inductor_bf16_vs_eager(kind, style)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_inductor_fullgraph_fused_triton_backward_matches_eager_bf16(kind, fused_backward):
    """The same with the fused backward (atomic dQ into an fp32 buffer, KernelConfig.bwd_fused):
    Inductor must see the atomic kernel's mutation of that buffer (wrap_triton's analysis)."""
    _inductor_bf16_vs_eager(kind, "collator")
