"""``hf-varlen train`` accepts exactly the models the library accepts under varlen_packed.

The CLI's model check (``training.model.check_attention``) and the library's ``check_model`` share
one rule, ``integrations.transformers.varlen_refusal``: a tiny model of each kind (a hybrid with
gated DeltaNet layers, stablelm with its stale class flag, a plain llama; refused: lightning
attention, RG-LRU, a legacy attention class, ALiBi, ZAYA's q/k convolution) is accepted by both or refused by both with
the same reason. A tiny hybrid (qwen3_5-shaped: one linear-attention and one full-attention layer)
trains packed through the CLI with its linear-attention layers installed; a refused model is a
one-line usage error (exit 2). CPU, tiny configs.
"""

from __future__ import annotations

import model_families as mf
import pytest
import torch
from test_hybrid_models import SHAPE
from tiny_runs import tiny_train_config
from transformers import AutoConfig, AutoModelForCausalLM

from hf_varlen import cli
from hf_varlen.integrations.linear_attention import is_installed
from hf_varlen.integrations.transformers import check_model, varlen_refusal
from hf_varlen.training import PackedTrainer
from hf_varlen.training.metrics import read_log
from hf_varlen.training.model import check_attention

ATTN = "varlen_packed"
ACCEPTED = ["qwen3_5_text", "qwen3_next", "stablelm", "llama"]
REFUSED = {
    "minimax": "carry a state along the row (linear_attention)",  # lightning attention
    "recurrent_gemma": "carry a state along the row (recurrent)",  # RG-LRU
    "bloom": "does not dispatch attention through transformers' AttentionInterface",
    "falcon": "config.alibi=True",
    "zaya": "(a causal convolution, model.layers.0.self_attn.qkv_proj.conv_qk_depthwise)",
}


def _tiny(family: str, **fields):
    cfg = mf.tiny_config(family)
    for key, value in fields.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN)


@pytest.mark.parametrize("family", ACCEPTED)
def test_cli_accepts_what_the_library_accepts(family):
    model = _tiny(family)
    assert varlen_refusal(model) is None
    check_model(model)
    check_attention(model, ATTN, family)
    hybrid = family.startswith("qwen3")
    assert is_installed(model.config) is hybrid  # the CLI installed the hybrid's layers


@pytest.mark.parametrize("family", list(REFUSED))
def test_cli_refuses_what_the_library_refuses_with_its_reason(family):
    model = _tiny(family, alibi=True) if family == "falcon" else _tiny(family)
    refusal = varlen_refusal(model)
    assert refusal is not None and REFUSED[family] in refusal
    with pytest.raises(ValueError) as library:
        check_model(model)
    with pytest.raises(ValueError) as training:
        check_attention(model, ATTN, family)
    assert str(library.value) == refusal
    assert str(training.value).startswith(f"--model {family!r}: {refusal}. Hint: ")


HYBRID = dict(SHAPE, vocab_size=320)  # the byte tokenizer's 260 tokens


def _saved(tmp_path, family: str, **shape) -> str:
    folder = tmp_path / family
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **shape)).save_pretrained(folder)
    return str(folder)


def test_cli_trains_a_tiny_hybrid_packed(tmp_path):
    folder = _saved(tmp_path, "qwen3_5_text", **HYBRID)
    cfg = tiny_train_config(tmp_path, "run", model=folder, tokenizer="bytes", max_steps=2)
    trainer = PackedTrainer(cfg)
    model = trainer.acc.unwrap_model(trainer.model)
    assert model.config._attn_implementation == ATTN
    assert is_installed(model.config)
    trainer.run()
    losses = torch.tensor([r["loss"] for r in read_log(cfg.output_dir) if "loss" in r])
    assert len(losses) == 2 and bool(torch.isfinite(losses).all())


def test_cli_refused_model_is_exit_2_with_the_reason(tmp_path, capsys):
    shape = dict(mf._shrink(AutoConfig.for_model("recurrent_gemma").to_dict()), vocab_size=320)
    shape.pop("model_type", None)
    folder = _saved(tmp_path, "recurrent_gemma", **shape)
    code = cli.main(
        ["train", "--model", folder, "--tokenizer", "bytes", "--output-dir", str(tmp_path / "o")]
        + ["--builtin-examples", "8", "--max-steps", "1", "--no-progress", "--no-save-final"]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-varlen: error")]
    assert code == 2 and len(lines) == 1, err
    assert "carry a state along the row (recurrent)" in lines[0] and "--padded" in lines[0]


def test_hybrid_steps_eager_under_auto_and_refuses_on(tmp_path):
    """The linear-attention layers read the offsets on the host every batch: ``--cuda-graphs
    auto`` steps eager and says why, ``on`` is refused with that reason (not a failed capture)."""
    from hf_varlen.training.builders import graphs_for_model

    model = _tiny("qwen3_5")
    check_attention(model, ATTN, "qwen3_5")
    cpu = torch.device("cpu")
    auto = tiny_train_config(tmp_path, "auto", cuda_graphs="auto")
    on, note = graphs_for_model(auto, model, cpu, 1, "fp32", 384.0, (True, "auto: captured"))
    assert not on and "linear-attention layer(s)" in note and note.startswith("eager (auto: ")
    forced = tiny_train_config(tmp_path, "on", cuda_graphs="on")
    with pytest.raises(ValueError, match="--cuda-graphs on cannot be honoured: .*linear-attention"):
        graphs_for_model(forced, model, cpu, 1, "fp32", 384.0, (True, "on"))


def test_hybrid_refused_by_the_captured_trainer_step(tmp_path):
    """Trainer's captured step reads the same rule: ``cuda_graphs="on"`` is refused when the
    trainer is built, naming the linear-attention layers (not left to a failing capture)."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from hf_varlen import install_linear_attention
    from hf_varlen.integrations.trainers.captured import CaptureError, VarlenTrainer

    model = _tiny("qwen3_5_text")
    assert install_linear_attention(model, path="loop") > 0
    args = TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to="none")
    with pytest.raises(CaptureError, match=r"cuda_graphs='on' cannot be honoured: .*linear-att"):
        VarlenTrainer(model=model, args=args, cuda_graphs="on")
    trainer = VarlenTrainer(model=model, args=args, cuda_graphs="auto")
    assert any("linear-attention layer(s)" in r for r in trainer._static_blockers())
