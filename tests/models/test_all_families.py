"""Every decoder family of the installed transformers under varlen_packed: exact or refused.

transformers' padding-free checks (test_flash_attention_2_padding_matches_padding_free_with_position_ids
and the inference-equivalence test), restated in tests/model_families.py for varlen_packed over
every ``*ForCausalLM`` family, tiny shrunk configs, CPU, fp32, against eager each document alone.
A family passes, or hf_varlen refuses it with a reason (the status follows the code: nothing here
lists which families pass). docs/models.md is generated from the same outcomes
(scripts/models_table.py) and must match them.

The whole sweep (~185 families) is ``slow``; a handful of families covering each kind of outcome
runs in the default selection, and so does the check that the page lists exactly the installed
release's families.
"""

from __future__ import annotations

import pathlib

import model_families as mf
import pytest
import torch

from hf_varlen.integrations import transformers as hf_transformers
from hf_varlen.testing import numerics_error

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
# one family per kind of outcome: plain, KV-shared Gemma 4, hybrid with installed linear
# attention, a stale class flag, a refused legacy class, RoBERTa-style positions, a refused
# stateful mixer
FAST = ["llama", "gemma4_text", "qwen3_5_text", "stablelm", "bloom", "camembert", "minimax"]
FAMILIES = mf.families()


def _page_rows() -> dict[str, tuple[str, str]]:
    return mf.parse(PAGE.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_family_is_exact_or_refused(family):
    o = mf.outcome(family)
    assert o.status != "fails", f"{family}: varlen_packed is wrong or dies: {o.reason}"
    if o.status == "refused":
        assert "model_type='" in o.reason or "transformers refuses" in o.reason, o.reason
    row = _page_rows().get(family)
    assert row == (mf._STATUS_WORDS[o.status], mf._cell(o.reason)), (
        f"docs/models.md row for {family} is {row}, the code gives {o.status}: {o.reason}; "
        "regenerate it with scripts/models_table.py"
    )


def test_page_lists_the_installed_families():
    listed = set(_page_rows())
    assert listed == set(FAMILIES), (
        f"docs/models.md lists families the installed transformers lacks: "
        f"{sorted(listed - set(FAMILIES))}; and lacks: {sorted(set(FAMILIES) - listed)}. "
        "Regenerate it with scripts/models_table.py"
    )


@pytest.mark.slow
def test_page_matches_every_outcome():
    text = mf.render([mf.outcome(f) for f in FAMILIES])
    assert PAGE.read_text(encoding="utf-8") == text, "regenerate with scripts/models_table.py"


def test_assistant_refusal_is_needed(monkeypatch):
    """Gemma 4's speculative-decoding assistant is refused at check_model (its forward takes
    shared_kv_states) and at its first forward (a bidirectional mask over the target's keys); run
    anyway, varlen_packed is not its eager self (its masks over the target's KV states are 4-D,
    the sliding one flipped), so the refusal must stay until that changes."""
    cfg = mf.tiny_config("gemma4_assistant")
    text = cfg.get_text_config()
    g = torch.Generator().manual_seed(0)
    kv = {
        kind: (torch.randn(2, text.num_key_value_heads, n, text.head_dim, generator=g),) * 2
        for kind, n in (("full_attention", 9), ("sliding_attention", 4))
    }
    embeds = torch.randn(2, 2, 2 * cfg.backbone_hidden_size, generator=g)
    mask = torch.tensor([[1] * 9, [0] * 3 + [1] * 6])

    def logits(attn, dtype):
        model = mf._build(cfg, attn, dtype)
        states = {kind: (k.to(dtype), v.to(dtype)) for kind, (k, v) in kv.items()}
        with torch.no_grad():
            out = model(
                inputs_embeds=embeds.to(dtype),
                shared_kv_states=states,
                attention_mask=mask,
                position_ids=torch.full((2, 2), 9),
            )
        return out.logits

    with pytest.raises(ValueError, match="bidirectional mask from 2 queries over 9 keys"):
        logits(mf.ATTN, torch.float32)
    with pytest.raises(ValueError, match="speculative-decoding assistant"):
        hf_transformers.check_model(mf._build(cfg, mf.ATTN, torch.float32))
    hi, lo = logits("eager", torch.float64), logits("eager", torch.float32)
    monkeypatch.setattr(hf_transformers, "_check_bidirectional_cross", lambda *a: None)
    ok, _ = numerics_error(logits(mf.ATTN, torch.float32), hi, lo)
    assert not ok, "varlen_packed now matches eager for the Gemma 4 assistant: lift its refusal"
