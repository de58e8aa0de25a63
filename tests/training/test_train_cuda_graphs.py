"""``hf-varlen train --cuda-graphs`` (issue 14, item 3): the captured step's plumbing on the CPU.

A CUDA graph cannot be captured here, so these tests replace the capture by the function itself
(a "replay" runs it again on the same static buffers): what they check is everything around the
capture — batches copied into per-shape static buffers, the warm-up's gradients undone, gradient
accumulation into static ``.grad`` buffers, the clip, the fused AdamW update with learning rates
as tensors the scheduler fills, a non-finite step skipped on the device, one read-back per step —
against the eager trainer on the same data (CPU, fp32, tiny Llama). Also: which runs can capture,
``on`` refusing with the reasons before anything loads, ``auto`` saying why it stayed off.
The capture itself runs on the GPU (tests/backends/test_cuda_graph_capture.py and the e2e
benchmark).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_runs import eager_capture as _eager_capture
from tiny_runs import tiny_train_config

from hf_varlen.captured_step import graphs as step_graphs
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training import graphs as graphs_mod
from hf_varlen.training.graphs import GraphedStep, graph_blockers
from hf_varlen.training.metrics import read_log


def _tiny(tmp_path, name, **overrides) -> TrainConfig:
    base = dict(
        max_steps=6,
        static_shapes=True,
        warmup_steps=2,  # a schedule that moves: the captured update must follow it
        max_grad_norm=0.5,  # a clip that bites
    )
    return tiny_train_config(tmp_path, name, **{**base, **overrides})


@pytest.fixture
def capture_on_cpu(monkeypatch):
    monkeypatch.setattr(step_graphs, "_capture_cuda", _eager_capture)
    monkeypatch.setattr(graphs_mod, "graph_blockers", lambda *a: [])


def _run(cfg):
    trainer = PackedTrainer(cfg)
    summary = trainer.run()
    records = [r for r in read_log(cfg.output_dir) if "loss" in r]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return records, summary, params


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_graphed_step_trains_like_the_eager_step(tmp_path, capture_on_cpu, grad_accum):
    eager, _, p_eager = _run(_tiny(tmp_path, "eager", grad_accum=grad_accum))
    graphed, summary, p_graphed = _run(
        _tiny(tmp_path, "graphs", grad_accum=grad_accum, cuda_graphs="on")
    )
    # fused AdamW (graphs) vs the CPU's for-loop AdamW (eager): equal up to fp32 rounding
    for key in ("loss", "grad_norm", "lr", "real_tokens", "label_tokens", "tensor_tokens"):
        got = torch.tensor([r[key] for r in graphed], dtype=torch.float64)
        want = torch.tensor([r[key] for r in eager], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7, msg=key)
    assert any(r["grad_norm"] > 0.5 for r in eager)  # the clip was exercised
    for name, p in p_eager.items():
        torch.testing.assert_close(p_graphed[name], p, rtol=1e-4, atol=1e-6, msg=name)
    info = summary["cuda_graphs"]
    # one micro-batch per step: one graph per shape holds the whole step (fresh gradients);
    # with accumulation, one per shape for forward + backward and one for the update
    assert info["whole_step"] == (grad_accum == 1), info
    assert info["on"] and info["graphs"] == (grad_accum > 1) + len(info["shapes"]), info
    assert info["shapes"] == sorted(summary["static_shapes"]["shapes"]), info
    assert info["capture_s"] > 0 and "warm-up + capture" in info["text"]


def test_graphed_step_on_a_compiled_model(tmp_path, capture_on_cpu):
    """--compile with --cuda-graphs: the captured body calls the compiled model (aot_eager here),
    the losses follow the compiled eager-loop run, and the static shapes compile at most twice."""
    kw = dict(compile=True, compile_backend="aot_eager", max_steps=4)
    eager, _, _ = _run(_tiny(tmp_path, "eager", **kw))
    torch._dynamo.reset()
    graphed, summary, _ = _run(_tiny(tmp_path, "graphs", cuda_graphs="on", **kw))
    got = torch.tensor([r["loss"] for r in graphed], dtype=torch.float64)
    want = torch.tensor([r["loss"] for r in eager], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
    assert summary["cuda_graphs"]["on"] and summary["compile"]["compilations"] <= 2


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_graphed_run_resumes_bit_identically(tmp_path, capture_on_cpu, grad_accum):
    """A graphed run saved mid-way (tensor learning rates, capturable AdamW state in the
    checkpoint) and resumed with graphs continues exactly as the uninterrupted graphed run, with
    an eval between steps (eager forwards on the captured model); grad_accum 1 runs whole-step
    graphs with fresh gradients, 2 the accumulating ones."""
    common = dict(cuda_graphs="on", grad_accum=grad_accum, max_steps=6, eval_split=0.1)
    common["eval_every"] = 2
    straight = PackedTrainer(_tiny(tmp_path, "a", save_every=3, **common))
    straight.run()
    resumed = PackedTrainer(
        _tiny(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-3"), **common)
    )
    assert resumed.state.step == 3
    resumed.run()

    def log(run):
        drop = ("elapsed", "step_time", "tokens_per_s", "tflops_per_s", "mfu", "peak_mem_gib")
        drop += ("captures",)  # the resumed process captures its graphs anew
        recs = read_log(str(tmp_path / run))
        return [{k: v for k, v in r.items() if k not in drop} for r in recs if r["step"] > 3]

    assert log("a") == log("b") and any("eval_loss" in r for r in log("a"))
    a = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, a[name]), name


def test_a_non_finite_step_is_skipped_on_the_device():
    """The update graph skips a step whose loss is not finite (found_inf): no parameter, moment or
    step count moves, the gradients are zeroed, and the step after it updates normally."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    poison = {"on": False}

    def loss_fn(m, inputs, n_items):
        loss = m(inputs["input_ids"].float().view(-1, 1).expand(-1, 4)).square().sum() / n_items
        return loss * math.nan if poison["on"] else loss

    step = GraphedStep(
        model, opt, loss_fn, device=torch.device("cpu"), max_grad_norm=1.0, capture=_eager_capture
    )
    batch = {"input_ids": torch.arange(6).view(1, 6)}
    first = step.step([batch], n_items=6)
    assert not first["skipped"] and math.isfinite(first["loss"])
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    poison["on"] = True
    out = step.step([batch], n_items=6)
    assert out["skipped"] and math.isnan(out["loss"])
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
        assert float(p.grad.abs().sum()) == 0.0
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, state[k]), k
    poison["on"] = False
    assert not step.step([batch], n_items=6)["skipped"]
    assert not torch.equal(model.weight.detach(), before[0])


def test_one_graph_per_batch_shape():
    model = torch.nn.Embedding(50, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = GraphedStep(
        model,
        opt,
        lambda m, b, n: m(b["input_ids"]).sum() / n,
        device=torch.device("cpu"),
        max_grad_norm=math.inf,
        capture=_eager_capture,
    )
    for t in (8, 16, 8, 8, 16):
        step.step([{"input_ids": torch.randint(0, 50, (1, t))}], n_items=t)
    assert sorted(step.graphs) == sorted({(("input_ids", (1, t), torch.int64),) for t in (8, 16)})
    assert step.summary()["shapes"] == [8, 16] and step.summary()["graphs"] == 3
    with pytest.raises(ValueError, match="packed \\[1, T\\] micro-batches"):
        step.step([{"input_ids": torch.zeros(2, 8, dtype=torch.int64)}], n_items=8)


def test_a_new_shape_late_in_a_step_keeps_the_accumulated_micro_batches():
    """Gradient accumulation where the step's second micro-batch has a shape not seen before: its
    capture (whose warm-up passes are undone by zeroing the gradients) happens before any replay
    of the step, so the step's loss and gradient norm are those of both micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(50, 3)

    def loss_fn(m, b, n):
        return m(b["input_ids"]).square().sum() / n

    step = GraphedStep(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.1),
        loss_fn,
        device=torch.device("cpu"),
        max_grad_norm=math.inf,
        capture=_eager_capture,
    )
    first = {"input_ids": torch.randint(0, 50, (1, 8))}
    step.step([first], n_items=8)  # the 8-token shape is known from now on
    batches = [{"input_ids": torch.randint(0, 50, (1, t))} for t in (8, 16)]
    ref = copy.deepcopy(model)
    want = sum(loss_fn(ref, b, 24) for b in batches)
    want.backward()
    out = step.step(batches, n_items=24)
    assert out["loss"] == pytest.approx(float(want), rel=1e-6)
    assert out["grad_norm"] == pytest.approx(float(ref.weight.grad.norm()), rel=1e-6)
    assert step.summary()["shapes"] == [8, 16]


def test_which_runs_can_capture(tmp_path):
    cuda = torch.device("cuda")
    assert graph_blockers(_tiny(tmp_path, "ok"), cuda, 1, "bf16") == []
    # Captured since issue 46: bf16-mixed and checkpointing
    # (tests/training/test_captured_step_modes.py).
    ok = _tiny(tmp_path, "ok", gradient_checkpointing=True, lora=True)
    assert graph_blockers(ok, cuda, 1, "bf16-mixed") == []
    cases = {
        "CUDA device": (dict(), torch.device("cpu"), 1, "fp32"),
        "--static-shapes": (dict(static_shapes=False), cuda, 1, "bf16"),
        "one process": (dict(), cuda, 2, "bf16"),
        "--optim sgd": (dict(optim="sgd"), cuda, 1, "bf16"),
        "--lora-dropout": (
            dict(gradient_checkpointing=True, lora=True, lora_dropout=0.1),
            cuda,
            1,
            "bf16",
        ),
        "reduce-overhead": (
            dict(compile=True, compile_mode="reduce-overhead"),
            cuda,
            1,
            "bf16",
        ),
    }
    for needle, (kw, device, processes, precision) in cases.items():
        reasons = graph_blockers(_tiny(tmp_path, "x", **kw), device, processes, precision)
        assert len(reasons) == 1 and needle in reasons[0], (needle, reasons)


def test_on_refuses_before_loading_and_auto_says_why(tmp_path):
    with pytest.raises(ValueError, match="--cuda-graphs on cannot be honoured: .*CUDA device"):
        PackedTrainer(_tiny(tmp_path, "on", cuda_graphs="on"))
    _, summary, _ = _run(_tiny(tmp_path, "auto", cuda_graphs="auto", max_steps=2))
    info = summary["cuda_graphs"]
    assert info["on"] is False and "auto: CUDA graphs need a CUDA device" in info["text"]
    _, summary, _ = _run(_tiny(tmp_path, "off", max_steps=2))
    assert summary["cuda_graphs"] is None  # the default (off) adds nothing to the summary
    with pytest.raises(ValueError, match="--cuda-graphs: expected one of"):
        _tiny(tmp_path, "bad", cuda_graphs="yes").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_captured_step_trains_like_eager(tmp_path, compiled):
    """The real capture on CUDA: per-step losses and gradient norms of --cuda-graphs on follow the
    eager run under the numerics rule (ref_lo: eager bf16; ref_hi: eager fp32), with the update,
    the clip and the LR schedule inside the graphs."""
    from hf_varlen.testing import assert_numerics

    def series(name, **kw):
        records, summary, _ = _run(
            _tiny(tmp_path, name, max_steps=8, fused_kernels="on", compile=compiled, **kw)
        )
        return (
            {k: torch.tensor([r[k] for r in records], dtype=torch.float64) for k in ("loss",)},
            summary,
        )

    lo, _ = series("lo", precision="bf16")
    hi, _ = series("hi", precision="fp32")
    x, summary = series("x", precision="bf16", cuda_graphs="on")
    assert_numerics("--cuda-graphs losses", x["loss"], hi["loss"], lo["loss"], factor=2)
    info = summary["cuda_graphs"]
    assert info["on"] and info["whole_step"] and info["graphs"] == len(info["shapes"]), info


def test_whole_step_graphs_match_the_accumulating_ones():
    """fresh_grads (one graph per shape holding the whole step, gradients allocated by the
    backward) against the static-buffer graphs on the same steps: same losses, norms and
    parameters; after a step the gradients are gone (back to the pool), and a non-finite step
    changes no parameter and no moment."""

    def run(fresh: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        poison = {"on": False}

        def loss_fn(m, inputs, n_items):
            loss = m(inputs["input_ids"]).square().sum() / n_items
            return loss * math.nan if poison["on"] else loss

        step = GraphedStep(
            model, opt, loss_fn, device=torch.device("cpu"), max_grad_norm=0.3,
            capture=_eager_capture, fresh_grads=fresh, halt_on_nonfinite=False,
        )  # fmt: skip
        outs = []
        for t in (8, 16, 8, 16, 16):
            outs.append(step.step([{"input_ids": torch.arange(t).view(1, t) % 32}], n_items=t))
            if fresh:
                assert all(p.grad is None for p in model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        moments = [v.clone() for p in model.parameters() for v in opt.state[p].values()]
        poison["on"] = True
        assert step.step([{"input_ids": torch.arange(8).view(1, 8)}], n_items=8)["skipped"]
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), b)
        after = [v for p in model.parameters() for v in opt.state[p].values()]
        assert all(torch.equal(a, b) for a, b in zip(after, moments, strict=True))
        return outs, before, step.summary()

    fresh, p_fresh, s_fresh = run(True)
    static, p_static, s_static = run(False)
    for key in ("loss", "grad_norm"):
        got = torch.tensor([o[key] for o in fresh], dtype=torch.float64)
        want = torch.tensor([o[key] for o in static], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=key)
    for a, b in zip(p_fresh, p_static, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert s_fresh["graphs"] == 2 and s_fresh["whole_step"] and "whole step" in s_fresh["text"]
    assert s_static["graphs"] == 3 and not s_static["whole_step"]


def test_whole_step_graphs_refuse_accumulation():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())

    def loss_fn(m, inputs, n_items):
        return m(inputs["input_ids"].float().view(-1, 1).expand(-1, 4)).sum() / n_items

    step = GraphedStep(
        model, opt, loss_fn, device=torch.device("cpu"), max_grad_norm=1.0,
        capture=_eager_capture, fresh_grads=True,
    )  # fmt: skip
    batch = {"input_ids": torch.arange(4).view(1, 4)}
    with pytest.raises(ValueError, match="one micro-batch per step, got 2"):
        step.step([batch, batch], n_items=8)
    with pytest.raises(ValueError, match="forward_backward accumulates"):
        step.forward_backward(batch, 4)
    with pytest.raises(ValueError, match="fresh_grads needs the update"):
        GraphedStep(model, opt, loss_fn, device=torch.device("cpu"), max_grad_norm=1.0,
                    update=False, fresh_grads=True)  # fmt: skip
