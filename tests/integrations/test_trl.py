"""TRL 1.16 SFTTrainer with attn_implementation="varlen_packed" (examples/trl_sft.py).

One optimizer step over the same alpaca examples (lr 0, so the model is the same in every run) in
each mode: padding-free with TRL's cu_seq_lens kwargs, padding-free with position_ids only (the
TRL <= 1.15 input), bfd packing, and the unpacked padded reference with sdpa. The per-token loss and
the gradient norm must agree, and a spy on the attention function checks that the packed modes
really reached varlen_packed with one document per example.

TRL's own defaults (bf16=True mixed precision over fp32 weights, gradient checkpointing on) run
too, on CPU bf16 autocast: RoPE hands the attention function fp32 q and k with a bf16 v there, and
varlen_packed must cast them to one dtype as transformers' FlashAttention path does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from transformers import AutoTokenizer  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import hf_varlen  # noqa: E402
from hf_varlen.testing import assert_numerics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N_EXAMPLES = 6


def _example_module():
    spec = importlib.util.spec_from_file_location("trl_sft", ROOT / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup(shared_data):
    tok_dir = shared_data("tokenizers", "qwen2")
    alpaca = shared_data("alpaca", "alpaca_5000.json")
    ex = _example_module()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    data = ex.alpaca_dataset(str(alpaca), 64)
    # The shortest responses keep TRL's (tokens x 151k vocab) head cheap on CPU.
    order = sorted(range(len(data)), key=lambda i: len(data[i]["prompt"] + data[i]["completion"]))
    return ex, tokenizer, data.select(order[:N_EXAMPLES])


def _one_step(setup, mode, tmp_path, monkeypatch, max_steps=1, attn=None, probe=None, **config):
    """(first-step loss, first-step grad norm, attention calls seen, losses of every step).

    ``attn`` overrides the example's choice of attention implementation for ``mode``; ``probe``
    (a dict) receives the first step's per-token NLL of every document and its gradients
    (``_probe_step``)."""
    ex, tokenizer, data = setup
    seen: list[dict] = []
    inner = ALL_ATTENTION_FUNCTIONS[hf_varlen.ATTN_IMPLEMENTATION]

    def spy(module, q, k, v, mask, **kwargs):
        out = inner(module, q, k, v, mask, **kwargs)
        seen.append(
            {
                "cu": kwargs.get("cu_seq_lens_q"),
                "pos": kwargs.get("position_ids"),
                "dtypes": (q.dtype, k.dtype, v.dtype),
                "out": out[0].dtype,
            }
        )
        return out

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, hf_varlen.ATTN_IMPLEMENTATION, spy)
    if attn is None:
        model = ex.load_model("tiny-llama", tokenizer, mode, seed=0)
    else:
        model = ex.tiny_llama(len(tokenizer), attn, seed=0)
    trainer = ex.make_trainer(
        model,
        tokenizer,
        data,
        mode,
        str(tmp_path / f"{mode}-{attn}"),
        per_device_train_batch_size=N_EXAMPLES,
        max_steps=max_steps,
        learning_rate=0.0,
        seed=0,
        **config,
    )
    if probe is not None:
        _probe_step(model, trainer, probe)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [float(h["loss"]) for h in logs]
    return losses[0], float(logs[0]["grad_norm"]), seen, losses


def _documents(kwargs):
    """(row, start, end) of every document in a batch: one per padded row (its attention_mask)
    or one per position_ids reset in a packed row."""
    if kwargs.get("attention_mask") is not None and kwargs.get("position_ids") is None:
        spans = []
        for b, row in enumerate(kwargs["attention_mask"]):
            real = row.nonzero().reshape(-1)  # the row's real (unpadded) tokens
            spans.append((b, int(real[0]), int(real[-1]) + 1))
        return spans
    spans = []
    for b, pos in enumerate(kwargs["position_ids"]):
        starts = (pos == 0).nonzero().reshape(-1).tolist()
        spans += [(b, s, e) for s, e in zip(starts, [*starts[1:], pos.numel()])]
    return spans


def _probe_step(model, trainer, probe):
    """Record the first training step's per-token NLL (the log-probabilities TRL's fused LM head
    returned from the trainer's own forward) keyed by each document's token ids, and its gradients
    before the optimizer step, so runs that batch the same examples differently (padded rows, one
    packed row, bfd bins) compare token by token and element by element."""
    from transformers import TrainerCallback

    def grab(module, args, kwargs, output):
        if "nll" in probe or getattr(output, "log_probs", None) is None:
            return
        log_probs = output.log_probs.detach().double()  # (B, L - 1): of labels[:, 1:]
        nll = {}
        for b, s, e in _documents(kwargs):
            keep = kwargs["labels"][b, s + 1 : e] != -100
            nll[tuple(kwargs["input_ids"][b, s:e].tolist())] = -log_probs[b, s : e - 1][keep]
        probe["nll"] = nll

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if "grads" not in probe:
                probe["grads"] = {
                    n: p.grad.detach().double().clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }

    model.register_forward_hook(grab, with_kwargs=True)
    trainer.add_callback(Grads())
    probe["max_grad_norm"] = trainer.args.max_grad_norm


def _unclipped(probe, norm):
    """The probe's gradients before clip_grad_norm_ scaled them (coefficient max_norm / norm)."""
    coef = min(1.0, probe["max_grad_norm"] / (norm + 1e-6)) if probe["max_grad_norm"] else 1.0
    return {n: g / coef for n, g in probe["grads"].items()}


def _token_nll(probe, keys):
    return torch.cat([probe["nll"][k] for k in keys])


@pytest.mark.slow
def test_trl_packed_modes_match_unpacked(setup, tmp_path, monkeypatch):
    # fp32 throughout (make_trainer keeps SFTConfig's bf16=True default otherwise)
    ref_loss, ref_norm, ref_seen, _ = _one_step(setup, "padded", tmp_path, monkeypatch, bf16=False)
    assert not ref_seen  # the reference runs sdpa, not varlen_packed
    for mode in ("padding_free", "position_ids", "bfd"):
        loss, norm, seen, _ = _one_step(setup, mode, tmp_path, monkeypatch, bf16=False)
        assert seen, f"{mode}: varlen_packed was never called"
        call = seen[0]
        if mode == "position_ids":
            assert call["cu"] is None and call["pos"] is not None
            starts = int((call["pos"][0] == 0).sum())
            assert starts == N_EXAMPLES, f"{mode}: {starts} documents in the packed row"
        else:
            assert call["cu"] is not None and call["cu"].dtype == torch.int32
            assert call["cu"].numel() - 1 == N_EXAMPLES, f"{mode}: cu_seq_lens {call['cu']}"
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{mode}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"{mode}: grad norm {norm} vs {ref_norm}"


@pytest.mark.slow
def test_trl_defaults_bf16_gradient_checkpointing(setup, tmp_path, monkeypatch):
    """TRL's default mixed precision (bf16=True over fp32 weights, gradient checkpointing on) in the
    padding-free and bfd modes, on CPU bf16 autocast (CUDA autocast on a GPU): the attention
    function gets fp32 q/k with a bf16 v, runs in bf16, and the loss and gradient norm follow the
    numerics rule against the fp32 padded run (ref_hi) and the bf16 padded sdpa run (ref_lo)."""
    defaults = dict(bf16=True, gradient_checkpointing=True)  # SFTConfig's own defaults
    hi, lo = {}, {}
    hi_loss, hi_norm, _, _ = _one_step(setup, "padded", tmp_path, monkeypatch, bf16=False, probe=hi)
    lo_loss, lo_norm, _, _ = _one_step(setup, "padded", tmp_path, monkeypatch, probe=lo, **defaults)
    assert lo_loss != hi_loss  # bf16 autocast really ran
    hi_grads, lo_grads = _unclipped(hi, hi_norm), _unclipped(lo, lo_norm)
    keys = sorted(hi["nll"])
    assert len(keys) == N_EXAMPLES and all(hi["nll"][k].numel() for k in keys)
    for mode in ("padding_free", "bfd"):
        x = {}
        loss, norm, seen, losses = _one_step(
            setup, mode, tmp_path, monkeypatch, max_steps=2, probe=x, **defaults
        )
        assert seen, f"{mode}: varlen_packed was never called"
        mixed = {c["dtypes"] for c in seen}
        assert (torch.float32, torch.float32, torch.bfloat16) in mixed, f"{mode}: {mixed}"
        assert {c["out"] for c in seen} == {torch.bfloat16}, f"{mode}: output dtypes"
        assert all(torch.isfinite(torch.tensor(losses))), f"{mode}: losses {losses}"
        # The step's loss is one scalar, a single sample of each run's error (where the rule's max
        # runs over many elements): the rule runs over its per-token NLL and its gradients instead.
        assert sorted(x["nll"]) == keys, f"{mode}: other documents than the padded batch's"
        assert_numerics(
            f"{mode} bf16 per-token loss",
            _token_nll(x, keys),
            _token_nll(hi, keys),
            _token_nll(lo, keys),
        )
        x_grads = _unclipped(x, norm)
        assert set(x_grads) == set(hi_grads)
        for name, g in x_grads.items():
            assert_numerics(f"{mode} bf16 grad {name}", g, hi_grads[name], lo_grads[name], factor=3)


@pytest.mark.slow
def test_trl_wrapped_packing_bf16_matches_sdpa(setup, tmp_path, monkeypatch):
    """packing_strategy="wrapped" (fixed-length rows cut across examples, no padding-free kwargs:
    each row is one sequence) under TRL's bf16 defaults: varlen_packed == sdpa on the same rows."""
    cfg = dict(packing_strategy="wrapped", max_length=48, gradient_checkpointing=True)
    hi = _one_step(setup, "bfd", tmp_path, monkeypatch, attn="sdpa", bf16=False, **cfg)
    lo = _one_step(setup, "bfd", tmp_path, monkeypatch, attn="sdpa", bf16=True, **cfg)
    x = _one_step(
        setup, "bfd", tmp_path, monkeypatch, attn=hf_varlen.ATTN_IMPLEMENTATION, bf16=True, **cfg
    )
    seen = x[2]
    assert seen and all(c["cu"] is None for c in seen), "wrapped rows carry no packed kwargs"
    t = torch.tensor
    assert_numerics("wrapped bf16 loss", t(x[0]), t(hi[0], dtype=torch.float64), t(lo[0]))
    assert_numerics(
        "wrapped bf16 grad norm", t(x[1]), t(hi[1], dtype=torch.float64), t(lo[1]), factor=3
    )
