"""hf_varlen.integrations.trainers.VarlenSFTTrainer: TRL's SFTTrainer with hf_varlen's fused linear
cross-entropy as the loss, against plain SFTTrainer (TRL's own fused LM head).

The same alpaca prompt-completion examples (completion_only_loss: prompt labels -100), a tiny
Llama with attn "varlen_packed", padding_free and bfd packing, three optimizer steps: the
per-step losses and the first step's gradients of every parameter follow the numerics rule
(hf_varlen.testing) with SFTTrainer as the reference: under TRL's default bf16 mixed precision
(CPU bf16 autocast over fp32 weights) ref_hi is SFTTrainer in fp32 and ref_lo SFTTrainer in bf16,
and the rule's eps and floor are bf16's (the computation's precision; hf_varlen.testing);
in fp32 ref_hi is the same SFTTrainer run on an fp64 copy of the model and the loss
computed here in fp64 from the full logits (TRL's head and HF's ForCausalLMLoss both compute in
fp32 whatever the model's dtype; hf_varlen's fused op takes no fp64) and ref_lo SFTTrainer in fp32.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch.nn.functional as F  # noqa: E402
from transformers import AutoTokenizer, Trainer, TrainerCallback  # noqa: E402

from hf_varlen.testing import assert_numerics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N_EXAMPLES = 6
STEPS = 3


def _example_module():
    spec = importlib.util.spec_from_file_location("trl_sft", ROOT / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup():
    from conftest import shared_data_path

    tokenizer = AutoTokenizer.from_pretrained(shared_data_path("tokenizers", "qwen2"))
    ex = _example_module()
    data = ex.alpaca_dataset(str(shared_data_path("alpaca", "alpaca_5000.json")), 64)
    # The shortest examples keep the (tokens x 151k vocab) head cheap on CPU.
    order = sorted(range(len(data)), key=lambda i: len(data[i]["prompt"] + data[i]["completion"]))
    return ex, tokenizer, data.select(order[:N_EXAMPLES])


class _Grads(TrainerCallback):
    """The gradient of every parameter before the first optimizer step (clipping off)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {
                n: p.grad.detach().double().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }


def _fp64_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The fp64 reference loss: sum of the shifted tokens' NLL over label tokens divided by
    num_items_in_batch (their count when None), as TRL normalises it; logits never downcast."""
    assert not return_outputs
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits
    assert logits.dtype == torch.float64
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    nll = F.cross_entropy(logits.reshape(shifted.numel(), -1), shifted, reduction="sum")
    n = (shifted != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return nll / torch.as_tensor(n).clamp(min=1)


def _train(
    setup, tmp_path, mode, *, fused, dtype=torch.float32, batch=3, steps=STEPS, hf_loss=False, **cfg
):
    """(per-step losses, first-step gradients by name, trainer).

    The losses are compute_loss's own tensors summed over each step's micro-batches (the logged
    loss goes through Trainer's fp32 accumulator, which would round an fp64 reference)."""
    ex, tokenizer, data = setup
    model = ex.load_model("tiny-llama", tokenizer, mode, seed=0).to(dtype)
    config = dict(
        per_device_train_batch_size=batch,
        max_steps=steps,
        # SGD: Adam's first update is lr * sign(grad), which turns rounding-level gradient
        # differences (an unused token's embedding row) into full-size steps.
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
        completion_only_loss=True,
        seed=0,
        data_seed=0,
    )
    config.update(cfg)
    extra = {}
    if fused:
        # The Triton interpreter (TRITON_INTERPRET=1 in these tests) cannot run bf16 dots.
        extra["fused_cross_entropy_kwargs"] = {"backend": "torch"}
    out = tmp_path / f"{mode}-{fused}-{dtype}-{cfg.get('bf16')}-{batch}"
    trainer = ex.make_trainer(
        model, tokenizer, data, mode, str(out), fused_loss=fused, **config, **extra
    )
    if fused:  # the eager step these tests spy on (auto, the default, captures on CUDA)
        trainer.configure_captured_step("off")
    spy = _Grads()
    trainer.add_callback(spy)
    micro: list[torch.Tensor] = []
    dtypes: set[torch.dtype] = set()
    compute_loss = trainer.compute_loss
    if dtype == torch.float64:
        assert not fused
        compute_loss = types.MethodType(_fp64_loss, trainer)
    elif hf_loss:
        assert not fused
        compute_loss = types.MethodType(Trainer.compute_loss, trainer)

    def recording(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        dtypes.add(loss.dtype)
        micro.append(loss.detach().double())
        return loss

    trainer.compute_loss = recording  # this test's instance only
    trainer.train()
    assert dtypes == {torch.float64 if dtype == torch.float64 else torch.float32}, dtypes
    accum = config.get("gradient_accumulation_steps", 1)
    losses = [float(sum(micro[i : i + accum])) for i in range(0, len(micro), accum)]
    return losses, spy.grads, trainer


def _check(name, x, hi, lo, dtype=None):
    """``dtype``: the autocast precision (bf16), in which the rule's eps and floor are taken: the
    losses and gradients come back in fp32, but were computed from bf16 matmuls."""
    t = torch.tensor
    losses, grads, _ = x
    assert len(losses) == STEPS and all(torch.isfinite(t(losses))), f"{name}: losses {losses}"
    for i, (a, b, c) in enumerate(zip(losses, hi[0], lo[0], strict=True)):
        assert_numerics(f"{name} step {i} loss", t(a), t(b, dtype=torch.float64), t(c), dtype=dtype)
    assert grads.keys() == hi[1].keys()
    for key, g in grads.items():
        assert_numerics(f"{name} grad {key}", g, hi[1][key], lo[1][key], factor=3, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["padding_free", "bfd"])
def test_fused_loss_matches_sft_trainer_bf16(setup, tmp_path, mode):
    """TRL's default mixed precision (bf16=True over fp32 weights): CPU bf16 autocast.

    ref_lo is SFTTrainer with the model's own head under autocast (nn.Linear in bf16, then
    ForCausalLMLoss): the computation the fused op reproduces. TRL's fused head is more accurate
    than that under autocast (it accumulates and returns the head's gradients in fp32; ours, like
    nn.Linear, returns them in bf16), so its bf16 run is only checked for the first step here."""
    hi = _train(setup, tmp_path, mode, fused=False, bf16=False)
    lo = _train(setup, tmp_path, mode, fused=False, hf_loss=True, bf16=True)
    trl_lo = _train(setup, tmp_path, mode, fused=False, bf16=True)
    assert lo[0] != hi[0]  # bf16 autocast really ran
    x = _train(setup, tmp_path, mode, fused=True, bf16=True)
    _check(f"{mode} bf16", x, hi, lo, dtype=torch.bfloat16)
    t = torch.tensor
    assert_numerics(
        f"{mode} bf16 first loss vs TRL's head",
        t(x[0][0]),
        t(hi[0][0], dtype=torch.float64),
        t(trl_lo[0][0]),
        dtype=torch.bfloat16,
    )
    # The fused path ran (TRL's head would log entropy / mean_token_accuracy), and num_tokens is
    # TRL's count.
    logs = [h for h in x[2].state.log_history if "loss" in h]
    ref_logs = [h for h in trl_lo[2].state.log_history if "loss" in h]
    assert all("entropy" not in h and "mean_token_accuracy" not in h for h in logs)
    assert all("entropy" in h for h in ref_logs)
    assert [h["num_tokens"] for h in logs] == [h["num_tokens"] for h in ref_logs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["padding_free", "bfd"])
def test_fused_loss_matches_sft_trainer_fp32(setup, tmp_path, mode):
    hi = _train(setup, tmp_path, mode, fused=False, dtype=torch.float64, bf16=False)
    lo = _train(setup, tmp_path, mode, fused=False, bf16=False)
    x = _train(setup, tmp_path, mode, fused=True, bf16=False)
    _check(f"{mode} fp32", x, hi, lo)
    from hf_varlen import OffsetsCheckCallback

    callbacks = x[2].callback_handler.callbacks  # pending offset checks read before each update
    assert sum(isinstance(cb, OffsetsCheckCallback) for cb in callbacks) == 1


@pytest.mark.slow
def test_gradient_accumulation_two_equals_one_double_batch(setup, tmp_path):
    """padding_free, fp32: 2 micro-batches of 3 examples == 1 batch of 6 (loss normalised by the
    label tokens of the whole accumulated batch, as TRL does)."""
    one = dict(steps=1, bf16=False)
    hi = _train(setup, tmp_path, "padding_free", fused=False, dtype=torch.float64, batch=6, **one)
    lo = _train(setup, tmp_path, "padding_free", fused=False, batch=6, **one)
    t = torch.tensor
    for name, batch, accum in (("batch 6", 6, 1), ("2 x batch 3", 3, 2)):
        losses, grads, _ = _train(
            setup,
            tmp_path,
            "padding_free",
            fused=True,
            batch=batch,
            gradient_accumulation_steps=accum,
            **one,
        )
        assert_numerics(f"{name} loss", t(losses[0]), t(hi[0][0], dtype=torch.float64), t(lo[0][0]))
        for key, g in grads.items():
            assert_numerics(f"{name} grad {key}", g, hi[1][key], lo[1][key], factor=3)


def test_unfusable_loss_is_refused_at_construction(setup, tmp_path):
    ex, tokenizer, data = setup
    model = ex.load_model("tiny-llama", tokenizer, "padding_free", seed=0)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    with pytest.raises(NotImplementedError, match="not transformers' ForCausalLMLoss"):
        ex.make_trainer(model, tokenizer, data, "padding_free", str(tmp_path), fused_loss=True)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # TRL deprecates label_smoothing_factor
@pytest.mark.parametrize(
    "config, match",
    [
        (dict(loss_type="dft"), "loss_type='dft'"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
    ],
)
def test_unsupported_trl_options_are_refused(setup, tmp_path, config, match):
    ex, tokenizer, data = setup
    model = ex.load_model("tiny-llama", tokenizer, "padding_free", seed=0)
    with pytest.raises(NotImplementedError, match=match):
        ex.make_trainer(
            model, tokenizer, data, "padding_free", str(tmp_path), fused_loss=True, **config
        )


def test_import_hf_varlen_does_not_import_trl():
    import subprocess

    code = "import sys, hf_varlen; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
