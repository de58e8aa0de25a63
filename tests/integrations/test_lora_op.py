"""The one-op LoRA projection (``hf_varlen.ops.lora_linear``) and its peft integration
(``kernelize(model, lora=True)``), on CPU.

- Numerics rule against ``reference/lora.py`` (peft's own order of ops): output and dx, dA, dB
  (and dW, dbias where the base trains), fp32 and bf16; ref_hi the reference in fp64, ref_lo in
  the test dtype. Inputs stay bit-identical; the upstream gradient is non-contiguous.
- What the backward keeps: the saved tensors are x, the (N, r) intermediate and the weights;
  nothing of N x O elements.
- ``torch.library.opcheck``; torch.compile (fullgraph, aot_eager) with the token dimension
  dynamic: one compilation over several token counts, equal to eager.
- peft: ``kernelize(peft_model, lora=True)`` puts q/k/v/o and gate/up/down on the op, with the
  other kernels and the fused loss; loss and adapter gradients equal the plain peft model (fp32,
  bf16, and bf16 autocast over fp32 weights), packed; peft's states (disable_adapter, merge) still
  mean what they mean; undo restores the model bit for bit; layers it cannot compute (dropout,
  DoRA) are left alone with the reason; the whole kernelized LoRA model compiles once, no break.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_lora import LENGTHS, packed_batch, tiny_llama, with_lora

from hf_varlen import kernelize
from hf_varlen.integrations.kernelize.peft_lora import is_ours
from hf_varlen.ops.lora import lora_linear
from hf_varlen.ops.lora.function import _lora_linear_op
from hf_varlen.reference.lora import lora_linear_reference
from hf_varlen.testing import assert_numerics

peft = pytest.importorskip("peft")
# The peft-model tests run hf_varlen's Triton layers on CPU tensors (interpreter only)
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU model test (Triton under the interpreter)"
)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
N_LEAD, K, OUT, R = (3, 7), 24, 20, 4


def _inputs(dtype, bias=True, base_trains=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device, dtype)

    x = rand(*N_LEAD, K)
    w, b = rand(OUT, K, scale=K**-0.5), rand(OUT) if bias else None
    a, bb = rand(R, K, scale=K**-0.5), rand(OUT, R, scale=0.3)
    dy = rand(*N_LEAD, 2 * OUT)[..., ::2]  # non-contiguous upstream gradient
    trains = (True, base_trains, base_trains and bias, True, True)
    return [x, w, b, a, bb], dy, trains


def _run(fn, tensors, dy, trains, dtype):
    leaves = [
        None if t is None else t.detach().to(dtype).requires_grad_(r)
        for t, r in zip(tensors, trains, strict=True)
    ]
    y = fn(*leaves, 2.0)
    y.backward(dy.to(dtype))
    return y.detach(), [None if t is None or not r else t.grad for t, r in zip(leaves, trains)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias,base_trains", [(True, False), (False, False), (True, True)])
def test_lora_linear_matches_reference(dtype, bias, base_trains, device):
    tensors, dy, trains = _inputs(dtype, bias, base_trains, device=device)
    before = [None if t is None else t.clone() for t in tensors]
    y, grads = _run(lora_linear, tensors, dy, trains, dtype)
    hi_y, hi_grads = _run(lora_linear_reference, tensors, dy, trains, torch.float64)
    lo_y, lo_grads = _run(lora_linear_reference, tensors, dy, trains, dtype)
    assert y.dtype == dtype and y.shape == (*N_LEAD, OUT)
    assert_numerics("y", y, hi_y, lo_y)
    names = ("dx", "dW", "dbias", "dA", "dB")
    for name, g, hi, lo in zip(names, grads, hi_grads, lo_grads, strict=True):
        assert (g is None) == (lo is None), name
        if g is not None:
            assert_numerics(name, g, hi, lo, factor=3.0)
    for t, b in zip(tensors, before, strict=True):
        assert t is None or torch.equal(t, b)


def test_backward_keeps_no_output_sized_activation():
    tensors, _, trains = _inputs(torch.float32)
    leaves = [t.requires_grad_(r) for t, r in zip(tensors, trains, strict=True)]
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_linear(*leaves, 2.0)
    rows = N_LEAD[0] * N_LEAD[1]
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(rows, K), (rows, R), (OUT, K), (R, K), (OUT, R)]), shapes
    assert saved[0].data_ptr() == tensors[0].data_ptr()  # x itself, not a copy


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(bias):
    tensors, _, _ = _inputs(torch.float32, bias)
    x, w, b, a, bb = tensors
    args = (x.reshape(-1, K).requires_grad_(), w, b, a.requires_grad_(), bb.requires_grad_(), 0.5)
    torch.library.opcheck(_lora_linear_op, args)


def test_bad_inputs_raise_before_compute():
    (x, w, b, a, bb), _, _ = _inputs(torch.float32)
    with pytest.raises(TypeError, match="lora_a must have x's dtype"):
        lora_linear(x, w, b, a.double(), bb, 2.0)
    with pytest.raises(ValueError, match="shapes do not chain"):
        lora_linear(x, w, b, a[:, :-1], bb, 2.0)
    with pytest.raises(ValueError, match="shapes do not chain"):
        lora_linear(x, w, b, a, bb[:, :-1], 2.0)
    with pytest.raises(TypeError, match="scale must be a Python float"):
        lora_linear(x, w, b, a, bb, torch.tensor(2.0))
    assert lora_linear(x, w, b, a, bb, 2.0).shape == (*N_LEAD, OUT)  # still works after


def test_compiles_once_over_token_counts():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lora_linear, backend=counter, fullgraph=True)
    (_, w, b, a, bb), _, _ = _inputs(torch.float32)
    a.requires_grad_()
    for n in (5, 9, 17):
        x = torch.randn(n, K, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        y = compiled(x, w, b, a, bb, 2.0)
        y.sum().backward()
        ref_x, ref_a = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
        lora_linear_reference(ref_x, w, b, ref_a, bb, 2.0).sum().backward()
        torch.testing.assert_close(y, lora_linear_reference(x, w, b, a, bb, 2.0))
        torch.testing.assert_close(x.grad, ref_x.grad)
        a.grad = None
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}


# ------------------------------------------------------------------------------------ peft model


@pytest.fixture(autouse=True)
def hub_cache_and_rope(tmp_path_factory):
    from transformers.models.llama import modeling_llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_VARLEN_CACHE", str(tmp_path_factory.mktemp("hf_varlen_cache")))
        yield
    vars(modeling_llama.apply_rotary_pos_emb).pop("forward", None)


def _train_step(model, batch, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@cpu_only
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast"])
def test_kernelized_lora_model_matches_peft(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast = precision == "bf16-autocast"
    model = with_lora(tiny_llama("varlen_packed")).to(dtype)
    batch = packed_batch()[0]
    n_items = int((batch["labels"] != -100).sum())
    hi = _train_step(copy.deepcopy(model).double(), batch)
    lo = _train_step(copy.deepcopy(model), batch, autocast)

    # fp32 with the Triton layers around the op (GLU calls the fused gate/up/down); the bf16
    # cases are about the op's casts, without the interpreter's seconds per layer call
    layers = {} if precision == "fp32" else dict(rope=False, glu=False, rmsnorm=False)
    report = kernelize(model, **layers, lora=True)
    assert report.counts["lora"] == 2 * 7, report.left_alone
    assert report.counts["glu"] == (2 if precision == "fp32" else 0)
    assert report.installed("cross_entropy") and report.layers["lora.Linear"] == "lora_linear"
    assert not any(why.startswith("lora.") for why in report.left_alone.values())
    x = _train_step(model, batch, autocast)
    low = torch.bfloat16 if precision != "fp32" else None
    assert_numerics("loss", x[0], hi[0], lo[0], terms=n_items, dtype=low)
    assert x[1].keys() == lo[1].keys() and all("lora_" in n for n in x[1])
    for name in lo[1]:
        assert_numerics(f"grad {name}", x[1][name], hi[1][name], lo[1][name], factor=3.0, dtype=low)


@cpu_only
def test_peft_states_and_undo():
    model = with_lora(tiny_llama("eager"))
    batch = {k: packed_batch()[0][k] for k in ("input_ids", "position_ids")}
    off = dict(rope=False, glu=False, rmsnorm=False, cross_entropy=False)
    with torch.no_grad():
        before = model(**batch).logits
        with model.disable_adapter():
            base = model(**batch).logits
    report = kernelize(model, **off, lora=True)
    assert report.counts["lora"] == 14
    report.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)
    kernelize(model, lora=True, cross_entropy=False)  # a later call without lora removes it too
    kernelize(model, cross_entropy=False)
    assert not any(is_ours(m) for m in model.modules())

    kernelize(model, **off, lora=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before)
        with model.disable_adapter():  # peft's own forward: the base model alone
            assert torch.equal(model(**batch).logits, base)
        model.merge_adapter()  # peft's own forward on the merged weight
        torch.testing.assert_close(model(**batch).logits, before)


@cpu_only
def test_layers_it_cannot_compute_are_left_alone_with_the_reason():
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(tiny_llama(), config)
    report = kernelize(model, rope=False, glu=False, rmsnorm=False, cross_entropy=False, lora=True)
    assert report.counts["lora"] == 0
    assert (
        "lora_dropout=0.1" in report.left_alone["base_model.model.model.layers.0.self_attn.q_proj"]
    )
    dora = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=4, target_modules=["v_proj"], use_dora=True)
    )
    report = kernelize(dora, rope=False, glu=False, rmsnorm=False, cross_entropy=False, lora=True)
    assert report.counts["lora"] == 0
    assert "DoRA" in report.left_alone["base_model.model.model.layers.1.self_attn.v_proj"]
    plain = kernelize(
        tiny_llama(), rope=False, glu=False, rmsnorm=False, cross_entropy=False, lora=True
    )
    assert "no peft LoRA layer" in plain.left_alone["lora"]


@cpu_only
def test_kernelized_lora_model_compiles_once_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import hf_varlen
    from hf_varlen.metadata import mark_dynamic_pack, symbolic_batch_ints

    # LoRA op + fused loss; the Triton layers' compile is tested in test_compile_ops.py (and
    # under the interpreter each of their calls costs seconds here)
    layers = dict(rope=False, glu=False, rmsnorm=False)
    model = with_lora(tiny_llama("varlen_packed"))
    eager = copy.deepcopy(model)
    kernelize(eager, **layers, lora=True)
    report = kernelize(model, **layers, lora=True)
    assert report.counts["lora"] == 14 and report.installed("cross_entropy")
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for lengths in (LENGTHS, (5, 11), (3, 4, 8, 2)):
        docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]
        batch = hf_varlen.PackingCollator()([{"input_ids": d} for d in docs])
        ref = eager(**batch).loss  # first: its backend choice is logged once, outside the graph
        ref.backward()
        with symbolic_batch_ints():
            loss = model(**mark_dynamic_pack(dict(batch))).loss
        loss.backward()
        torch.testing.assert_close(loss, ref)
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and len(grads) == 28
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name])
