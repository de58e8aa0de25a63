"""Fused linear cross-entropy: the op against the full-logits reference, and the HF wiring.

Op tests compare the loss and every gradient (hidden, weight, bias) with the numerics rule
(``hf_varlen.testing.assert_numerics``): ref_hi is the reference in fp64, ref_lo the reference in
the input dtype (bf16 logits + fp32 loss, as HF computes it). Both row-step backends run: "torch"
and "triton" (under TRITON_INTERPRET=1 on CPU, so kept to small shapes). Model tests check that a
tiny HF model trains identically with and without ``install_fused_cross_entropy``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from hf_varlen.integrations.loss import (
    install_fused_cross_entropy,
    is_fused_cross_entropy_installed,
    uninstall_fused_cross_entropy,
)
from hf_varlen.ops import cross_entropy as ce
from hf_varlen.ops.cross_entropy import fused_linear_cross_entropy
from hf_varlen.reference.cross_entropy import linear_cross_entropy_reference
from hf_varlen.testing import assert_numerics

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = [
    "torch",
    pytest.param(
        "triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
    ),
]


def _inputs(n=37, hidden=16, vocab=300, *, dtype=torch.float32, bias=False, lead=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if lead is None else lead
    h = torch.randn(*shape, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5 * 2
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.5 if bias else None
    y = torch.randint(0, vocab, shape, generator=gen)
    y.view(-1)[::4] = -100
    return h, w, b, y


def _leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


def _close(name, x, ref_hi, ref_lo, factor, dtype):
    """fp32 inputs: fp32 tolerance of the fp64 reference; fp16/bf16 inputs: the numerics rule."""
    if dtype == torch.float32:
        scale = ref_hi.abs().max().item() if ref_hi.numel() else 0.0
        torch.testing.assert_close(x.double(), ref_hi, rtol=2e-5, atol=2e-6 * scale, msg=name)
    else:
        assert_numerics(name, x, ref_hi, ref_lo, factor=factor)


def _check_against_reference(h, w, b, y, dtype, *, kwargs, op_kwargs):
    """Run the op in ``dtype`` and the reference in fp64 and in ``dtype``; compare (``_close``)."""
    ours, hi, lo = (
        _leaves((h, w, b), dtype),
        _leaves((h, w, b), torch.float64),
        _leaves((h, w, b), dtype),
    )
    out = fused_linear_cross_entropy(ours[0], ours[1], y, bias=ours[2], **kwargs, **op_kwargs)
    out_hi = linear_cross_entropy_reference(hi[0], hi[1], y, bias=hi[2], **kwargs)
    out_lo = linear_cross_entropy_reference(lo[0], lo[1], y, bias=lo[2], **kwargs)
    assert out.dtype == torch.float32 and out.shape == out_hi.shape
    _close("loss", out, out_hi, out_lo, 2.0, dtype)
    grad = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64, device=out.device)
    grad = grad.view(out.shape)
    out.backward(grad.float())
    out_hi.backward(grad)
    out_lo.backward(grad.float())
    for name, a, b_hi, b_lo in zip(("hidden", "weight", "bias"), ours, hi, lo):
        if a is not None:
            assert a.grad.dtype == a.dtype
            _close(f"d{name}", a.grad, b_hi.grad, b_lo.grad, 3.0, dtype)


CASES = {
    "plain": {},
    "softcap": {"softcap": 2.5},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "everything": {"softcap": 4.0, "label_smoothing": 0.2, "z_loss": 0.05, "logit_scale": 0.7},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
}


# ----------------------------------------------------------------------------------------------
# The op against the reference
# ----------------------------------------------------------------------------------------------


def test_reference_is_f_cross_entropy():
    h, w, _, y = _inputs()
    logits = h @ w.T
    for reduction in ("sum", "mean", "none"):
        want = F.cross_entropy(logits, y, reduction=reduction, label_smoothing=0.1)
        got = linear_cross_entropy_reference(h, w, y, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(backend, case):
    h, w, b, y = _inputs(bias=case == "everything")
    # chunk 16 does not divide 37 tokens (28 kept): three chunks, the last one partial
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.float32,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 16, "backend": backend},
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["plain", "everything", "none"])
def test_matches_reference_bf16(backend, case):
    h, w, b, y = _inputs(n=64, hidden=32, vocab=500, bias=True, seed=1)
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.bfloat16,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 24, "backend": backend},
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_hidden_and_int32_labels(backend):
    h, w, b, y = _inputs(lead=(3, 11), bias=True)
    _check_against_reference(
        h,
        w,
        b,
        y.int(),
        torch.float32,
        kwargs={"reduction": "none"},
        op_kwargs={"chunk_size": 7, "backend": backend},
    )


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_ignored_rows_and_all_ignored(reduction):
    h, w, _, y = _inputs(n=40)
    y[:16] = -100  # the first whole chunk of 16 is ignored
    _check_against_reference(
        h, w, None, y, torch.float32, kwargs={"reduction": reduction}, op_kwargs={"chunk_size": 16}
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction, backend):
    """No label token at all: loss 0 (also for "mean", where F.cross_entropy gives NaN) and
    exactly zero, finite gradients for hidden, weight and bias (as HF's loss gives)."""
    h, w, b, y = _inputs(n=40, bias=True)
    ignored = torch.full_like(y, -100)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    out = fused_linear_cross_entropy(
        hh, ww, ignored, bias=bb, reduction=reduction, backend=backend, chunk_size=16
    )
    want = linear_cross_entropy_reference(h, w, ignored, bias=b, reduction=reduction)
    assert torch.count_nonzero(out) == 0 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want)
    out.sum().backward()
    for name, t in (("hidden", hh), ("weight", ww), ("bias", bb)):
        assert torch.isfinite(t.grad).all() and torch.count_nonzero(t.grad) == 0, name


def test_row_kernel_vocab_tail_ignored_and_out_of_range_rows():
    """The Triton row step (several BLOCK_V blocks, a partial last one) equals the torch one."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen) * 4
    labels = torch.tensor([5, -100, 299, 0, 300, 17])  # ignored row, last column, out of range
    for kwargs in (
        {},
        {"softcap": 3.0, "label_smoothing": 0.1, "z_loss": 0.01, "logit_scale": 1.5},
    ):
        cfg = ce._LossConfig(
            -100,
            "sum",
            kwargs.get("softcap"),
            kwargs.get("logit_scale", 1.0),
            kwargs.get("label_smoothing", 0.0),
            kwargs.get("z_loss", 0.0),
            None,
            "triton",
        )
        scale = torch.linspace(0.5, 2.0, 6)
        a, b = logits.clone(), logits.clone()
        loss_a, loss_b = torch.empty(6), torch.empty(6)
        ce.ce_rows_triton(a, labels, loss_a, cfg, compute_grad=True, row_scale=scale, block_v=64)
        ce.ce_rows_torch(b, labels, loss_b, cfg, compute_grad=True, row_scale=scale)
        torch.testing.assert_close(loss_a, loss_b, equal_nan=True)
        assert loss_a[1] == 0 and torch.isnan(loss_a[4])
        keep = torch.tensor([0, 1, 2, 3, 5])  # the NaN row's gradient is unspecified
        torch.testing.assert_close(a[keep], b[keep])
        assert torch.count_nonzero(a[1]) == 0


def test_forward_only_and_partial_grads():
    h, w, b, y = _inputs(bias=True)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    with torch.no_grad():
        out = fused_linear_cross_entropy(hh, ww, y, bias=bb, chunk_size=8)
    torch.testing.assert_close(out.double(), linear_cross_entropy_reference(h, w, y, bias=b))
    ww.requires_grad_(False)  # frozen head (e.g. LoRA without lm_head): dW is not computed
    fused_linear_cross_entropy(hh, ww, y, bias=bb.detach(), chunk_size=8).backward()
    hr = h.clone().requires_grad_()
    linear_cross_entropy_reference(hr, w, y, bias=b).backward()
    torch.testing.assert_close(hh.grad.double(), hr.grad, rtol=1e-5, atol=1e-6)
    assert ww.grad is None


def test_tied_embeddings_accumulate():
    gen = torch.Generator().manual_seed(4)
    emb = torch.randn(300, 16, generator=gen)
    ids = torch.randint(0, 300, (30,), generator=gen)
    y = torch.randint(0, 300, (30,), generator=gen)
    grads = []
    for fn in (fused_linear_cross_entropy, linear_cross_entropy_reference):
        e = emb.clone().requires_grad_()
        hidden = torch.tanh(F.embedding(ids, e))
        fn(hidden, e, y).backward()
        grads.append(e.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_autocast_casts_like_linear():
    h, w, _, y = _inputs()
    hh, ww = _leaves((h, w), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(hh, ww, y)
        want = linear_cross_entropy_reference(h.float(), w.float(), y)
    out.backward()
    assert (
        out.dtype == torch.float32
        and hh.grad.dtype == torch.float32
        and ww.grad.dtype == torch.float32
    )
    torch.testing.assert_close(out, want, rtol=1e-3, atol=0)


def test_backward_twice_raises_and_inputs_unchanged():
    h, w, b, y = _inputs(bias=True)
    hh, ww, bb = _leaves((h, w, b), torch.float32)
    before = [t.detach().clone() for t in (hh, ww, bb, y)]
    out = fused_linear_cross_entropy(hh, ww, y, bias=bb)
    out.backward(retain_graph=True)
    for t, t0 in zip((hh, ww, bb, y), before):
        assert torch.equal(t, t0)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"hidden": torch.zeros(5, 8, dtype=torch.float64)}, TypeError, "hidden: expected dtype"),
        ({"weight": torch.zeros(10, 8, dtype=torch.bfloat16)}, TypeError, "weight: expected dtype"),
        ({"weight": torch.zeros(10, 7)}, ValueError, r"weight: expected shape \(V, 8\)"),
        ({"labels": torch.zeros(6, dtype=torch.long)}, ValueError, "labels: expected shape"),
        ({"labels": torch.zeros(5)}, TypeError, "labels: expected dtype"),
        ({"bias": torch.zeros(9)}, ValueError, "bias: expected a tensor of shape"),
        ({"reduction": "avg"}, ValueError, "reduction: expected one of"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"label_smoothing": 1.0}, ValueError, "label_smoothing"),
        ({"z_loss": -1.0}, ValueError, "z_loss"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"backend": "cuda"}, ValueError, "backend: expected one of"),
    ],
)
def test_bad_input_raises_before_launch(change, error, match):
    args = {
        "hidden": torch.zeros(5, 8),
        "weight": torch.zeros(10, 8),
        "labels": torch.zeros(5, dtype=torch.long),
    }
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)
    h, w, _, y = _inputs()  # a valid call in the same process still works
    assert torch.isfinite(fused_linear_cross_entropy(h.float(), w.float(), y))


def test_default_chunk_size():
    cuda = torch.device("cuda")
    assert ce.default_chunk_size(32768, 151936, torch.bfloat16, cuda) == 3328
    assert ce.default_chunk_size(100, 151936, torch.bfloat16, cuda) == 100
    assert ce.default_chunk_size(10**6, 10**7, torch.float32, torch.device("cpu")) == 256


# ----------------------------------------------------------------------------------------------
# HF wiring
# ----------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
TINY = dict(
    vocab_size=301,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attn_implementation="eager",
    use_cache=False,
)


def _model(family="llama", **overrides):
    torch.manual_seed(0)
    config_cls, model_cls, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 3.0}),
        "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
        "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
        "mixtral": (
            "MixtralConfig",
            "MixtralForCausalLM",
            {"num_local_experts": 4, "output_router_logits": True},
        ),
        "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    }[family]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    return getattr(transformers, model_cls)(config)


def _batch(seed=0, batch=2, length=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (batch, length), generator=gen)
    labels = ids.clone()
    labels[:, : length // 3] = -100  # prompt tokens
    return ids, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family", ["llama", "gemma2", "cohere", "granite", "mixtral", "qwen2_tied"]
)
def test_model_loss_and_grads_match(family):
    plain = _model(family)
    fused = install_fused_cross_entropy(copy.deepcopy(plain), backend="torch")
    ids, labels = _batch()
    out_p = plain(input_ids=ids, labels=labels)
    out_f = fused(input_ids=ids, labels=labels)
    assert out_f.logits is None and out_p.logits.shape == (2, 24, TINY["vocab_size"])
    torch.testing.assert_close(out_f.loss, out_p.loss)
    out_p.loss.backward()
    out_f.loss.backward()
    gp, gf = _grads(plain), _grads(fused)
    assert gp.keys() == gf.keys()
    for name in gp:
        torch.testing.assert_close(gf[name], gp[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_curve_identical_over_sgd_steps():
    plain = _model()
    fused = install_fused_cross_entropy(copy.deepcopy(plain), backend="torch", chunk_size=13)
    curves = []
    for model in (plain, fused):
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        losses = []
        for step in range(5):
            ids, labels = _batch(seed=step % 2)
            # packed-style batch of one row with HF's global token normalisation
            ids, labels = ids.view(1, -1), labels.view(1, -1)
            n_items = torch.tensor(int((labels[:, 1:] != -100).sum()))
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]  # it trains
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-5, atol=0)


def test_triton_backend_through_the_model():
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    plain = _model("gemma2")
    fused = install_fused_cross_entropy(copy.deepcopy(plain))  # auto -> Triton (interpreted)
    ids, labels = _batch(length=12)
    torch.testing.assert_close(
        fused(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss
    )


def test_output_paths_idempotence_and_uninstall():
    import inspect

    model = _model()
    signature = inspect.signature(model.forward)
    install_fused_cross_entropy(model)
    install_fused_cross_entropy(model, backend="torch")  # second call: options only
    assert is_fused_cross_entropy_installed(model)
    assert inspect.signature(model.forward) == signature  # Trainer / generate inspect it
    ids, labels = _batch()
    assert model(input_ids=ids).logits.shape == (2, 24, TINY["vocab_size"])  # no labels: logits
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert tup[1].shape == (2, 24, 0)  # the placeholder in tuple outputs
    model.eval()
    out = model(input_ids=ids, labels=labels)  # eval: the original forward
    assert out.logits is not None
    forced = model(input_ids=ids, labels=labels, fused_loss=True)
    assert forced.logits is None
    torch.testing.assert_close(forced.loss, out.loss)
    model.train()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=3)
    uninstall_fused_cross_entropy(model)
    assert "forward" not in model.__dict__ and not is_fused_cross_entropy_installed(model)
    assert model(input_ids=ids, labels=labels).logits is not None


def test_unsupported_forward_raises_at_install():
    class OddLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden)
            logits = logits + 1.0
            loss = self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    model = OddLlama(transformers.LlamaConfig(**TINY))
    with pytest.raises(NotImplementedError, match=r"logits = logits \+ 1.0"):
        install_fused_cross_entropy(model)
    assert not is_fused_cross_entropy_installed(model)


def test_loss_other_than_causal_lm_refused_at_install():
    """The fused path reproduces HF's ForCausalLMLoss only: a custom loss_function is kept."""
    model = _model()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    with pytest.raises(NotImplementedError, match="not transformers' ForCausalLMLoss"):
        install_fused_cross_entropy(model)
    assert not is_fused_cross_entropy_installed(model)


def test_peft_lora_on_lm_head():
    peft = pytest.importorskip("peft")
    ids, labels = _batch()
    results = []
    for install in (False, True):
        base = _model()
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"]
        )
        model = peft.get_peft_model(base, config)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero B so the head's delta matters
                torch.nn.init.normal_(
                    p, std=0.1, generator=torch.Generator().manual_seed(len(name))
                )
        if install:
            install_fused_cross_entropy(model, backend="torch")
        model.train()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), _grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)

    dropout = peft.get_peft_model(
        _model(), peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["lm_head"])
    )
    install_fused_cross_entropy(dropout)
    dropout.train()
    with pytest.raises(NotImplementedError, match="lora_dropout"):
        dropout(input_ids=ids, labels=labels)


def test_peft_modules_to_save_head():
    peft = pytest.importorskip("peft")
    ids, labels = _batch()
    losses = []
    for install in (False, True):
        model = peft.get_peft_model(
            _model(), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
        )
        if install:
            install_fused_cross_entropy(model, backend="torch")
        model.train()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        head = model.base_model.model.lm_head.modules_to_save["default"]
        losses.append((out.loss.detach(), head.weight.grad.clone()))
    torch.testing.assert_close(losses[1][0], losses[0][0])
    torch.testing.assert_close(losses[1][1], losses[0][1], rtol=1e-4, atol=1e-6)


def test_trl_fused_lm_head_calls_pass_through():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = _model()
    trl_utils.add_fused_lm_head(model)
    install_fused_cross_entropy(model, backend="torch")
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert type(out).__name__ == "FusedCausalLMOutput"


@pytest.mark.parametrize(
    "num_items", [None, 0, "tensor0"], ids=["num_items_None", "num_items_0", "num_items_t0"]
)
@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])
def test_model_batch_without_label_tokens(family, num_items):
    """A micro-batch whose labels are all -100 (reduction "mean" when num_items_in_batch is None,
    or a global count of 0): the fused model gives loss 0 and the zero gradients HF's loss gives
    (HF's loss *value* there is NaN: 0 / 0), never NaN in any weight, the tied embedding included."""
    plain = _model(family)
    fused = install_fused_cross_entropy(copy.deepcopy(plain), backend="torch")
    ids, labels = _batch()
    labels = torch.full_like(labels, -100)
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    if num_items == "tensor0":
        kwargs["num_items_in_batch"] = torch.tensor(0)
    loss_p = plain(input_ids=ids, labels=labels, **kwargs).loss
    loss_f = fused(input_ids=ids, labels=labels, **kwargs).loss
    assert loss_f.item() == 0.0
    loss_p.backward()
    loss_f.backward()
    gp, gf = _grads(plain), _grads(fused)
    assert gp.keys() == gf.keys()
    for name in gp:
        assert torch.isfinite(gf[name]).all(), name
        torch.testing.assert_close(gf[name], gp[name], rtol=0, atol=0, msg=name)


_FSDP2_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    return LlamaForCausalLM(config)


def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=gen)
    labels = ids.clone()
    labels[:, :8] = -100
    return ids, labels


def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard
    from hf_varlen.integrations.loss import install_fused_cross_entropy

    model = tiny()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)  # lm_head its own unit: sharded outside its forward
    fully_shard(model)
    install_fused_cross_entropy(model, backend="torch")
    ids, labels = batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": grads}, out)
    # Both ranks reach teardown together: a gloo peer torn down while the other is still
    # talking to it can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    port, out = int(sys.argv[1]), sys.argv[2]
    mp.spawn(worker, args=(port, out), nprocs=2, join=True)
    ref = tiny()
    ids, labels = batch()
    ref(input_ids=ids, labels=labels).loss.backward()
    torch.save({n: p.grad for n, p in ref.named_parameters()}, out + ".ref")
"""


@pytest.mark.slow
def test_fsdp2_two_ranks_sharded_lm_head(tmp_path):
    """FSDP2 over 2 CPU ranks (gloo), lm_head its own FSDP unit: same loss and gradients."""
    import socket
    import subprocess
    import sys

    config = {**TINY, "tie_word_embeddings": False}
    script = tmp_path / "fsdp2_worker.py"
    script.write_text(f"_C = {config!r}\n" + _FSDP2_SCRIPT.replace("CONFIG", "_C"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "result.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(script), str(port), str(out)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = torch.load(out), torch.load(str(out) + ".ref")
    for name, g in ref.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------------------------
# GPU (bf16 numerics, int64 indexing, memory)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", ["plain", "everything", "mean", "none"])
def test_gpu_bf16_numerics(backend, case):
    h, w, b, y = _inputs(n=3001, hidden=256, vocab=32003, bias=case == "everything", seed=5)
    h, w, b, y = (None if t is None else t.cuda() for t in (h, w, b, y))
    _check_against_reference(
        h,
        w,
        b,
        y,
        torch.bfloat16,
        kwargs=CASES[case],
        op_kwargs={"chunk_size": 1024, "backend": backend},
    )


@pytest.mark.gpu
def test_gpu_fp32_weight_accumulator_and_fp16():
    h, w, b, y = _inputs(n=2048, hidden=128, vocab=5000, bias=True, seed=6)
    h, w, b, y = (t.cuda() for t in (h, w, b, y))
    _check_against_reference(h, w, b, y, torch.float16, kwargs={}, op_kwargs={"chunk_size": 256})
    assert ce._addmm_out_dtype_ok(h.device, torch.float16) in (True, False)  # probed, no exception


@pytest.mark.gpu
def test_gpu_row_kernel_long_indexing():
    """A (C, V) chunk past 2^31 elements: the last rows match the torch row step."""
    rows, vocab = 16400, 131101  # 2.15e9 elements
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    cfg = ce._LossConfig(-100, "sum", 30.0, 1.0, 0.0, 0.0, None, "triton")
    tail = logits[-8:].clone()
    loss = torch.empty(rows, device="cuda")
    ce.ce_rows_triton(logits, labels, loss, cfg, compute_grad=True)
    loss_ref = torch.empty(8, device="cuda")
    ce.ce_rows_torch(tail, labels[-8:], loss_ref, cfg, compute_grad=True)
    torch.testing.assert_close(loss[-8:], loss_ref)
    torch.testing.assert_close(logits[-8:].float(), tail.float(), rtol=0.02, atol=1e-6)


@pytest.mark.gpu
def test_gpu_peak_memory_is_chunk_sized():
    n, hidden, vocab, chunk = 8192, 1024, 128256, 2048
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(h, w, y, chunk_size=chunk).backward()
    extra = torch.cuda.max_memory_allocated() - base
    # chunk logits + fp32 dW accumulator + dW + dh (+ 64 MiB of slack for small buffers)
    budget = chunk * vocab * 2 + vocab * hidden * 6 + n * hidden * 2 + (64 << 20)
    assert extra <= budget, f"peak extra {extra / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB"
    assert extra < n * vocab * 2  # less than the bf16 logits alone


@pytest.mark.gpu
def test_gpu_tiny_model_bf16_through_triton():
    plain = _model("gemma2").cuda().bfloat16()
    fused = install_fused_cross_entropy(copy.deepcopy(plain))  # auto: Triton on CUDA
    ref = copy.deepcopy(plain).double()
    ids, labels = (t.cuda() for t in _batch(batch=4, length=64))
    out_hi = ref(input_ids=ids, labels=labels)
    out_lo = plain(input_ids=ids, labels=labels)
    out = fused(input_ids=ids, labels=labels)
    assert out.logits is None
    assert_numerics("loss", out.loss, out_hi.loss, out_lo.loss.double())
    for o in (out_hi, out_lo, out):
        o.loss.backward()
    head = lambda m: m.lm_head.weight.grad  # noqa: E731 - tied to the embeddings in Gemma2
    assert_numerics("d lm_head", head(fused), head(ref), head(plain).double(), factor=3.0)
