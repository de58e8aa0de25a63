"""torch.compile where users turn it on (issue 13, item 6): ``hf-varlen train --compile``, HF
``Trainer(torch_compile=True)`` with ``PackingCollator``, TRL ``SFTTrainer(padding_free=True,
torch_compile=True)``; tiny Llama with ``attn_implementation="varlen_packed"`` on CPU.

The compile backend is ``aot_eager`` (``--compile-backend`` / ``torch_compile_backend``): it traces
forward and backward as Inductor would get them, without generating code. Each run: per-step losses
equal the eager run's under the numerics rule (ref_lo: eager fp32; ref_hi: eager fp64), no graph
break (``torch._dynamo.utils.counters["graph_break"]`` empty), and for ``hf-varlen train`` one
compilation over the run (its batches are marked dynamic and its changing ints traced symbolic; the
HF / TRL trainers do not mark them and rely on automatic dynamic shapes, so their count is
reported, not bounded).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

# transformers before hf_varlen: `import hf_varlen` then `import trl` leaves varlen_packed
# unregistered (trl's find_spec('transformers') consumes hf_varlen's one-shot import hook; reported)
import transformers  # noqa: F401
from tiny_packed import tiny_model
from tiny_runs import HF_CPU_STEPS, tiny_train_config
from torch._dynamo.utils import counters

import hf_varlen  # noqa: F401  (registers varlen_packed with transformers)
from hf_varlen.testing import assert_numerics
from hf_varlen.training import PackedTrainer, TrainConfig
from hf_varlen.training.compiling import CompileError, token_count_patches
from hf_varlen.training.config import parse_args


def _tiny(tmp_path, name, **overrides) -> TrainConfig:
    return tiny_train_config(tmp_path, name, **{"max_steps": 6, **overrides})


def _fresh():
    from torch._dynamo.utils import clear_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()


def _recompile_reasons() -> list[str]:
    from torch._dynamo.utils import get_compilation_metrics

    return [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]


def _losses(cfg, hook=None):
    summary = PackedTrainer(cfg, model_hook=hook).run()
    from hf_varlen.training.metrics import read_log

    records = [r for r in read_log(cfg.output_dir) if "loss" in r]
    return torch.tensor([r["loss"] for r in records], dtype=torch.float64), summary, records


def _double(model):
    model.double()


@pytest.mark.parametrize("case", ["packed", "padded", "checkpointed", "lora"])
def test_train_compile_equals_eager_without_recompiles(tmp_path, case):
    """6 steps of packs with changing token and document counts (padded: changing [B, L];
    checkpointed: --gradient-checkpointing, whose layers transformers >= 5.25 wraps in kernels'
    context variable: ``metadata.checkpointed_side_effects``; lora: --lora, peft adapters on every
    linear layer under the fused loss, trained alone)."""
    padded = case == "padded"
    kw = dict(padded=padded, gradient_checkpointing=case == "checkpointed")
    if case == "lora":
        pytest.importorskip("peft")
        kw.update(lora=True, lora_r=4)
    lo, _, _ = _losses(_tiny(tmp_path, "lo", **kw))
    # fp64 reference: transformers' cross-entropy (the fused loss takes fp16/bf16/fp32)
    hi, _, _ = _losses(_tiny(tmp_path, "hi", fused_loss="off", **kw), hook=_double)
    _fresh()
    cfg = _tiny(tmp_path, "x", compile=True, compile_backend="aot_eager", **kw)
    x, summary, records = _losses(cfg)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert len({r["tensor_tokens"] for r in records}) >= 2  # the batches really change shape
    info = summary["compile"]
    # one graph: packs marked dynamic, max_length / num_items_in_batch ints symbolic from the start
    assert info["compilations"] == 1, (info, _recompile_reasons())
    assert info["compiled_steps"][0] == 1 and info["backend"] == "aot_eager", info
    assert info["first_step_s"] > info["later_step_s"] > 0, info
    assert "compilation(s)" in info["text"]
    assert_numerics(f"--compile losses ({case})", x.float(), hi, lo)


def test_train_compile_flags_and_refusals(tmp_path):
    cfg = parse_args(["--compile", "--compile-backend", "aot_eager"])
    assert cfg.compile is True and cfg.compile_backend == "aot_eager"
    assert parse_args([]).compile is False
    with pytest.raises(ValueError, match="--compile-backend 'aot_eager' applies only with"):
        PackedTrainer(_tiny(tmp_path, "a", compile_backend="aot_eager"))
    with pytest.raises(ValueError, match="--compile-backend 'no_such_backend': not a torch"):
        PackedTrainer(_tiny(tmp_path, "b", compile=True, compile_backend="no_such_backend"))


def test_train_compile_mode_flags_and_refusals(tmp_path):
    cfg = parse_args(["--compile", "--compile-mode", "reduce-overhead"])
    assert cfg.compile_mode == "reduce-overhead" and parse_args([]).compile_mode == "default"
    with pytest.raises(ValueError, match="--compile-mode 'reduce-overhead' applies only with"):
        PackedTrainer(_tiny(tmp_path, "a", compile_mode="reduce-overhead"))
    with pytest.raises(ValueError, match="--compile-mode 'fastest': expected one of"):
        PackedTrainer(_tiny(tmp_path, "b", compile=True, compile_mode="fastest"))
    with pytest.raises(ValueError, match="is an Inductor mode, but --compile-backend"):
        PackedTrainer(
            _tiny(
                tmp_path,
                "c",
                compile=True,
                compile_mode="max-autotune",
                compile_backend="aot_eager",
            )
        )


def _spy_compile_fx(monkeypatch) -> list[dict]:
    """The config patches of every compile_fx call (ours, and compile_fx's calls to itself)."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    return seen


def test_train_compile_mode_reaches_inductor(tmp_path, monkeypatch):
    """--compile-mode hands Inductor the mode's config patches, as torch.compile(mode=...) does
    (on CPU Inductor skips CUDA graphs itself), and every micro-step is a new cudagraph step."""
    seen, steps = _spy_compile_fx(monkeypatch), []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    _fresh()
    cfg = _tiny(tmp_path, "ro", compile=True, compile_mode="reduce-overhead", max_steps=3)
    _, summary, _ = _losses(cfg)
    # our backend's calls carry the patches (compile_fx calls itself again inside, without them)
    ours = [p for p in seen if p]
    want = {"triton.cudagraphs": True, **token_count_patches()}
    assert ours == [want] * summary["compile"]["compilations"], seen
    assert len(steps) >= 3  # one per micro-step (and per eval call)
    assert summary["compile"]["mode"] == "reduce-overhead"
    assert "mode reduce-overhead" in summary["compile"]["text"]


def test_train_compile_keeps_inductor_off_the_token_count(tmp_path, monkeypatch):
    """The default mode too hands Inductor the patches that stop its own size heuristics from
    guarding on a pack's token count (a recompile whenever packs straddle one of their sizes)."""
    patches = token_count_patches()
    if not patches:
        pytest.skip(f"torch {torch.__version__}'s Inductor has no such heuristic to turn off")
    seen = _spy_compile_fx(monkeypatch)
    _fresh()
    _, summary, _ = _losses(_tiny(tmp_path, "tc", compile=True, max_steps=2))
    assert [p for p in seen if p] == [patches] * summary["compile"]["compilations"], seen


def test_train_compile_failure_raises_with_the_reason(tmp_path):
    """A compile that fails is an error naming the reason, never a silent eager run."""
    from torch._dynamo import register_backend

    @register_backend(name="hf_varlen_test_failing")
    def failing(gm, example_inputs):
        raise RuntimeError("this backend refuses every graph")

    _fresh()
    cfg = _tiny(tmp_path, "f", compile=True, compile_backend="hf_varlen_test_failing", max_steps=2)
    trainer = PackedTrainer(cfg)
    with pytest.raises(CompileError, match="this backend refuses every graph") as info:
        trainer.run()
    assert "--compile-backend aot_eager" in str(info.value)


# ---- HF Trainer and TRL SFTTrainer with torch_compile=True ----------------------------------------

VOCAB = 97


def _llama(dtype):
    return tiny_model("llama", vocab_size=VOCAB).to(dtype)


def _rows(n=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=g).tolist()} for k in lengths]


class _Recorder:
    """Per-step training losses, unrounded (Trainer logs them rounded to 4 digits)."""

    @staticmethod
    def wrap(trainer_cls):
        class Recording(trainer_cls):
            def compute_loss(self, model, inputs, *args, **kwargs):
                out = super().compute_loss(model, inputs, *args, **kwargs)
                loss = out[0] if isinstance(out, tuple) else out
                self.recorded.append(loss.detach().double().item())
                return out

        Recording.recorded = None
        return Recording


def _compile_args(compile_):
    return (
        dict(torch_compile=True, torch_compile_backend="aot_eager")
        if compile_
        else dict(torch_compile=False)
    )


def _hf_losses(tmp_path, dtype, compile_, steps=4):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / f"hf-{dtype}-{compile_}"),
        max_steps=steps,
        **HF_CPU_STEPS,
        **_compile_args(compile_),
    )
    cls = _Recorder.wrap(Trainer)
    trainer = cls(
        model=_llama(dtype),
        args=args,
        train_dataset=_rows(),
        data_collator=hf_varlen.PackingCollator(),
    )
    trainer.recorded = []
    trainer.train()
    return torch.tensor(trainer.recorded, dtype=torch.float64), trainer


def _graphs():
    return counters["stats"]["unique_graphs"]


def test_hf_trainer_torch_compile_packing_collator(tmp_path):
    lo, _ = _hf_losses(tmp_path, torch.float32, False)
    hi, _ = _hf_losses(tmp_path, torch.float64, False)
    _fresh()
    x, trainer = _hf_losses(tmp_path, torch.float32, True)
    assert trainer.args.torch_compile and _graphs() >= 1, "Trainer did not compile the model"
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert len(x) == len(lo) == len(hi) == 4
    assert_numerics("Trainer(torch_compile=True) + PackingCollator losses", x, hi, lo)


def _trl_losses(tmp_path, dtype, compile_, steps=4, fused=False):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    from hf_varlen.training.builtin import byte_tokenizer

    args = SFTConfig(
        output_dir=str(tmp_path / f"trl-{dtype}-{compile_}-{fused}"),
        bf16=False,
        padding_free=True,
        max_length=None,
        max_steps=steps,
        **HF_CPU_STEPS,
        **_compile_args(compile_),
    )
    if fused:
        from hf_varlen.integrations.trainers import VarlenSFTTrainer as SFTTrainer
    cls = _Recorder.wrap(SFTTrainer)
    trainer = cls(
        model=_llama(dtype),
        args=args,
        train_dataset=datasets.Dataset.from_list(_rows()),
        processing_class=byte_tokenizer(),
    )
    if fused:  # the eager step this test records (auto, the default, captures on CUDA)
        trainer.configure_captured_step("off")
    trainer.recorded = []
    trainer.train()
    return torch.tensor(trainer.recorded, dtype=torch.float64), trainer


# TRL 1.16's SFTTrainer always installs its own fused LM head (trl.models add_fused_lm_head, for the
# entropy / token-accuracy metrics and the loss); its chunked log-prob kernel writes each logits tile
# with ``torch.mm(..., out=tile)`` into a non-contiguous slice of a buffer
# (trl/kernels/chunked_logprob.py), which Dynamo cannot trace (graph break gb0242, "Attempted to
# call op with non-contiguous `out=` tensor"): the model graph breaks there, in TRL's head, not in
# hf_varlen's attention. With hf_varlen's fused loss (VarlenSFTTrainer: the head is unused) the
# whole model compiles with no graph break.
TRL_HEAD_BREAK = "non-contiguous `out=` tensor"


# transformers >= 5.25 with kernels 0.19: every checkpointed layer breaks at kernels'
# ``use_kernelized_func`` context variable (hf_varlen.metadata.checkpointed_side_effects says why).
# VarlenSFTTrainer compiles with the Dynamo patch that allows it; plain SFTTrainer does not.
KERNELS_FUNC_BREAK = "CompileableContextVar"


@pytest.mark.parametrize("fused", [False, True], ids=["SFTTrainer", "VarlenSFTTrainer"])
def test_trl_sft_trainer_padding_free_torch_compile(tmp_path, fused):
    from hf_varlen.backends import registry

    lo, _ = _trl_losses(tmp_path, torch.float32, False, fused=fused)
    hi, _ = _trl_losses(tmp_path, torch.float64, False, fused=False)  # fp64: TRL's own loss
    _fresh()
    # As in a fresh process: the backend probes have not run yet (they once wrote their cache
    # inside TRL's checkpointed layers while compiling: a graph break only a first run saw).
    registry._PROBE_CACHE.clear()
    x, trainer = _trl_losses(tmp_path, torch.float32, True, fused=fused)
    assert trainer.args.torch_compile and _graphs() >= 1, "SFTTrainer did not compile the model"
    breaks = dict(counters["graph_break"])
    if fused:
        assert breaks == {}, breaks
        # batches marked dynamic, ints symbolic (VarlenSFTTrainer.compute_loss): one graph
        assert _graphs() == 1, (_graphs(), _recompile_reasons())
    else:  # only TRL's head breaks (see above), and kernels' where it applies: nothing of ours
        allowed = (TRL_HEAD_BREAK, KERNELS_FUNC_BREAK)
        assert breaks and all(any(a in reason for a in allowed) for reason in breaks), breaks
    assert len(x) == len(lo) == len(hi) == 4
    assert_numerics(f"{type(trainer).__name__}(padding_free, torch_compile) losses", x, hi, lo)


@pytest.mark.gpu
def test_train_compile_inductor_gpu(tmp_path):
    """GPU: ``--compile`` with Inductor (triton attention, kernelize, fused loss), bf16: one
    compilation, no graph break, per-step losses by the rule (ref_hi: eager fp32, ref_lo: eager
    bf16)."""
    kw = dict(precision="bf16")
    lo, _, _ = _losses(_tiny(tmp_path, "lo", **kw))
    hi, _, _ = _losses(_tiny(tmp_path, "hi", precision="fp32"))
    _fresh()
    x, summary, _ = _losses(_tiny(tmp_path, "x", compile=True, **kw))
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert summary["compile"]["compilations"] == 1, (summary["compile"], _recompile_reasons())
    assert summary["compile"]["backend"] == "inductor"
    assert_numerics("--compile inductor bf16 losses", x.float(), hi, lo.float())


def test_checkpointed_side_effects_patch_only_for_kernels_func_wrappers():
    """The Dynamo patch goes to models whose modules carry kernels' ``use_kernelized_func``
    wrapper state (``_kernel_funcs``, transformers >= 5.25), and to no other model."""
    from hf_varlen.metadata import checkpointed_side_effects

    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert checkpointed_side_effects(plain) == {}
    plain[0]._kernel_funcs = {}
    assert checkpointed_side_effects(plain) == {
        "skip_fwd_side_effects_in_bwd_under_checkpoint": True
    }
