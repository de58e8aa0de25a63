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
