"""hf_varlen.kernelize on tiny random Llama / Qwen3 / Gemma2 models.

Tests run on CUDA when present, else on CPU under the Triton interpreter (TRITON_INTERPRET=1, set
by conftest). The model-equality test also has a GPU-marked CUDA variant for the GPU machine.

A kernelized model must give the logits, loss and every parameter gradient of the un-kernelized one
within the numerics rule (hf_varlen/testing.py): ref_hi = the un-kernelized model in fp64, ref_lo = the
un-kernelized model in the test dtype. Inputs are one packed row of three documents whose positions
restart, so RoPE sees position resets.

The ``rotary_pos_emb`` entry is one module per modeling file shared by every model of that
architecture in the process, so references are computed before kernelizing and an autouse fixture
gives those entries their original forward after every test.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from tiny_packed import KERNEL_SHAPE
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3 import modeling_qwen3
from transformers.utils import import_utils

from hf_varlen import kernelize
from hf_varlen.testing import assert_numerics

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
}
LENGTHS = (6, 7, 5)  # three packed documents, T = 18
NONE = dict(rope=False, glu=False, rmsnorm=False, cross_entropy=False)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1",
            reason="Triton runs on CPU only under TRITON_INTERPRET=1 (set where CUDA is absent)",
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]

needs_kernels = pytest.mark.skipif(
    not import_utils.is_kernels_available(),
    reason="kernels is missing or not accepted by this transformers: kernels wiring not tested",
)


def tiny(family: str, seed: int = 0, device: str = DEVICE, **overrides) -> nn.Module:
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**KERNEL_SHAPE, use_cache=False, attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random norm weights: Llama inits ones, Gemma zeros; exercise the weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device)


def packed_batch(vocab: int = 128, device: str = DEVICE) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    labels[0, torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)] = -100  # first label of every document
    batch = {"input_ids": ids, "position_ids": position_ids, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


def run(model: nn.Module, batch: dict):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same_training_step(x, hi, lo) -> None:
    assert_numerics("logits", x[0], hi[0], lo[0])
    assert_numerics("loss", x[1], hi[1], lo[1])
    assert x[2].keys() == hi[2].keys()
    for name in hi[2]:
        assert_numerics(f"grad {name}", x[2][name], hi[2][name], lo[2][name], factor=3.0)


def references(base: nn.Module, dtype: torch.dtype, batch: dict):
    return run(copy.deepcopy(base).double(), batch), run(copy.deepcopy(base).to(dtype), batch)


def is_ours(module: nn.Module) -> bool:
    fn = module.__dict__.get("forward")
    return getattr(getattr(fn, "__func__", None), "__module__", "").endswith(".hub.layers")


@pytest.fixture(autouse=True, scope="module")
def hub_cache(tmp_path_factory):
    """Generate the hub package into a temporary cache, not ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_VARLEN_CACHE", str(tmp_path_factory.mktemp("hf_varlen_cache")))
        yield


@pytest.fixture(autouse=True)
def original_rope_afterwards():
    """Give the shared ``apply_rotary_pos_emb`` entries their original forward after each test."""
    yield
    for modeling in (modeling_llama, modeling_qwen3, modeling_gemma2):
        vars(modeling.apply_rotary_pos_emb).pop("forward", None)


EXPECTED = {  # family -> (counts, HF class -> hf_varlen layer)
    "llama": (
        {"rmsnorm": 5, "rope": 2, "glu": 2},
        {"LlamaRMSNorm": "RMSNorm", "LlamaMLP": "SwiGLUMLP", "rotary_pos_emb": "RotaryPosEmb"},
    ),
    "qwen3": (  # + q_norm / k_norm per layer
        {"rmsnorm": 9, "rope": 2, "glu": 2},
        {"Qwen3RMSNorm": "RMSNorm", "Qwen3MLP": "SwiGLUMLP", "rotary_pos_emb": "RotaryPosEmb"},
    ),
    "gemma2": (  # four (1 + w) norms per layer + the final one; gelu_pytorch_tanh MLP
        {"rmsnorm": 9, "rope": 2, "glu": 2},
        {
            "Gemma2RMSNorm": "GemmaRMSNorm",
            "Gemma2MLP": "GeGLUMLP",
            "rotary_pos_emb": "RotaryPosEmb",
        },
    ),
}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("device", DEVICES)
def test_kernelized_model_matches_original(family, dtype, device):
    base, batch = tiny(family, device=device), packed_batch(device=device)
    hi, lo = references(base, dtype, batch)
    model = copy.deepcopy(base).to(dtype)
    report = kernelize(model, cross_entropy=False)

    counts, layers = EXPECTED[family]
    assert report.path == "kernels", report.path_reason
    assert {k: report.counts[k] for k in counts} == counts, report.left_alone
    assert report.layers == layers
    assert report.left_alone == {}
    assert_same_training_step(run(model, batch), hi, lo)


def test_fallback_wiring_matches_original(monkeypatch):
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *a, **k: False)
    base, batch = tiny("gemma2"), packed_batch()
    hi, lo = references(base, torch.bfloat16, batch)
    model = copy.deepcopy(base).to(torch.bfloat16)
    report = kernelize(model, cross_entropy=False)

    assert report.path == "fallback"
    assert "outside the range" in report.path_reason
    assert {k: report.counts[k] for k in ("rmsnorm", "rope", "glu")} == EXPECTED["gemma2"][0]
    assert report.layers == EXPECTED["gemma2"][1]
    assert_same_training_step(run(model, batch), hi, lo)


def test_fallback_without_rotary_entry_leaves_rope_alone(monkeypatch):
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *a, **k: False)
    model = tiny("llama")
    for module in model.modules():  # what transformers builds when its hub decorators are stubs
        module.__dict__.pop("_kernel_funcs", None)
    report = kernelize(model, cross_entropy=False)
    assert report.counts["rope"] == 0 and report.counts["rmsnorm"] == 5
    assert "rope" in report.left_alone and "does not swap" in report.left_alone["rope"]


@needs_kernels
def test_idempotent_partial_and_undo():
    model, batch = tiny("llama"), packed_batch()
    with torch.no_grad():
        ref = model(**batch).logits
    rng = torch.get_rng_state()

    first = kernelize(model, cross_entropy=False)
    assert torch.equal(rng, torch.get_rng_state())  # probes use their own generator
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules() if is_ours(m)}
    assert len(forwards) == 7, forwards  # 5 norms + 2 MLPs: is_ours sees what kernelize installed
    with torch.no_grad():
        out1 = model(**batch).logits
    second = kernelize(model, cross_entropy=False)
    with torch.no_grad():
        out2 = model(**batch).logits
    assert second.replaced == first.replaced and second.layers == first.layers
    assert {
        n: m.__dict__.get("forward").__func__ for n, m in model.named_modules() if is_ours(m)
    } == {n: f.__func__ for n, f in forwards.items()}
    assert torch.equal(out1, out2)

    partial = kernelize(model, glu=False, cross_entropy=False)
    assert partial.counts["glu"] == 0 and partial.counts["rmsnorm"] == 5
    assert not any(is_ours(m) for n, m in model.named_modules() if n.endswith("mlp"))

    undone = kernelize(model, **NONE)
    assert sum(undone.counts.values()) == 0
    assert not any(is_ours(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref)


def _class_marks(model: nn.Module) -> dict:
    """What kernels' marks (kernel_layer_name / kernel_condition) are on each class of the model."""
    marks = ("kernel_layer_name", "kernel_condition")
    return {
        cls: {a: cls.__dict__.get(a) for a in marks} for cls in {type(m) for m in model.modules()}
    }


@needs_kernels
def test_only_this_model_changes():
    """kernelize changes instance attributes of the approved modules of this model only: a second
    model of the same classes keeps its forwards, no HF class keeps a mark, and modules kernels
    has no mapping for (the decorated SiLU activations) are not touched either."""
    model, other, batch = tiny("llama"), tiny("llama", seed=1), packed_batch()
    marks = _class_marks(other)
    with torch.no_grad():
        other_ref = other(**batch).logits
    report = kernelize(model, rope=False, cross_entropy=False)
    assert report.counts["rmsnorm"] == 5 and report.counts["glu"] == 2
    assert _class_marks(other) == marks
    assert not any("forward" in m.__dict__ for m in other.modules())
    targets = {n for kind in ("rmsnorm", "glu") for n in report.replaced[kind]}
    touched = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    assert touched == targets  # e.g. model.layers.0.mlp.act_fn keeps its class forward
    with torch.no_grad():
        assert torch.equal(other(**batch).logits, other_ref)


@needs_kernels
@pytest.mark.parametrize("wiring", ["kernels", "fallback"])
def test_report_undo_restores_everything(wiring, monkeypatch):
    from hf_varlen import is_fused_cross_entropy_installed

    if wiring == "fallback":
        monkeypatch.setattr(import_utils, "is_kernels_available", lambda *a, **k: False)
    model, batch = tiny("llama"), packed_batch()
    marks = _class_marks(model)
    with torch.no_grad():
        ref = model(**batch).logits
    report = kernelize(model)
    assert report.path == wiring
    assert all(report.installed(k) for k in ("rmsnorm", "rope", "glu", "cross_entropy"))
    report.undo()
    assert not any(report.installed(k) for k in ("rmsnorm", "rope", "glu", "cross_entropy"))
    assert not is_fused_cross_entropy_installed(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    funcs = [f for m in model.modules() for f in m.__dict__.get("_kernel_funcs", {}).values()]
    assert funcs and not any("forward" in f.__dict__ for f in funcs)
    assert _class_marks(model) == marks
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref)
    report.undo()  # harmless twice
    with pytest.raises(ValueError, match="kind"):
        report.installed("attention")


def test_unsupported_activation_left_alone(caplog):
    model = tiny("llama", hidden_act="relu")
    with caplog.at_level(logging.WARNING, logger="hf_varlen"):
        report = kernelize(model, cross_entropy=False)
    assert report.counts["glu"] == 0 and report.counts["rmsnorm"] == 5
    reason = report.left_alone["model.layers.0.mlp"]
    assert "unsupported activation ReLU" in reason
    assert any("unsupported activation ReLU" in r.getMessage() for r in caplog.records)
    assert not any(is_ours(m) for m in model.modules() if isinstance(m, LlamaMLP))


@pytest.mark.parametrize(
    "act, layer",
    [("silu", "SwiGLUMLP"), ("gelu", "GeGLUMLP"), ("gelu_pytorch_tanh", "GeGLUMLP")],
)
def test_glu_mlp_per_activation(act, layer):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act=act)
    torch.manual_seed(0)
    host = nn.ModuleDict({"mlp": LlamaMLP(config)})
    host = host.to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE)
    hi_mlp, lo_mlp = copy.deepcopy(host["mlp"]).double(), copy.deepcopy(host["mlp"])
    report = kernelize(host, cross_entropy=False)
    assert report.layers == {"LlamaMLP": layer}
    xs = [x.double().requires_grad_(), x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [m(t) for m, t in zip((hi_mlp, lo_mlp, host["mlp"]), xs)]
    assert_numerics("mlp out", outs[2], outs[0], outs[1])
    for out in outs:
        out.pow(2).sum().backward()
    assert_numerics("mlp dx", xs[2].grad, xs[0].grad, xs[1].grad, factor=3.0)


class ToyGemmaStyleRMSNorm(nn.Module):
    """A (1 + w) norm carrying the Llama hub name, as a decorated class would."""

    kernel_layer_name = "RMSNorm"

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = 1e-6

    def forward(self, x):
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (n * (1.0 + self.weight.float())).to(x.dtype)


class ToyMeanCenteredRMSNorm(nn.Module):
    """Named like an RMSNorm but subtracts the mean: neither style, must be left alone."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        h = hidden_states - hidden_states.mean(-1, keepdim=True)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_norm_style_is_probed_never_guessed(caplog):
    torch.manual_seed(0)
    host = nn.ModuleDict({"a": ToyGemmaStyleRMSNorm(16), "b": ToyMeanCenteredRMSNorm(16)})
    host = host.to(DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    hi, lo = copy.deepcopy(host["a"]).double()(x.double()), host["a"](x)
    with caplog.at_level(logging.WARNING, logger="hf_varlen"):
        report = kernelize(host, cross_entropy=False)
    assert report.layers == {"ToyGemmaStyleRMSNorm": "GemmaRMSNorm"}
    assert report.replaced["rmsnorm"] == ["a"]
    assert "not a Llama-style" in report.left_alone["b"]
    assert not is_ours(host["b"])
    assert_numerics("gemma-style norm", host["a"](x), hi, lo)


def test_cpu_without_interpreter_replaces_nothing(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny("llama", device="cpu")
    report = kernelize(model, cross_entropy=False)
    assert sum(report.counts.values()) == 0
    assert "cannot run on device type 'cpu'" in report.left_alone["model.norm"]
    assert not any(is_ours(m) for m in model.modules())


def test_cross_entropy_installed_and_reported(monkeypatch):
    from hf_varlen import is_fused_cross_entropy_installed, uninstall_fused_cross_entropy

    model = tiny("llama")
    report = kernelize(model, rope=False, glu=False, rmsnorm=False)
    assert report.replaced["cross_entropy"] == ["LlamaForCausalLM"]
    assert is_fused_cross_entropy_installed(model)
    uninstall_fused_cross_entropy(model)

    monkeypatch.setitem(__import__("sys").modules, "hf_varlen.integrations.fused_loss", None)
    report = kernelize(model, rope=False, glu=False, rmsnorm=False)
    assert "not available" in report.left_alone["cross_entropy"]
    assert not is_fused_cross_entropy_installed(model)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kernelize("not a model")
    with pytest.raises(TypeError, match="device must be"):
        kernelize(nn.Linear(2, 2), device=3)


def test_layers_survive_transformers_own_kernelization(tmp_path):
    """From transformers 5.25 ``from_pretrained`` turns on its own kernelization, which runs
    again at every train() / eval() switch and resets hub-decorated layers (RMSNorm) to their
    class forward: the fused layers must still be there after the switches, and undo gives
    transformers its switch back."""
    tiny("llama").save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").to(DEVICE)
    had_hf_kernels = bool(getattr(model, "use_kernels", False))
    report = kernelize(model, cross_entropy=False)
    assert report.counts["rmsnorm"] == 5, report
    model.train()
    model.eval()
    model.train()
    ours = [n for n, m in model.named_modules() if is_ours(m)]
    assert len([n for n in ours if "norm" in n]) == 5, ours
    report.undo()
    assert not any(is_ours(m) for m in model.modules())
    assert bool(getattr(model, "use_kernels", False)) == had_hf_kernels
