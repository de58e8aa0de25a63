"""LoRA through peft on hf_varlen's fast paths (CPU; Triton kernels under TRITON_INTERPRET=1).

- ``kernelize`` on a peft-wrapped model (``PeftModel`` and the ``LoraModel`` inside it): RoPE,
  RMSNorm, the GLU activation product and the fused loss are installed; the LoRA-wrapped
  gate/up/down projections still run their adapters (the GLU layer calls the host's projection
  modules, so only ``act(gate) * up`` is fused). Logits, loss and every adapter gradient equal the
  un-kernelized peft model's within the numerics rule (ref_hi: fp64 copy, ref_lo: copy in the test
  dtype), and ``undo()`` gives back the original forwards: the same logits bit for bit.
- Packed == each document alone: a packed batch through ``varlen_packed`` and the kernelized peft
  model gives the loss (a sum over label tokens) and the adapter gradients of the documents run one
  by one through the plain peft model with eager attention, fp32 (ref_hi fp64).

B is random (peft initialises it to zero, which would hide the adapter's contribution).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_packed import TINY
from torch import nn

peft = pytest.importorskip("peft")

import hf_varlen  # noqa: E402
from hf_varlen import kernelize  # noqa: E402
from hf_varlen.testing import assert_numerics  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU test file (Triton under the interpreter)"
)
LENGTHS = (6, 9, 4)


def tiny_llama(attn: str = "eager", seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, head_dim=16, use_cache=False, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def with_lora(model: nn.Module, r: int = 4, seed: int = 1) -> nn.Module:
    """peft LoRA on every linear layer (q/k/v/o, gate/up/down), B random."""
    lora = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    wrapped = peft.get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return wrapped


def packed_batch(vocab: int = 97) -> dict:
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    return hf_varlen.PackingCollator()([{"input_ids": d} for d in docs]), docs


def step(model: nn.Module, batch: dict):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logits = out.logits.detach() if out.logits is not None else None
    return logits, out.loss.detach(), grads


def lora_grads(grads: dict) -> set[str]:
    return {n for n in grads if "lora_" in n}


@pytest.fixture(autouse=True)
def original_rope_afterwards(tmp_path_factory):
    """A temporary hub cache; the shared ``apply_rotary_pos_emb`` entry gets its forward back."""
    from transformers.models.llama import modeling_llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_VARLEN_CACHE", str(tmp_path_factory.mktemp("hf_varlen_cache")))
        yield
    vars(modeling_llama.apply_rotary_pos_emb).pop("forward", None)


@pytest.mark.parametrize(
    "wrapper,dtype",
    [("PeftModel", torch.float32), ("PeftModel", torch.bfloat16), ("LoraModel", torch.float32)],
)
def test_kernelize_peft_model_matches_and_undo_restores(wrapper, dtype):
    model = with_lora(tiny_llama()).to(dtype)
    target = model if wrapper == "PeftModel" else model.base_model
    assert type(target).__name__.startswith(wrapper)
    keys = ("input_ids", "labels", "position_ids")  # eager attention: positions restart only
    batch = {k: v for k, v in packed_batch()[0].items() if k in keys}
    hi = step(copy.deepcopy(model).double(), batch)
    lo = step(copy.deepcopy(model), batch)
    with torch.no_grad():
        before = model(**batch).logits

    report = kernelize(target, cross_entropy=False)
    assert report.counts == {"rmsnorm": 5, "rope": 2, "glu": 2, "cross_entropy": 0, "lora": 0}, (
        report
    )
    assert report.layers["LlamaMLP"] == "SwiGLUMLP"
    x = step(model, batch)
    assert_numerics("logits", x[0], hi[0], lo[0])
    assert_numerics("loss", x[1], hi[1], lo[1])
    assert x[2].keys() == lo[2].keys() and len(lora_grads(x[2])) == 2 * 2 * 7  # A, B x 7 x layers
    for name in lo[2]:  # the adapters of gate/up/down included: the GLU layer kept them
        assert_numerics(f"grad {name}", x[2][name], hi[2][name], lo[2][name], factor=3.0)

    # the fused loss too (it returns no logits in training)
    with_loss = kernelize(target)
    assert with_loss.installed("cross_entropy") and with_loss.counts["glu"] == 2
    y = step(model, batch)
    assert y[0] is None
    assert_numerics("fused loss", y[1], hi[1], lo[1], terms=sum(LENGTHS))

    with_loss.undo()
    assert not hf_varlen.is_fused_cross_entropy_installed(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


def test_packed_lora_equals_each_document_alone():
    """fp32: kernelized peft model on the packed batch (collator kwargs, varlen_packed, fused
    loss) == the plain peft model on each document alone (eager attention), for the summed loss
    and every adapter gradient; ref_hi: the per-document run in fp64."""
    batch, docs = packed_batch()
    n_items = int((batch["labels"] != -100).sum())
    assert n_items == sum(n - 1 for n in LENGTHS)

    def alone(model):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for d in docs:
            ids = torch.tensor([d])
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss
            loss.backward()
            total = total + loss.detach()
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = with_lora(tiny_llama("eager"))
    lo = alone(eager)
    hi = alone(copy.deepcopy(eager).double())
    packed = with_lora(tiny_llama("varlen_packed"))
    report = kernelize(packed)
    assert report.installed("cross_entropy") and report.counts["glu"] == 2
    packed.zero_grad(set_to_none=True)
    loss = packed(**batch, num_items_in_batch=n_items).loss
    loss.backward()
    grads = {n: p.grad for n, p in packed.named_parameters() if p.grad is not None}
    assert_numerics("packed loss", loss.detach(), hi[0], lo[0], terms=n_items)
    assert grads.keys() == lo[1].keys() == lora_grads(lo[1])  # only the adapters train
    for name in grads:
        assert_numerics(f"grad {name}", grads[name], hi[1][name], lo[1][name], factor=3.0)


def test_compiled_kernelized_peft_model_one_graph_no_break():
    """torch.compile(fullgraph=True, aot_eager) of the kernelized peft model (RoPE, RMSNorm, the
    GLU product between LoRA-wrapped projections, the fused loss) over two packs of different
    token and document counts: one compilation, no graph break; loss and adapter gradients of
    each pack under the numerics rule (ref_hi: the plain peft model in fp64, ref_lo: in fp32)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from hf_varlen.metadata import mark_dynamic_pack, symbolic_batch_ints

    plain = with_lora(tiny_llama("varlen_packed"))
    model = copy.deepcopy(plain)
    report = kernelize(model)
    assert report.counts["glu"] == 2 and report.installed("cross_entropy"), report.left_alone
    batches = [packed_batch()[0]]
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (12, 5)]
    batches.append(hf_varlen.PackingCollator()([{"input_ids": d} for d in docs]))
    refs = [(step(copy.deepcopy(plain).double(), b), step(plain, b)) for b in batches]

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    for batch, (hi, lo) in zip(batches, refs, strict=True):
        with symbolic_batch_ints():
            x = step(model, mark_dynamic_pack(dict(batch)))
        terms = int((batch["labels"] != -100).sum())
        assert_numerics("compiled loss", x[1], hi[1], lo[1], terms=terms)
        assert x[2].keys() == lo[2].keys() == lora_grads(lo[2])
        for name in lo[2]:
            assert_numerics(f"grad {name}", x[2][name], hi[2][name], lo[2][name], factor=3.0)
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}
