"""The captured step in flight: ``hf-varlen train`` reads a captured step's result only after it
has queued the next step, so that the GPU runs on while the host reads, logs and loads.

On the CPU the capture is replaced by the function itself (as in test_train_cuda_graphs.py), so
what these tests check is the order of launches and read-backs and what it must not change: the
same log and parameters as the eager run, steps that evaluate or save read back before the next
launch, and ``--on-nonfinite stop`` stopping with the parameters of the last finite step although
the step after the failed one was already queued (the update graph's halt flag).
"""

from __future__ import annotations

import pytest
import torch
from tiny_runs import eager_capture as _eager_capture
from tiny_runs import tiny_train_config

from hf_varlen.captured_step import graphs as step_graphs
from hf_varlen.captured_step.graphs import GraphedStep
from hf_varlen.captured_step.readback import StepResult
from hf_varlen.training import PackedTrainer
from hf_varlen.training import graphs as graphs_mod
from hf_varlen.training.loop import NonFiniteError
from hf_varlen.training.metrics import read_log


@pytest.fixture
def events(monkeypatch):
    """Captures on the CPU, and the order of the step's launches (L) and read-backs (R)."""
    monkeypatch.setattr(step_graphs, "_capture_cuda", _eager_capture)
    monkeypatch.setattr(graphs_mod, "graph_blockers", lambda *a: [])
    seen: list[tuple[str, int]] = []
    launch, read = GraphedStep.launch, GraphedStep.read

    def spy_launch(self, batches, n_items):
        new = self.new_shapes(batches)
        out = launch(self, batches, n_items)
        seen.append(("L", sum(1 for e in seen if e[0] == "L") + 1, new))
        return out

    def spy_read(out):
        seen.append(("R", sum(1 for e in seen if e[0] == "R") + 1, None))
        return read(out)

    monkeypatch.setattr(GraphedStep, "launch", spy_launch)
    monkeypatch.setattr(GraphedStep, "read", staticmethod(spy_read))
    return seen


def _cfg(tmp_path, name, **kw):
    base = dict(max_steps=8, static_shapes=True, warmup_steps=2, max_grad_norm=0.5)
    return tiny_train_config(tmp_path, name, **{**base, **kw})


def _order(seen):
    """For each read-back k: the number of launches before it."""
    out, launches = {}, 0
    for kind, n, _ in seen:
        if kind == "L":
            launches += 1
        else:
            out[n] = launches
    return out


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_step_is_read_after_the_next_is_launched_and_trains_like_eager(tmp_path, events):
    eager = PackedTrainer(_cfg(tmp_path, "eager"))
    eager.run()
    graphed = PackedTrainer(_cfg(tmp_path, "graphed", cuda_graphs="on"))
    graphed.run()
    order = _order(events)
    ahead = [k for k, launches in order.items() if launches > k]
    assert ahead, f"no step was read after the next launch: {events}"
    assert order[8] == 8  # the last step: nothing left to launch
    # a launch that captures a new shape reads the step before it back first
    for kind, n, new in events:
        if kind == "L" and new and n > 1:
            assert order[n - 1] == n - 1, events
    got, want = read_log(str(tmp_path / "graphed")), read_log(str(tmp_path / "eager"))
    for key in ("loss", "grad_norm", "lr", "real_tokens", "tensor_tokens"):
        a = torch.tensor([r[key] for r in got if "loss" in r], dtype=torch.float64)
        b = torch.tensor([r[key] for r in want if "loss" in r], dtype=torch.float64)
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7, msg=key)
    assert [r["step"] for r in got if "loss" in r] == list(range(1, 9))
    p_eager = _params(eager)
    for name, p in _params(graphed).items():
        torch.testing.assert_close(p, p_eager[name], rtol=1e-4, atol=1e-6, msg=name)


def test_steps_that_evaluate_or_save_are_read_before_the_next_launch(tmp_path, events):
    PackedTrainer(
        _cfg(tmp_path, "a", cuda_graphs="on", eval_split=0.1, eval_every=3, save_every=4)
    ).run()
    order = _order(events)
    for k in (3, 4, 6, 8):
        assert order[k] == k, (k, events)
    recs = read_log(str(tmp_path / "a"))
    assert [r["step"] for r in recs if "eval_loss" in r] == [3, 6, 8]
    assert (tmp_path / "a" / "checkpoint-4").is_dir()


def test_nonfinite_stop_keeps_the_last_finite_parameters_with_the_next_step_queued(
    tmp_path, events
):
    # A first run shows which step has a successor that replays a known shape (launched before
    # the failed step is read); the NaN goes there.
    kw = dict(cuda_graphs="on", fused_loss="off")  # the NaN hook sits on the LM head's output
    PackedTrainer(_cfg(tmp_path, "probe", **kw)).run()
    order = _order(events)
    k = next((k for k in range(2, 8) if order[k] > k), None)
    assert k is not None, events
    events.clear()

    holder: dict[str, PackedTrainer] = {}

    def nan_at_launch_of_step_k(model):
        def hook(module, args, output):
            t = holder.get("t")
            if module.training and t is not None and t.state.step + 1 == k:
                return output * float("nan")
            return output

        model.get_output_embeddings().register_forward_hook(hook)

    trainer = PackedTrainer(_cfg(tmp_path, "nan", **kw), model_hook=nan_at_launch_of_step_k)
    holder["t"] = trainer
    with pytest.raises(NonFiniteError, match=rf"step {k}: non-finite loss"):
        trainer.run()
    assert _order(events)[k] == k + 1  # step k + 1 was queued when step k was read
    steps = [r["step"] for r in read_log(str(tmp_path / "nan")) if "loss" in r]
    assert steps == list(range(1, k))

    reference = PackedTrainer(_cfg(tmp_path, "ref", max_steps=k - 1, **kw))
    reference.run()
    want = _params(reference)
    for name, p in _params(trainer).items():
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)


def test_host_lr_follows_the_schedule_without_reading_the_rate_tensors(monkeypatch):
    """The rate of the step about to launch comes from the schedule's rule, not from the device
    tensors it fills (reading those would wait for the steps still queued)."""
    from transformers import get_scheduler

    from hf_varlen.training.stepping import host_lr

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=6)
    opt.param_groups[0]["lr"] = torch.tensor(opt.param_groups[0]["lr"])  # as the captured step
    sched._last_lr = [opt.param_groups[0]["lr"]]
    values = []
    for _ in range(6):
        values.append(float(opt.param_groups[0]["lr"]))
        sched.step()
    reads = []
    to_float = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or to_float(t))
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=6)
    for want in values:
        assert host_lr(sched) == pytest.approx(want, rel=1e-6, abs=0)
        sched.step()
    assert not reads
    del sched.lr_lambdas  # another schedule: its tensor is read, the one way left
    host_lr(sched)
    assert reads


@pytest.mark.gpu
def test_gpu_nonfinite_stop_with_the_next_step_queued(tmp_path):
    """The real capture: a NaN at step k is read after step k + 1 was queued, and the halt flag
    skipped that update too (AdamW's step count stays at k - 1 for every parameter)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen: list[str] = []
    launch, read = GraphedStep.launch, GraphedStep.read
    holder: dict[str, int] = {}

    def spy_launch(self, batches, n_items):
        seen.append("L")
        if seen.count("L") != holder["k"]:
            return launch(self, batches, n_items)
        scale.fill_(float("nan"))
        out = launch(self, batches, n_items)
        scale.fill_(1.0)
        return out

    def spy_read(out):
        seen.append("R")
        return read(out)

    # A replay runs the captured kernels, not Python hooks: the hook multiplies the logits by a
    # device scalar the capture records, and step k's launch sets it to NaN in stream order.
    scale = torch.ones((), device="cuda")

    def nan_at_launch_of_step_k(model):
        model.get_output_embeddings().register_forward_hook(lambda m, a, output: output * scale)

    mp = pytest.MonkeyPatch()
    mp.setattr(GraphedStep, "launch", spy_launch)
    mp.setattr(GraphedStep, "read", staticmethod(spy_read))
    try:
        cfg = _cfg(tmp_path, "nan", cuda_graphs="on", fused_loss="off", precision="bf16")
        trainer = PackedTrainer(cfg, model_hook=nan_at_launch_of_step_k)
        # the NaN goes to a step that replays a shape seen before, and so does its successor (no
        # capture, whose eager warm-up would see the NaN too, and no read-back between them)
        shapes = [trainer.batcher(slot).tensor_tokens for slot in list(trainer.sampler)[:8]]
        k = next(
            k for k in range(2, 7) if shapes[k - 1] in shapes[: k - 1] and shapes[k] in shapes[:k]
        )
        holder["k"] = k  # shapes[k - 1]: step k
        with pytest.raises(NonFiniteError, match=rf"step {k}: non-finite loss"):
            trainer.run()
    finally:
        mp.undo()
    reads_before = [i for i, e in enumerate(seen) if e == "R"]
    assert seen[: reads_before[k - 1]].count("L") == k + 1, seen
    opt = trainer.graphed.inner
    for p in trainer.graphed.params:
        assert int(opt.state[p]["step"]) == k - 1
        assert torch.isfinite(p).all()


@pytest.mark.gpu
def test_gpu_read_waits_for_its_own_step_only():
    """A launched step's read-back returns while the work queued after it still runs (the next
    step's replays, here a sleep kernel): with the copy queued behind that work the GPU would
    idle from each read to the next launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = torch.tensor([2.5, 0.75, 0.0], device="cuda")
    result = StepResult(out)
    out.fill_(float("nan"))  # the next step overwrites the device values: the result keeps its own
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles queued after the step
    assert GraphedStep.read(result) == {"loss": 2.5, "grad_norm": 0.75, "skipped": False}
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running


def test_step_result_on_the_cpu_is_a_copy():
    out = torch.tensor([2.5, 0.75, 1.0])
    result = StepResult(out)
    out.zero_()
    assert GraphedStep.read(result) == {"loss": 2.5, "grad_norm": 0.75, "skipped": True}
