"""CPU and real tokenizers (issue 15 item 3): the fused cross-entropy turns on by itself wherever
it saves memory (CUDA, the CPU, a large vocabulary elsewhere), independent of --fused-kernels, and
the summary says which loss ran; a tiny preset stays tiny under a 151K-token tokenizer.
"""

from __future__ import annotations

import pytest
import torch

from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.builtin import PRESETS, TINY_EMBEDDING_PARAMS, tiny_shape
from hf_varlen.training.metrics import format_summary
from hf_varlen.training.model import build_model
from hf_varlen.training.model_kernels import fused_loss_choice

QWEN2_VOCAB = 151_646  # len() of the Qwen2 tokenizer


def tiny(tmp_path, **overrides) -> TrainConfig:
    base = dict(output_dir=str(tmp_path / "run"), builtin_examples=48, max_length=256)
    base.update(tokens_per_batch=512, progress=False, save_final=False, max_steps=1)
    return TrainConfig(**{**base, **overrides})


@pytest.mark.parametrize(
    "device, vocab, fused_kernels, fused_loss, on, why",
    [
        ("cpu", 320, "auto", "auto", True, "auto: on for CPU"),
        ("cpu", 320, "off", "auto", True, "auto: on for CPU"),  # independent of the layers
        ("cuda", 320, "off", "auto", True, "auto: on for CUDA"),
        ("mps", 320, "auto", "auto", False, "auto: 320-token vocabulary on mps"),
        ("mps", QWEN2_VOCAB, "auto", "auto", True, "auto: 151,646-token vocabulary"),
        ("cpu", QWEN2_VOCAB, "auto", "off", False, "--fused-loss off"),
        ("mps", 320, "off", "on", True, "--fused-loss on"),
    ],
)
def test_fused_loss_rule(device, vocab, fused_kernels, fused_loss, on, why):
    cfg = TrainConfig(fused_kernels=fused_kernels, fused_loss=fused_loss)
    assert fused_loss_choice(cfg, torch.device(device), vocab) == (on, why)


def test_cpu_default_runs_the_fused_loss_and_the_summary_says_so(tmp_path):
    summary = PackedTrainer(tiny(tmp_path)).run()
    assert summary["loss_impl"] == "hf_varlen fused linear cross-entropy (auto: on for CPU)"
    assert "loss fn     hf_varlen fused linear cross-entropy (auto" in format_summary(summary)
    off = PackedTrainer(tiny(tmp_path, fused_loss="off", overwrite_output_dir=True))
    assert off.loss_impl == "transformers' cross-entropy (--fused-loss off)"
    assert off.eval_kwargs == {}


def test_same_loss_with_and_without_the_fused_loss(tmp_path):
    runs = [
        PackedTrainer(tiny(tmp_path / f, fused_loss=f, max_steps=2, shuffle=False)).run()
        for f in ("on", "off")
    ]
    assert runs[0]["loss_first"] == pytest.approx(runs[1]["loss_first"], rel=1e-5)
    assert runs[0]["loss_last"] == pytest.approx(runs[1]["loss_last"], rel=1e-4)


def test_tiny_shape_rule():
    shape = PRESETS["tiny-llama"][1]
    assert tiny_shape(shape, 320) is shape  # the byte tokenizer: unchanged
    assert tiny_shape(shape, 32000)["hidden_size"] == 128  # Llama-2's 32K: still fits
    assert tiny_shape(shape, 50304)["hidden_size"] == 64  # GPT-2's
    small = tiny_shape(shape, QWEN2_VOCAB)
    assert small["hidden_size"] == 32 and small["head_dim"] == 32
    assert small["intermediate_size"] == 88 and small["num_attention_heads"] == 4
    assert TINY_EMBEDDING_PARAMS >= 128 * 32000  # why 32K keeps hidden 128


class _BigTokenizer:
    """Just what build_model reads of a tokenizer: its size and special ids."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, None

    def __len__(self) -> int:
        return QWEN2_VOCAB


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_tiny_presets_stay_tiny_with_a_large_tokenizer(preset):
    model = build_model(TrainConfig(model=preset), _BigTokenizer(), "fp32")
    params = sum(p.numel() for p in model.parameters())
    assert model.config.hidden_size == 32 and params < 6e6, params  # was 20.15M at hidden 128
    assert model.config.tie_word_embeddings
    ids = torch.randint(0, QWEN2_VOCAB, (1, 16))
    out = model(input_ids=ids, labels=ids)  # the explicit head_dim runs at hidden 32
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_hidden_size_override_keeps_the_wide_embedding():
    cfg = TrainConfig(config_overrides="hidden_size=128")
    model = build_model(cfg, _BigTokenizer(), "fp32")
    assert model.config.hidden_size == 128


@pytest.mark.parametrize("layers", [2, 6])
def test_layer_count_override_keeps_the_layer_types_and_saves(tmp_path, layers):
    """Presets are built with the override, so per-layer fields derived at init (layer_types) have
    one entry per layer; a patched config would fail transformers' validation on save."""
    cfg = TrainConfig(model="tiny-qwen3", config_overrides=f"num_hidden_layers={layers}")
    model = build_model(cfg, _tokenizer(), "fp32")
    assert model.config.num_hidden_layers == len(model.config.layer_types) == layers
    model.save_pretrained(tmp_path / "saved")  # validates the config


def test_layer_count_override_of_a_checkpoint_cuts_its_layer_types(tmp_path):
    """A loaded model keeps its first N layer types (the layers built); more layers than the
    checkpoint lists types for is refused naming layer_types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    types = ["sliding_attention", "full_attention"] * 2
    config = AutoConfig.for_model(
        "qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        layer_types=types,
        sliding_window=64,
        use_sliding_window=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    cfg = TrainConfig(model=str(tmp_path / "ckpt"), config_overrides="num_hidden_layers=3")
    model = build_model(cfg, _tokenizer(), "fp32")
    assert model.config.layer_types == types[:3]
    model.save_pretrained(tmp_path / "cut")
    cfg = TrainConfig(model=str(tmp_path / "ckpt"), config_overrides="num_hidden_layers=6")
    with pytest.raises(ValueError, match="num_hidden_layers=6 is more than the 4 layer types"):
        build_model(cfg, _tokenizer(), "fp32")
    cfg = TrainConfig(model=str(tmp_path / "ckpt"), config_overrides="num_hiden_layers=3")
    with pytest.raises(ValueError, match="'num_hiden_layers' is not a field of Qwen3Config"):
        build_model(cfg, _tokenizer(), "fp32")


def test_explicit_fused_loss_that_cannot_be_installed_is_an_error(monkeypatch, tmp_path):
    """--fused-loss on is an explicit request: when the fused loss cannot be installed the run
    stops naming why (auto only warns and says so in the summary)."""
    import hf_varlen
    from hf_varlen.training.model_kernels import apply_kernels

    real = hf_varlen.kernelize

    def refusing(model, **kwargs):
        report = real(model, **{**kwargs, "cross_entropy": False})
        report.left_alone["cross_entropy"] = "refused for the test"
        return report

    monkeypatch.setattr(hf_varlen, "kernelize", refusing)
    model = build_model(TrainConfig(model="tiny-llama"), _tokenizer(), "fp32")
    with pytest.raises(ValueError, match="--fused-loss on.*refused for the test"):
        apply_kernels(model, TrainConfig(fused_loss="on"), torch.device("cpu"))
    text, installed, why = apply_kernels(model, TrainConfig(fused_loss="auto"), torch.device("cpu"))
    assert not installed and "could not be installed: refused for the test" in why


def _tokenizer():
    from hf_varlen.training.builtin import byte_tokenizer

    return byte_tokenizer()
