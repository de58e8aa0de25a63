"""Mixed precision through attn_implementation="varlen_packed" (CPU bf16 autocast).

fp32 weights under bf16 autocast, the configuration of ``Trainer(bf16=True)`` and TRL's defaults:
the projections run in bf16, then RoPE multiplies q and k by fp32 cos/sin, so the attention
function receives fp32 q, k and a bf16 v. varlen_packed casts all three to one dtype exactly as
transformers' FlashAttention path decides it (autocast dtype, else the layer's weight dtype, else
the common dtype); the functional API keeps refusing mixed dtypes.

Numerics: packed varlen_packed under autocast (x) against each document run alone through eager
under the same autocast (ref_lo) and through eager in fp64 (ref_hi), by the numerics rule (hf_varlen.testing).
"""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TINY, tiny_model
from tiny_runs import HF_CPU_STEPS
from transformers import Trainer, TrainingArguments
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_varlen
from hf_varlen.integrations.transformers import attention_dtype, varlen_packed_forward
from hf_varlen.testing import assert_numerics

LENGTHS = [7, 12, 3, 9]
AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def _model(kind, attn, dtype=torch.float32, gradient_checkpointing=False):
    model = tiny_model(kind, attn).to(dtype)
    model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _docs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in LENGTHS]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _per_doc(model, docs, autocast):
    """(logits, per-token NLL, grads of the summed NLL), each document run alone."""
    model.zero_grad()
    logits, nlls = [], []
    for d in docs:
        with torch.autocast(**AUTOCAST, enabled=autocast):
            lg = model(input_ids=d[None]).logits[0]
        nll = torch.nn.functional.cross_entropy(lg[:-1].float(), d[1:], reduction="none")
        nll.sum().backward()
        nlls.append(nll.detach())
        logits.append(lg.detach())
    return torch.cat(logits), torch.cat(nlls), _grads(model)


def _packed(model, docs):
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    labels = batch.pop("labels")[0]
    model.zero_grad()
    with torch.autocast(**AUTOCAST):
        lg = model(**batch).logits[0]
    nll = torch.nn.functional.cross_entropy(
        lg[:-1].float(), labels[1:], reduction="none", ignore_index=-100
    )
    nll.sum().backward()
    # per-token NLL in document order (the ignored first label of each document dropped)
    return lg.detach(), nll.detach()[labels[1:] != -100], _grads(model)


@pytest.fixture
def dtype_spy(monkeypatch):
    """Records the (q, k, v) dtypes and output dtype of every varlen_packed call."""
    seen = []
    name = hf_varlen.ATTN_IMPLEMENTATION
    inner = ALL_ATTENTION_FUNCTIONS[name]

    def spy(module, q, k, v, mask, **kwargs):
        out = inner(module, q, k, v, mask, **kwargs)
        seen.append(((q.dtype, k.dtype, v.dtype), out[0].dtype))
        return out

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, spy)
    return seen


MIXED = (torch.float32, torch.float32, torch.bfloat16)


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize(
    # gemma2's softcap is served by the reference backend on CPU ("auto" picks it)
    "kind,backend",
    [("llama", "sdpa"), ("llama", "reference"), ("qwen3", "sdpa"), ("gemma2", "auto")],
)
def test_fp32_weights_under_bf16_autocast(kind, backend, gradient_checkpointing, dtype_spy):
    docs = _docs()
    hf_varlen.set_backend(backend)
    try:
        model = _model(kind, "varlen_packed", gradient_checkpointing=gradient_checkpointing)
        x_logits, x_loss, x_grads = _packed(model, docs)
    finally:
        hf_varlen.set_backend(None)
    assert dtype_spy and {s[0] for s in dtype_spy} == {MIXED}, dtype_spy
    assert {s[1] for s in dtype_spy} == {torch.bfloat16}
    if gradient_checkpointing:  # the backward recomputed every layer under the same autocast
        assert len(dtype_spy) == 2 * TINY["num_hidden_layers"]
    assert x_logits.dtype == torch.bfloat16
    lo_logits, lo_loss, lo_grads = _per_doc(_model(kind, "eager"), docs, autocast=True)
    hi_logits, hi_loss, hi_grads = _per_doc(_model(kind, "eager", torch.float64), docs, False)
    tag = f"{kind}/{backend}/{'ckpt' if gradient_checkpointing else 'plain'}"
    assert_numerics(f"{tag} logits", x_logits, hi_logits, lo_logits)
    # per-token NLL: fp32 values of bf16 logits, so the rule's max statistic runs over tokens
    assert_numerics(f"{tag} token NLL", x_loss, hi_loss, lo_loss)
    assert set(x_grads) == set(lo_grads) == set(hi_grads)
    for name, g in x_grads.items():
        assert g.dtype == torch.float32  # fp32 master weights get fp32 gradients
        assert_numerics(f"{tag} grad {name}", g, hi_grads[name], lo_grads[name], factor=3)


def test_gradient_checkpointing_changes_nothing_under_autocast():
    docs = _docs()
    plain = _packed(_model("llama", "varlen_packed"), docs)
    ckpt = _packed(_model("llama", "varlen_packed", gradient_checkpointing=True), docs)
    assert torch.equal(plain[0], ckpt[0]) and torch.equal(plain[1], ckpt[1])
    for name in plain[2]:
        torch.testing.assert_close(ckpt[2][name], plain[2][name], rtol=0, atol=0)


class _Attn(torch.nn.Module):
    """A stand-in attention module: one Linear whose weight dtype is the layer's dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, dtype=dtype)


def test_attention_dtype_mirrors_transformers_flash_rule():
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

    def t(dtype):
        return torch.zeros(1, dtype=dtype)

    # fp32 query under autocast: the autocast dtype, whatever the weights are.
    with torch.autocast("cpu", dtype=bf16):
        assert attention_dtype(_Attn(f32), t(f32), t(f32), t(bf16)) == bf16
    with torch.autocast("cpu", dtype=f16):
        assert attention_dtype(_Attn(f32), t(f32), t(f32), t(f16)) == f16
    # no autocast, fp32 query: the layer's weight dtype (PEFT's fp32 norms in a bf16 model)
    assert attention_dtype(_Attn(bf16), t(f32), t(f32), t(f32)) == bf16
    assert attention_dtype(_Attn(f32), t(f32), t(f32), t(f32)) == f32
    # no Linear in the module, or a non-fp32 query: the common dtype
    assert attention_dtype(torch.nn.Module(), t(f32), t(f32), t(bf16)) == f32
    assert attention_dtype(_Attn(f32), t(bf16), t(bf16), t(bf16)) == bf16
    assert attention_dtype(_Attn(f32), t(bf16), t(bf16), t(f32)) == f32
    assert attention_dtype(_Attn(f32), t(f64), t(f64), t(f64)) == f64


def test_attention_function_casts_mixed_inputs_without_autocast():
    """No autocast, a bare module: fp32 q/k with a bf16 v run in the common dtype (fp32)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 5, 16, generator=g)
    out, _ = varlen_packed_forward(torch.nn.Module(), q, k, v.bfloat16(), None)
    ref, _ = varlen_packed_forward(torch.nn.Module(), q, k, v.bfloat16().float(), None)
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)


def test_functional_api_keeps_refusing_mixed_dtypes():
    q = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match="must share one floating dtype"):
        hf_varlen.varlen_attention(q, q, q.bfloat16(), cu, cu, 5, 5)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)  # it does not cast for it either
    with autocast, pytest.raises(TypeError, match="must share one floating dtype"):
        hf_varlen.varlen_attention(q, q, q.bfloat16(), cu, cu, 5, 5)
    assert hf_varlen.varlen_attention(q, q, q, cu, cu, 5, 5).shape == q.shape  # still works


class _Examples(torch.utils.data.Dataset):
    def __init__(self, n=12):
        g = torch.Generator().manual_seed(2)
        self.rows = [
            {"input_ids": torch.randint(0, TINY["vocab_size"], (int(n_tok),), generator=g).tolist()}
            for n_tok in torch.randint(3, 15, (n,), generator=g)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _trainer_losses(attn, bf16, tmp_path, steps=3):
    model = _model("llama", attn)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"{attn}-{bf16}"),
        bf16=bf16,
        gradient_checkpointing=True,
        max_steps=steps,
        **HF_CPU_STEPS,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=_Examples(), data_collator=hf_varlen.PackingCollator()
    )
    trainer.train()
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def test_hf_trainer_bf16_gradient_checkpointing_packing_collator(tmp_path, dtype_spy):
    """Trainer(bf16=True, gradient_checkpointing=True) + PackingCollator for a few CPU steps; each
    step's loss follows the numerics rule against transformers' own sdpa packed path in fp32
    (ref_hi) and under the same bf16 autocast (ref_lo): neither reference runs varlen_packed, so
    a bug of ours cannot widen the bound."""
    x = _trainer_losses("varlen_packed", True, tmp_path)
    assert dtype_spy and MIXED in {s[0] for s in dtype_spy}
    dtype_spy.clear()
    fp32 = _trainer_losses("varlen_packed", False, tmp_path)
    assert {s[0] for s in dtype_spy} == {(torch.float32,) * 3}  # no autocast: no cast
    assert torch.isfinite(fp32).all()
    hi = _trainer_losses("sdpa", False, tmp_path).double()
    lo = _trainer_losses("sdpa", True, tmp_path)
    assert len(x) == len(hi) == len(lo) == 3 and torch.isfinite(x).all()
    assert_numerics("Trainer bf16 losses", x, hi, lo)
