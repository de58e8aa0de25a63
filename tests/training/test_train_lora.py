"""``hf-varlen train`` with LoRA options (CPU): ``--fused-lora`` (the one-op LoRA projection) and
``--load-in-4bit`` (QLoRA).

- ``--lora --fused-lora`` trains like ``--lora``: per-step losses under the numerics rule
  (ref_lo: the peft run in fp32, ref_hi: the peft run in fp64), and the kernels line says the
  LoRA layers run the op.
- Refusals before anything trains, one line naming the flag and the fix: --fused-lora or
  --load-in-4bit without --lora; --fused-lora with dropout or with --load-in-4bit; --load-in-4bit
  with a precision other than bf16, without bitsandbytes (names the ``qlora`` extra), without
  CUDA (this machine), with several processes.
- The 4-bit load itself: the ``BitsAndBytesConfig`` handed to ``from_pretrained`` (NF4, double
  quantisation, bf16 compute, on the run's GPU), for a pretrained folder and for a preset (saved
  once, reloaded quantised), and peft's ``prepare_model_for_kbit_training`` before the adapters.
  These run with ``from_pretrained`` stubbed: bitsandbytes' 4-bit matmul needs the GPU, where
  ``tests/training/test_qlora.py`` trains for real (``pytest -m gpu``). Skipped here: the quantised
  matmul and everything after it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_runs import tiny_train_config

from hf_varlen.testing import assert_numerics
from hf_varlen.training import PackedTrainer

peft = pytest.importorskip("peft")


def _losses(cfg, hook=None):
    from hf_varlen.training.metrics import read_log

    summary = PackedTrainer(cfg, model_hook=hook).run()
    records = [r for r in read_log(cfg.output_dir) if "loss" in r]
    return torch.tensor([r["loss"] for r in records], dtype=torch.float64), summary


def _double(model):
    model.double()


def test_fused_lora_trains_like_peft(tmp_path):
    kw = dict(lora=True, lora_r=4, max_steps=3, lr=1e-2)
    lo, _ = _losses(tiny_train_config(tmp_path, "lo", **kw))
    hi, _ = _losses(tiny_train_config(tmp_path, "hi", fused_loss="off", **kw), hook=_double)
    x, summary = _losses(tiny_train_config(tmp_path, "x", fused_lora=True, **kw))
    assert "lora x" in summary["kernels"], summary["kernels"]
    assert len(set(lo.tolist())) == 3  # the adapters train: the loss moves
    assert_numerics("--fused-lora losses", x.float(), hi, lo)


@pytest.mark.parametrize(
    "overrides,error,pattern",
    [
        (dict(fused_lora=True), ValueError, "--fused-lora applies to LoRA training: add --lora"),
        (dict(load_in_4bit=True), ValueError, "--load-in-4bit applies to LoRA training"),
        (
            dict(lora=True, fused_lora=True, lora_dropout=0.1),
            ValueError,
            "--fused-lora: the one-op LoRA projection has no dropout.*--lora-dropout 0",
        ),
        (
            dict(lora=True, fused_lora=True, load_in_4bit=True),
            ValueError,
            "--fused-lora needs a full-precision base layer.*--load-in-4bit",
        ),
        (
            dict(lora=True, load_in_4bit=True, precision="fp32"),
            ValueError,
            "--load-in-4bit computes in bf16.*--precision bf16",
        ),
        (
            dict(lora=True, load_in_4bit=True, _hide="bitsandbytes"),
            ImportError,
            r"--load-in-4bit needs the `bitsandbytes` package.*hf_varlen\[qlora\]",
        ),
    ],
)
def test_lora_flag_refusals(tmp_path, monkeypatch, overrides, error, pattern):
    overrides = dict(overrides)
    hidden = overrides.pop("_hide", None)
    if hidden:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a)
        )
    with pytest.raises(error, match=pattern):
        PackedTrainer(tiny_train_config(tmp_path, "r", **overrides))


def test_load_in_4bit_refused_without_cuda_or_with_several_processes(tmp_path, monkeypatch):
    from hf_varlen.training.model import check_load_in_4bit

    real = importlib.util.find_spec  # the device check comes after the package check
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "bitsandbytes" else real(name, *a),
    )
    cfg = tiny_train_config(tmp_path, "q", lora=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="--load-in-4bit needs a CUDA GPU.*device is 'cpu'"):
        PackedTrainer(cfg)
    with pytest.raises(ValueError, match="--load-in-4bit trains on one GPU.*FSDP2.*2 processes"):
        check_load_in_4bit(cfg, torch.device("cuda", 0), processes=2)
    check_load_in_4bit(cfg, torch.device("cuda", 0), processes=1)  # one GPU: fine


@pytest.fixture
def recorded_from_pretrained(monkeypatch):
    """``from_pretrained`` keeps its calls' keywords and loads without quantising (bitsandbytes'
    4-bit weights need the GPU)."""
    from transformers import AutoModelForCausalLM

    calls: list[tuple[str, dict]] = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, source, **kwargs):
        calls.append((str(source), dict(kwargs)))
        kwargs.pop("quantization_config")
        kwargs.pop("device_map")
        return real(cls, source, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    return calls


def _check_4bit_call(kwargs: dict) -> None:
    from transformers import BitsAndBytesConfig

    q = kwargs["quantization_config"]
    assert isinstance(q, BitsAndBytesConfig) and q.load_in_4bit and not q.load_in_8bit
    assert q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    assert kwargs["device_map"] == {"": "cpu"}  # the run's device ("cuda" -> its index)
    assert kwargs["attn_implementation"] == "varlen_packed"


@pytest.mark.parametrize("source", ["preset", "folder"])
def test_load_in_4bit_passes_bitsandbytes_config(tmp_path, recorded_from_pretrained, source):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_varlen.training.model import build_model, load_tokenizer

    overrides = dict(lora=True, load_in_4bit=True)
    if source == "folder":
        config = LlamaConfig(
            vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
        overrides.update(model=str(tmp_path / "llama"), tokenizer="bytes")
    cfg = tiny_train_config(tmp_path, "q", **overrides)
    model = build_model(cfg, load_tokenizer(cfg), "bf16", torch.device("cpu"))
    assert len(recorded_from_pretrained) == 1
    folder, kwargs = recorded_from_pretrained[0]
    _check_4bit_call(kwargs)
    if source == "preset":  # saved once to a temporary folder, reloaded quantised, removed
        assert "hf_varlen_4bit_" in folder and kwargs["dtype"] == torch.bfloat16
        import os

        assert not os.path.exists(folder)
    assert model.config._attn_implementation == "varlen_packed" and not model.config.use_cache


def test_parameter_count_counts_a_4bit_weight_whole():
    """A bitsandbytes ``Params4bit`` holds two values per byte of its storage: the run summary's
    parameter count is the model's, not the storage's (stand-in class of that name on CPU)."""
    from hf_varlen.training.model import parameter_count

    class Params4bit(torch.nn.Parameter):  # bitsandbytes' class name; packed uint8 storage
        pass

    model = torch.nn.Linear(8, 4, bias=True)  # 32 weights + 4 biases
    packed = Params4bit(torch.zeros(16, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_storage = torch.uint8
    model.weight = packed
    assert parameter_count(model) == 32 + 4
    assert parameter_count(model, trainable_only=True) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_fused_lora_gpu_eager_and_compiled(tmp_path, precision):
    """GPU: ``--lora --fused-lora`` eager and with ``--compile`` (Inductor; under bf16-mixed the
    op runs inside autocast) trains like peft's ``--lora``: per-step losses by the rule (ref_lo:
    peft in the same precision, ref_hi: peft in fp32); one compilation, no graph break."""
    from test_compile_trainers import _fresh, _recompile_reasons
    from torch._dynamo.utils import counters

    kw = dict(lora=True, lora_r=8, max_steps=4, lr=1e-2)
    lo, _ = _losses(tiny_train_config(tmp_path, "lo", precision=precision, **kw))
    hi, _ = _losses(tiny_train_config(tmp_path, "hi", precision="fp32", **kw))
    fused = dict(precision=precision, fused_lora=True, **kw)
    x, summary = _losses(tiny_train_config(tmp_path, "x", **fused))
    assert "lora x" in summary["kernels"], summary["kernels"]
    assert_numerics(f"--fused-lora {precision} losses", x.float(), hi, lo.float())
    _fresh()
    y, summary = _losses(tiny_train_config(tmp_path, "y", compile=True, **fused))
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert summary["compile"]["compilations"] == 1, (summary["compile"], _recompile_reasons())
    assert_numerics(f"--fused-lora --compile {precision} losses", y.float(), hi, lo.float())


def test_a_second_run_in_one_process_may_change_precision(tmp_path):
    """accelerate keeps one process-wide state and refuses an Accelerator of another mixed
    precision: a run after a bf16-mixed one in the same process (a notebook, a sweep) trains."""
    from accelerate import Accelerator

    Accelerator(mixed_precision="bf16", cpu=True)
    losses, _ = _losses(tiny_train_config(tmp_path, "fp32", precision="fp32", max_steps=1))
    assert losses.numel() == 1 and torch.isfinite(losses).all()
