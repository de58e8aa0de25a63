"""QLoRA: bitsandbytes NF4 bases through transformers' ``BitsAndBytesConfig`` with peft LoRA,
packed batches, ``varlen_packed`` and hf_varlen's kernels. The flags, refusals and the config
handed to ``from_pretrained`` are ``tests/training/test_train_lora.py`` (no bitsandbytes needed).
Everything here needs bitsandbytes and CUDA (``pytest -m gpu``). Not on CPU: bitsandbytes 0.50
quantises there, but its CPU 4-bit matmul (``bitsandbytes::gemv_4bit``) has no autograd kernel
(torch warns "silently incorrect"), and the input gradients through a 4-bit layer came out wrong
in this very check (40-85% off before the last layer): the reason ``--load-in-4bit`` needs CUDA.

- ``hf-varlen train --lora --load-in-4bit`` on a tiny pretrained folder and on a preset (saved and
  reloaded in 4-bit): the base linear layers are bitsandbytes ``Linear4bit``, only the adapters
  train, the losses are finite and move, RMSNorm / GLU / the fused loss run fused.
- Packed == each document alone: the kernelized 4-bit LoRA model on a packed batch against a plain
  model holding the dequantised weights (the values the 4-bit matmul multiplies by), each document
  alone with eager attention: ref_lo in bf16, ref_hi in fp64; the loss (a sum over label tokens)
  and every adapter gradient under the numerics rule in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_runs import tiny_train_config

import hf_varlen
from hf_varlen.testing import assert_numerics

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
LENGTHS = (37, 80, 11)


def _folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["folder", "preset"])
def test_qlora_trains_on_gpu(tmp_path, source):
    from hf_varlen.training import PackedTrainer

    model = {"model": _folder(tmp_path), "tokenizer": "bytes"} if source == "folder" else {}
    cfg = tiny_train_config(
        tmp_path, "q", lora=True, lora_r=8, load_in_4bit=True, max_steps=4, lr=1e-3, **model
    )
    trainer = PackedTrainer(cfg)
    quantised = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    layers = trainer.model.config.num_hidden_layers  # every q/k/v/o and gate/up/down
    assert len(quantised) == 7 * layers, [type(m).__name__ for m in trainer.model.modules()]
    summary = trainer.run()
    assert 0 < summary["trainable"] < summary["params"] / 5
    for kind in ("rmsnorm x", "glu x"):
        assert kind in summary["kernels"], summary["kernels"]
    assert "fused linear cross-entropy" in summary["loss_impl"], summary["loss_impl"]
    assert all(p.requires_grad == ("lora_" in n) for n, p in trainer.model.named_parameters())


def _with_lora(model):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return wrapped


@pytest.mark.gpu
def test_qlora_packed_equals_each_document_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_varlen import kernelize
    from hf_varlen.training.model import quantization_kwargs

    folder = _folder(tmp_path)
    device = torch.device("cuda", torch.cuda.current_device())
    q = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="varlen_packed", dtype=torch.bfloat16,
        **quantization_kwargs(device),
    )  # fmt: skip
    plain = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).to(device)
    with torch.no_grad():  # the values the 4-bit matmul multiplies by
        for name, m in q.named_modules():
            if isinstance(m, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
                plain.get_submodule(name).weight.copy_(w.float())
    q, plain = _with_lora(q), _with_lora(plain)
    adapters = {n: p for n, p in q.named_parameters() if "lora_" in n}
    loaded = plain.load_state_dict(adapters, strict=False)
    assert not loaded.unexpected_keys and len(adapters) == 2 * 2 * 7  # A, B x 7 x layers
    report = kernelize(q)
    assert report.counts["glu"] == 2 and report.installed("cross_entropy"), report.left_alone

    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in LENGTHS]
    batch = hf_varlen.PackingCollator()([{"input_ids": d} for d in docs])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    n_items = int((batch["labels"] != -100).sum())
    q.train()
    loss = q(**batch, num_items_in_batch=n_items).loss
    loss.backward()
    grads = {n: p.grad for n, p in q.named_parameters() if p.grad is not None}

    def alone(model):
        model.train()
        total = 0.0
        for d in docs:
            ids = torch.tensor([d], device=device)
            part = model(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss
            part.backward()
            total = total + part.detach()
        return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    lo = alone(copy.deepcopy(plain).to(torch.bfloat16))
    hi = alone(plain.double())
    bf16 = torch.bfloat16
    assert_numerics("4-bit packed loss", loss.detach(), hi[0], lo[0], terms=n_items, dtype=bf16)
    assert grads.keys() == hi[1].keys() and all("lora_" in n for n in grads)
    for name in grads:
        assert_numerics(
            f"grad {name}", grads[name], hi[1][name], lo[1][name], factor=3.0, dtype=bf16
        )
