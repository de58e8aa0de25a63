"""Model-level acceptance on tiny random configs (CPU, no downloads).

A packed batch through attn_implementation="varlen_packed" must give the same logits, loss and
gradients as the same sequences run one by one with "eager", under the numerics rule (fp32 model vs
eager fp32 = ref_lo and eager fp64 = ref_hi).
"""

from __future__ import annotations

import pytest
import torch
from tiny_packed import TINY, family_config, tiny_model
from transformers import AutoModelForCausalLM

import hf_varlen
from hf_varlen.testing import assert_numerics

LENGTHS = [7, 12, 3, 9]


def _model(kind, attn, dtype=torch.float32):
    model = tiny_model(kind, attn).to(dtype)
    model.train()  # dropout is 0 in these configs; train mode exercises the training code path
    return model


def _docs(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _run_eager_per_doc(model, docs):
    """Sum of token NLL, per-doc logits, and grads, running each document alone."""
    model.zero_grad()
    logits, total = [], 0.0
    for d in docs:
        out = model(input_ids=d[None], labels=None, use_cache=False)
        lg = out.logits[0]
        nll = torch.nn.functional.cross_entropy(lg[:-1].float(), d[1:], reduction="sum")
        nll.backward()
        total = total + nll.detach()
        logits.append(lg.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits), total, grads


def _run_packed(model, docs, style):
    collator = hf_varlen.PackingCollator()
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    if style == "collator":
        kwargs.update(
            {
                k: batch[k]
                for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
            }
        )
    model.zero_grad()
    lg = model(**kwargs).logits[0]
    labels = batch["labels"][0]
    # labels[i] is the token at i with -100 at each document start: predict labels[i+1] from i.
    nll = torch.nn.functional.cross_entropy(
        lg[:-1].float(), labels[1:], reduction="sum", ignore_index=-100
    )
    nll.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lg.detach(), nll.detach(), grads


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gemma2"])
@pytest.mark.parametrize("style", ["collator", "position_ids"])
def test_packed_varlen_matches_eager_per_document(kind, style):
    docs = _docs(TINY["vocab_size"])
    x_logits, x_loss, x_grads = _run_packed(_model(kind, "varlen_packed"), docs, style)
    lo_logits, lo_loss, lo_grads = _run_eager_per_doc(_model(kind, "eager"), docs)
    hi_logits, hi_loss, hi_grads = _run_eager_per_doc(_model(kind, "eager", torch.float64), docs)
    assert_numerics(f"{kind}/{style} logits", x_logits, hi_logits, lo_logits)
    assert_numerics(f"{kind}/{style} loss", x_loss, hi_loss, lo_loss)
    assert set(x_grads) == set(lo_grads)
    for name in x_grads:
        assert_numerics(
            f"{kind}/{style} grad {name}", x_grads[name], hi_grads[name], lo_grads[name], factor=3
        )


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_2d_mask_matches_eager_on_real_tokens(kind):
    docs = _docs(TINY["vocab_size"])[:2]  # lengths 7 and 12, right-padded to 12
    t = max(len(d) for d in docs)
    ids = torch.zeros(2, t, dtype=torch.long)
    mask = torch.zeros(2, t, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = d
        mask[i, : len(d)] = 1
    with torch.no_grad():
        got = _model(kind, "varlen_packed")(input_ids=ids, attention_mask=mask).logits
    # reference: each document alone through eager (eager's own padded path gives NaN rows in fp64)
    lo, _, _ = _run_eager_per_doc(_model(kind, "eager"), docs)
    hi, _, _ = _run_eager_per_doc(_model(kind, "eager", torch.float64), docs)
    assert_numerics(f"{kind} padded logits", got[mask.bool()], hi, lo)


def test_left_padded_generation_matches_eager():
    docs = _docs(TINY["vocab_size"])[:2]
    t = max(len(d) for d in docs)
    ids = torch.zeros(2, t, dtype=torch.long)
    mask = torch.zeros(2, t, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, t - len(d) :] = d
        mask[i, t - len(d) :] = 1
    outs = []
    for attn in ("varlen_packed", "eager"):
        model = _model("llama", attn).eval()
        outs.append(
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=5,
                do_sample=False,
                pad_token_id=0,
            )
        )
    assert torch.equal(outs[0], outs[1])


def test_cross_contamination_at_model_level():
    docs = _docs(TINY["vocab_size"])[:3]
    model = _model("llama", "varlen_packed")
    collator = hf_varlen.PackingCollator()
    base = collator([{"input_ids": d.tolist()} for d in docs])
    docs2 = [docs[0], torch.randint(0, TINY["vocab_size"], (len(docs[1]),)), docs[2]]
    pert = collator([{"input_ids": d.tolist()} for d in docs2])
    with torch.no_grad():
        a = model(**{k: v for k, v in base.items() if k != "labels"}).logits[0]
        b = model(**{k: v for k, v in pert.items() if k != "labels"}).logits[0]
    n0, n1 = len(docs[0]), len(docs[1])
    keep = torch.cat([torch.arange(0, n0), torch.arange(n0 + n1, a.shape[0])])
    assert torch.equal(a[keep], b[keep])
    assert not torch.equal(a[n0 : n0 + n1], b[n0 : n0 + n1])


def test_packed_loss_equals_unpacked_token_mean_and_trainer_num_items():
    """The HF loss with num_items_in_batch on a packed batch == per-token mean over unpacked docs."""
    docs = _docs(TINY["vocab_size"])
    model = _model("llama", "varlen_packed")
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    n_items = int((batch["labels"] != -100).sum())
    assert n_items == sum(len(d) - 1 for d in docs)  # every document's first label is -100
    with torch.no_grad():
        packed = model(**batch, num_items_in_batch=n_items).loss
        packed_mean = model(**batch).loss
        eager = _model("llama", "eager")
        total = sum(
            torch.nn.functional.cross_entropy(
                eager(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum"
            )
            for d in docs
        )
    torch.testing.assert_close(packed, total / n_items, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_mean, total / n_items, rtol=1e-5, atol=1e-6)


def test_register_idempotent_and_set_attn_implementation():
    assert hf_varlen.register() == "varlen_packed"
    assert hf_varlen.register() == "varlen_packed"
    with pytest.raises(ValueError, match="flash"):
        hf_varlen.register("my_flash_thing")
    model = _model("llama", "eager")
    model.set_attn_implementation("varlen_packed")
    assert model.config._attn_implementation == "varlen_packed"
    hf_varlen.register("varlen_custom")
    AutoModelForCausalLM.from_config(family_config("llama"), attn_implementation="varlen_custom")


def test_partial_collator_kwargs_rejected():
    from hf_varlen.integrations.transformers import varlen_packed_forward

    q = torch.randn(1, 2, 4, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass all four"):
        varlen_packed_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
