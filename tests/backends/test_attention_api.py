"""The attention call's structure (issue 10): one AttentionParams built once, the backend
signature ``fn(q, k, v, metadata, params)``, per-model backend scope, one tensor cache, the
deterministic flag reaching the kernel, and no logging while compiling."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from attn_cases import cu_from_lengths, make_qkv
from tiny_packed import tiny_llama

import hf_varlen
from hf_varlen.backends import AttentionParams, BackendSpec, VarlenMetadata, registry
from hf_varlen.ops.common import TensorCache

# ---- AttentionParams: causality folded into the window once --------------------------------------


@pytest.mark.parametrize(
    "causal,window,want",
    [
        (True, (-1, -1), (-1, 0)),
        (True, (4, 4), (4, 0)),  # transformers / the hub route: (W - 1, W - 1) with causal=True
        (True, (4, -1), (4, 0)),
        (False, (-1, -1), (-1, -1)),
        (False, (3, 2), (3, 2)),
    ],
)
def test_params_fold_causal_into_window(causal, window, want):
    p = AttentionParams.create(head_dim=64, causal=causal, window_size=window)
    assert p.window == want
    assert p.causal == (want[1] == 0)
    assert p.sliding_window == (want not in ((-1, 0), (-1, -1)))
    assert p.softmax_scale == 64**-0.5
    with pytest.raises(AttributeError):
        p.softcap = 1.0  # frozen


def _recording_backend(seen):
    def fn(q, k, v, metadata, params):
        seen.append((metadata, params))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)

    return BackendSpec(
        name="recording",
        fn=fn,
        description="test",
        requires="nothing",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        sliding_window=True,
        softcap=True,
    )


def test_user_backend_gets_metadata_and_params(monkeypatch):
    seen = []
    monkeypatch.setitem(registry._REGISTRY, "recording", _recording_backend(seen))
    q, k, v = make_qkv([3, 5], 4, 2, 16, torch.float32)
    cu = cu_from_lengths([3, 5])
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "yes")  # one definition: yes/on/true/1
    out = hf_varlen.varlen_attention(
        q, k, v, cu, cu, 5, 5, window_size=(2, 2), softcap=3, backend="recording"
    )
    assert out.shape == q.shape
    ((meta, params),) = seen
    assert isinstance(meta, VarlenMetadata) and meta.cu_seqlens_q is cu
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (5, 5)
    assert params == AttentionParams(
        window=(2, 0), softmax_scale=0.25, softcap=3.0, dropout_p=0.0, deterministic=True
    )


# ---- per-model backend scope ---------------------------------------------------------------------


def test_set_backend_scoped_to_one_model(monkeypatch):
    from hf_varlen import functional

    chosen = []
    real = functional.resolve

    def spy(name, req):
        spec = real(name, req)
        chosen.append(spec.name)
        return spec

    monkeypatch.setattr(functional, "resolve", spy)
    monkeypatch.delenv("HF_VARLEN_BACKEND", raising=False)
    torch.manual_seed(0)
    scoped, plain = tiny_llama(layers=2), tiny_llama(layers=2)
    ids = torch.randint(0, 50, (1, 9))
    hf_varlen.set_backend("reference", model=scoped)
    try:
        assert hf_varlen.model_backend(scoped) == "reference"
        assert hf_varlen.model_backend(plain) is None
        assert hf_varlen.default_backend() == "auto"  # the process default is untouched
        scoped(input_ids=ids)
        assert chosen == ["reference", "reference"]  # one per layer
        chosen.clear()
        plain(input_ids=ids)
        assert chosen == ["sdpa", "sdpa"]  # auto on CPU
        chosen.clear()
        # process default < model scope < explicit argument
        hf_varlen.set_backend("sdpa")
        scoped(input_ids=ids)
        assert chosen == ["reference", "reference"]
    finally:
        hf_varlen.set_backend(None)
        hf_varlen.set_backend(None, model=scoped)
    assert hf_varlen.model_backend(scoped) is None
    assert not any(hasattr(m, registry.MODEL_BACKEND_ATTR) for m in scoped.modules())


def test_set_backend_model_validates_like_process_wide():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a known varlen attention backend"):
        hf_varlen.set_backend("bogus", model=model)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cannot run here"):
            hf_varlen.set_backend("triton", model=model)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hf_varlen.set_backend("sdpa", model="not a model")
    assert hf_varlen.model_backend(model) is None


# ---- logging: never inside a traced region -------------------------------------------------------


def test_auto_logs_once_and_never_while_compiling(monkeypatch, caplog):
    req = registry.Request(
        device="cpu",
        dtype=torch.float64,
        head_dim=24,
        causal=True,
        window=False,
        softcap=False,
        dropout=False,
    )
    monkeypatch.setattr(registry, "_AUTO_LOGGED", set())
    caplog.set_level(logging.INFO, logger="hf_varlen")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert registry.resolve("auto", req).name == "sdpa"
    assert not caplog.records
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    registry.resolve("auto", req)
    registry.resolve("auto", req)
    # the same choice for a call with other features (a no-grad trial forward, then training)
    registry.resolve("auto", dataclasses.replace(req, needs_grad=not req.needs_grad))
    assert len(caplog.records) == 1 and "chose 'sdpa'" in caplog.records[0].getMessage()


# ---- the deterministic flag reaches the kernel's backward launch ---------------------------------


@pytest.mark.parametrize("env,arg,want", [("", False, False), ("1", False, True), ("", True, True)])
def test_deterministic_reaches_triton_backward(monkeypatch, env, arg, want):
    from hf_varlen.ops import attention as op
    from hf_varlen.ops.attention import launch  # where the backward is launched from

    seen = []
    real = launch.attention_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "attention_backward", spy)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", env)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU
    q, k, v = make_qkv([5, 7], 2, 1, 16, torch.float32, device)
    q.requires_grad_(True)
    cu = cu_from_lengths([5, 7], device)
    op.triton_varlen_attention(q, k, v, cu, cu, deterministic=arg).sum().backward()
    # and through the backend, with the flag as the public layer resolved it
    params = AttentionParams.create(head_dim=16, causal=True, deterministic=want)
    meta = VarlenMetadata(cu, cu, 7, 7)
    hf_varlen.backends.get_spec("triton").fn(q, k, v, meta, params).sum().backward()
    assert seen == [want, want]


# ---- TensorCache ---------------------------------------------------------------------------------


def test_tensor_cache_identity_version_and_inference_tensors():
    cache = TensorCache(size=2)
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    a = torch.zeros(3)
    assert cache.get_or_compute(a, compute) == 1
    assert cache.get_or_compute(a, compute) == 1  # same object: cached
    assert cache.get_or_compute(a.clone(), compute) == 2  # equal contents, another object
    a.add_(1)
    assert cache.get_or_compute(a, compute) == 3  # in-place edit bumps the version
    assert cache.get_or_compute((), compute, extra=(1, 2)) == 4  # keyed on ints alone
    assert cache.get_or_compute((), compute, extra=(1, 2)) == 4
    with torch.inference_mode():
        b = torch.zeros(2)
    assert cache.get_or_compute(b, compute) == 5  # no version counter: never cached
    assert cache.get_or_compute(b, compute) == 6


def test_tensor_cache_neither_serves_nor_stores_during_cuda_graph_capture(monkeypatch):
    """Replays of a captured graph bring new data into the same tensors (same identity, same
    version): a value cached at warm-up would be stale there, so it must be computed inside the
    graph. (The capture itself needs CUDA; the predicate is faked here.)"""
    from hf_varlen.ops import common

    cache = TensorCache(size=2)
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    a = torch.zeros(3)
    assert cache.get_or_compute(a, compute) == 1  # the warm-up, outside any capture
    monkeypatch.setattr(common, "capturing", lambda tensors: True)
    assert cache.get_or_compute(a, compute) == 2  # not served from the warm-up
    assert cache.get_or_compute(a, compute) == 3  # and nothing stored during the capture
    monkeypatch.undo()
    assert cache.get_or_compute(a, compute) == 1  # the warm-up value again, outside


def test_capturing_is_not_asked_for_cpu_tensors():
    from hf_varlen.ops.common import capturing

    # on a CPU-only torch build torch.cuda.is_current_stream_capturing() raises: never reached
    assert capturing((torch.zeros(2), torch.zeros(1, dtype=torch.int32))) is False


def test_host_offset_backend_refuses_a_cuda_graph_capture(monkeypatch):
    """Inside a capture the host read would fail in CUDA without a word: a clear error instead,
    raised before the backend launches anything. (The capture itself needs CUDA; faked here.)"""
    from hf_varlen.ops import common

    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    monkeypatch.setattr(common, "capturing", lambda tensors: True)
    for backend in ("sdpa", "reference"):
        with pytest.raises(RuntimeError, match="reads the offsets on the host.*CUDA graph"):
            hf_varlen.varlen_attention(q, q, q, cu, cu, 6, 6, backend=backend)


def test_metadata_from_rows_cached_per_shape():
    from hf_varlen.metadata import from_rows

    a = from_rows(2, 5, 5, torch.device("cpu"))
    assert from_rows(2, 5, 5, torch.device("cpu")) is a
    assert from_rows(2, 5, 7, torch.device("cpu")).cu_seqlens_k.tolist() == [0, 7, 14]


def test_varlen_metadata_and_compile_helpers_have_one_home():
    """One class, defined in hf_varlen.metadata; the other paths re-export it. The torch.compile
    helpers live in hf_varlen.compile_support and keep their old hf_varlen.metadata path."""
    import hf_varlen.backends.params
    import hf_varlen.compile_support
    import hf_varlen.metadata

    canonical = hf_varlen.metadata.VarlenMetadata
    assert canonical.__module__ == "hf_varlen.metadata"
    assert hf_varlen.backends.VarlenMetadata is canonical
    assert hf_varlen.backends.params.VarlenMetadata is canonical
    for name in hf_varlen.compile_support.__all__:
        assert getattr(hf_varlen.metadata, name) is getattr(hf_varlen.compile_support, name)


def test_layers_of_one_batch_share_one_plan(monkeypatch):
    """The metadata of a batch is built and checked once and handed to the backend unchanged;
    the layers' params are built once per batch (layer 1), not per layer; a new batch, or the
    same offsets tensor edited in place, builds them again. The model's output equals the public
    varlen_attention route's per document (checked by the model tests); here: the counts."""
    from hf_varlen import functional

    created, validated, seen = [], [], []
    real_create, real_validate = AttentionParams.create.__func__, functional.validate_inputs
    monkeypatch.setattr(
        AttentionParams,
        "create",
        classmethod(lambda cls, **kw: created.append(1) or real_create(cls, **kw)),
    )
    monkeypatch.setattr(
        functional, "validate_inputs", lambda *a: validated.append(1) or real_validate(*a)
    )
    spec = registry.get_spec("sdpa")
    monkeypatch.setitem(
        registry._REGISTRY,
        "sdpa",
        dataclasses.replace(
            spec, fn=lambda q, k, v, m, p: seen.append(m) or spec.fn(q, k, v, m, p)
        ),
    )
    torch.manual_seed(0)
    model = _tiny_llama()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    batch = dict(
        input_ids=torch.randint(0, 50, (1, 9)),
        position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=5,
        max_length_k=5,
    )
    with torch.no_grad():
        first = model(**batch).logits
        assert len(created) == 1 and not validated  # two layers, one plan, no re-validation
        assert len(seen) == 2 and seen[0] is seen[1]
        assert seen[0].cu_seqlens_q.data_ptr() == cu.data_ptr()  # the collator's, not a copy
        model(**batch)  # the same tensors, unchanged: the batch's metadata and plan are reused
        assert len(created) == 1 and seen[2] is seen[0]
        cu[1] = 5  # edited in place: new documents, so new metadata and a new plan
        batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
        second = model(**batch).logits
    assert (
        len(created) == 2 and seen[4] is not seen[0] and seen[4].cu_seqlens_q.tolist() == [0, 5, 9]
    )
    assert not torch.equal(first, second)
