"""The generated kernel-hub package, and ``attn_implementation="<org>/hf-varlen"`` through
transformers' own hub-kernel loader with ``LOCAL_KERNELS`` (CPU, tiny random Llama)."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch
from tiny_packed import KERNEL_SHAPE
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils

import hf_varlen
from hf_varlen.integrations.hub import attention as hub_attention
from hf_varlen.integrations.hub.package import (
    _check_imports,
    enable_local_hub_kernel,
    hub_kernel_path,
)
from hf_varlen.testing import assert_numerics

LAYERS = ("RMSNorm", "GemmaRMSNorm", "RotaryPosEmb", "SwiGLUMLP", "GeGLUMLP")
FA2_VARLEN = [
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
    "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
    "return_attn_probs",
]  # fmt: skip
LENGTHS = (5, 9, 4)

needs_kernels = pytest.mark.skipif(
    not import_utils.is_kernels_available(),
    reason="kernels is missing or not accepted by this transformers: hub route not tested",
)


def test_package_is_generated_from_the_sources(tmp_path):
    repo = hub_kernel_path(tmp_path)
    variant = repo / "build" / "torch-universal"
    meta = json.loads((variant / "metadata.json").read_text())
    assert meta["python-depends"] == [] and meta["version"] == 1
    assert meta["id"].isidentifier() and meta["backend"] == {"type": "cuda"}
    root = Path(hf_varlen.__file__).parent
    ops = sorted(p for p in (root / "ops").rglob("*.py") if "__pycache__" not in p.parts)
    assert ops, "hf_varlen/ops has no modules"
    assert any(p.parent != root / "ops" for p in ops)  # the per-op packages are copied too
    for src in ops:
        rel = src.relative_to(root / "ops")
        assert (variant / "ops" / rel).read_bytes() == src.read_bytes(), str(rel)
    for name in ("layers.py", "attention.py"):
        assert (variant / "integrations" / "hub" / name).read_bytes() == (
            root / "integrations" / "hub" / name
        ).read_bytes()
    assert hub_kernel_path(tmp_path) == repo  # content-addressed: same sources, same package
    assert list(tmp_path.iterdir()) == [repo]  # no temporary directory left behind


def test_copied_modules_must_import_relatively():
    _check_imports("ops/rope.py", b"import torch\nfrom .glu import swiglu\n")
    _check_imports("integrations/hub/layers.py", b"from ...ops.glu import swiglu\n")
    _check_imports("integrations/hub/attention.py", b"def f():\n    from hf_varlen import x\n")
    with pytest.raises(ValueError, match="absolute hf_varlen import"):
        _check_imports("ops/rope.py", b"from hf_varlen.reference import rope\n")
    with pytest.raises(ValueError, match="climbs out of hf_varlen/ops"):
        _check_imports("ops/rope.py", b"from ..reference import rope\n")
    _check_imports("ops/rope/function.py", b"from ..common import check_int\n")
    with pytest.raises(ValueError, match="climbs out of hf_varlen/ops"):
        _check_imports("ops/rope/function.py", b"from ...reference import rope\n")
    with pytest.raises(ValueError, match="climbs out of the hub package"):
        _check_imports("integrations/hub/layers.py", b"from ....x import y\n")


def test_package_loads_through_kernels(tmp_path):
    kernels = pytest.importorskip("kernels")
    repo = hub_kernel_path(tmp_path)
    module = kernels.get_local_kernel(repo)
    meta = json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text())
    assert module.__name__ == meta["id"]
    for name in LAYERS:  # kernels' layer rules: no __init__, no members but the two flags
        layer = getattr(module.layers, name)
        assert issubclass(layer, nn.Module) and layer.__init__ is nn.Module.__init__
        assert layer.has_backward is True
        extra = {n for n, _ in inspect.getmembers(layer)} - set(dict(inspect.getmembers(nn.Module)))
        assert extra <= {"has_backward", "can_torch_compile"}, extra
    params = inspect.signature(module.flash_attn_varlen_func).parameters
    assert list(params)[: len(FA2_VARLEN)] == FA2_VARLEN and "s_aux" in params
    assert callable(module.flash_attn_func)


def test_enable_local_hub_kernel_sets_local_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_KERNELS", "other/kernel=/somewhere:hf-varlen/hf-varlen=/stale")
    assert enable_local_hub_kernel(cache_dir=tmp_path) == "hf-varlen/hf-varlen"
    repo = hub_kernel_path(tmp_path)
    assert (
        __import__("os").environ["LOCAL_KERNELS"]
        == f"other/kernel=/somewhere:hf-varlen/hf-varlen={repo}"
    )
    for bad in ("no-slash", "a/b/c", "a/b:c", "a/b@v1"):
        with pytest.raises(ValueError, match="repo_id"):
            enable_local_hub_kernel(bad, cache_dir=tmp_path)


def test_flash_attn_entry_points_translate_fa2_arguments(monkeypatch):
    calls = []

    def recorder(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, kw))
        return torch.zeros_like(q)

    monkeypatch.setattr(hf_varlen, "varlen_attention", recorder)
    q, k = torch.randn(7, 4, 8), torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    hub_attention.flash_attn_varlen_func(
        q, k, k, cu, cu, torch.tensor(4), torch.tensor(4), causal=True, window_size=(3, 3)
    )
    *_, max_q, max_k, kw = calls[-1]
    assert (max_q, max_k) == (4, 4) and isinstance(max_q, int)
    assert kw["window_size"] == (3, 0) and kw["causal"] is True and kw["softcap"] == 0.0

    kb = k[None].expand(2, 7, 2, 8)
    out = hub_attention.flash_attn_func(q[None].expand(2, 7, 4, 8), kb, kb)
    assert out.shape == (2, 7, 4, 8)
    assert calls[-1][0] == [0, 7, 14] and calls[-1][2] == 7 and calls[-1][4]["causal"] is False

    for bad in ({"alibi_slopes": torch.ones(4)}, {"return_attn_probs": True}):
        with pytest.raises(NotImplementedError):
            hub_attention.flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, **bad)
    # attention sinks are served (one logit per query head); any other shape is refused by name
    sinks = torch.randn(4)
    hub_attention.flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, s_aux=sinks)
    assert calls[-1][4]["sinks"] is sinks
    monkeypatch.undo()  # the real varlen_attention checks the sinks
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head"):
        hub_attention.flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, s_aux=q)
    with pytest.raises(ValueError, match=r"\(B, T, H, D\)"):
        hub_attention.flash_attn_func(q, k, k)


# ------------------------------------------------------- attn_implementation="<org>/hf-varlen"


def tiny_llama(attn_implementation: str) -> LlamaForCausalLM:
    config = LlamaConfig(**KERNEL_SHAPE, use_cache=False, attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def forward_backward(model, docs, weights):
    """Logits of every document (concatenated) and parameter grads of sum(logits * weights)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(**doc).logits[0] for doc in docs])
    (logits.double() * weights).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@needs_kernels
@pytest.mark.parametrize(
    "device, dtype",
    [
        pytest.param("cpu", torch.float32, id="cpu-fp32"),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
    ],
)
def test_hub_attention_matches_eager_per_document(monkeypatch, tmp_path, device, dtype):
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    repo_id = enable_local_hub_kernel("hf-varlen-test/hf-varlen", cache_dir=tmp_path)
    calls = []  # every attention call must reach hf_varlen (no silent fallback to another path)
    original = hf_varlen.varlen_attention

    def counting(*args, **kwargs):
        calls.append(args[3].tolist())
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_varlen, "varlen_attention", counting)
    hub = tiny_llama(repo_id)
    eager = tiny_llama("eager")
    eager.load_state_dict(hub.state_dict())
    hub, eager = hub.to(device, dtype), eager.to(device)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=g).to(device)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
    weights = torch.randn(sum(LENGTHS), 128, generator=g, dtype=torch.float64).to(device)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    docs = [
        {"input_ids": ids[:, a:b], "position_ids": position_ids[:, a:b]}
        for a, b in zip(starts[:-1], starts[1:])
    ]
    hi = forward_backward(copy.deepcopy(eager).double(), docs, weights)
    eager = eager.to(dtype)
    lo = forward_backward(eager, docs, weights)

    # position_ids only (TRL style): transformers derives cu_seqlens from the position resets
    x = forward_backward(hub, [{"input_ids": ids, "position_ids": position_ids}], weights)
    assert calls and all(c == starts for c in calls), calls[:2]
    assert_numerics("hub logits", x[0], hi[0], lo[0])
    for name in hi[1]:
        assert_numerics(f"hub grad {name}", x[1][name], hi[1][name], lo[1][name], factor=3.0)

    # collator style: cu_seq_lens_q/k + max_length_q/k
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    calls.clear()
    with torch.no_grad():
        logits = hub(input_ids=ids, position_ids=position_ids, **kwargs).logits[0]
    assert len(calls) == 2 and all(c == starts for c in calls)
    assert_numerics("hub logits (cu_seq_lens)", logits, hi[0], lo[0])

    # equal-length rows without a mask take transformers' dense path (our flash_attn_func)
    rows = ids[:, :8].repeat(2, 1)
    rows[1] = ids[0, 8:16]
    calls.clear()
    with torch.no_grad():
        dense = hub(input_ids=rows).logits
        ref_hi = copy.deepcopy(eager).double()(input_ids=rows).logits
        ref_lo = eager(input_ids=rows).logits
    assert calls == [[0, 8, 16]] * 2
    assert_numerics("hub logits (dense)", dense, ref_hi, ref_lo)
