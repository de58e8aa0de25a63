"""Guard: every place in the installed transformers' decoder models that branches on the attention
implementation's *name* containing "flash" is known and accounted for.

varlen_packed follows the FlashAttention contract (a padding mask or document offsets, no dense
mask) under a name without "flash" (``register`` refuses one). Model code that switches on
``is_flash_attention_requested`` / ``"flash" in ...attn_implementation`` therefore takes its
non-flash branch for us; each such place must be harmless, handled, or refused. A new transformers
release that adds one fails here, naming the model and function, so it gets looked at.
"""

from __future__ import annotations

import ast
import pathlib

import transformers

# (model directory, enclosing Class.function) -> why it is fine for varlen_packed
KNOWN = {
    ("gemma4", "Gemma4TextModel._maybe_slice_kv_shared_inputs"): (
        "slices each mask as 4-D: our mask function hands the padding mask on as (B, 1, 1, K) "
        "(tests/models/test_gemma4.py)"
    ),
    ("gemma4_unified", "Gemma4UnifiedTextModel._maybe_slice_kv_shared_inputs"): "as gemma4",
    ("falcon", "FalconModel.forward"): (
        "refuses ALiBi under flash; varlen_packed refuses config.alibi=True the same way"
    ),
    ("gpt_bigcode", "GPTBigCodeModel.forward"): "encoder (cross-attention) mask only",
    ("gpt_neo", "GPTNeoAttention.__init__"): "picks a legacy attention class: refused by flag",
    ("hrm_text", "HrmTextPreTrainedModel._check_and_adjust_attn_implementation"): (
        "refuses prefix_lm under flash; varlen_packed refuses config.prefix_lm=True the same way"
    ),
    ("cohere_compass", "CohereCompassVisionAttention.forward"): "vision encoder",
    ("dots3_note", "Dots3NoteVisionAttention.forward"): "vision encoder",
    ("inkling2", "Inkling2VisionAttention.forward"): "vision encoder",
    ("kosmos2_5", "Kosmos2_5VisionEncoder._prepare_attention_mask"): "vision encoder",
    ("minimax_m3_vl", "MiniMaxM3VLVisionAttention.forward"): "vision encoder",
    ("qwen3_5", "Qwen3_5VisionAttention.forward"): "vision encoder",
    ("qwen3_5_moe", "Qwen3_5MoeVisionAttention.forward"): "vision encoder",
    ("qwen4_exp", "Qwen4ExpVisionAttention.forward"): "vision encoder",
}


def _checks_flash_name(node: ast.AST) -> bool:
    """``is_flash_attention_requested(...)``, ``x.startswith("flash...")`` or a comparison
    (``in``, ``==``) with a string constant containing "flash"."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name == "is_flash_attention_requested":
            return True
        if name == "startswith":
            return any(
                isinstance(a, ast.Constant) and isinstance(a.value, str) and "flash" in a.value
                for a in node.args
            )
    if isinstance(node, ast.Compare):
        return any(
            isinstance(c, ast.Constant) and isinstance(c.value, str) and "flash" in c.value
            for c in (node.left, *node.comparators)
        )
    return False


def _places(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def walk(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, (*scope, child.name))
                continue
            if _checks_flash_name(child):
                found.add(".".join(scope) or "<module>")
            walk(child, scope)

    walk(tree, ())
    return found


def _flash_name_checks() -> set[tuple[str, str]]:
    """Every (model, Class.function) of a decoder family (a *ForCausalLM class) that checks it."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    out = set()
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text(encoding="utf-8")
        if "ForCausalLM(" not in source:
            continue
        out |= {(path.parent.name, place) for place in _places(ast.parse(source))}
    return out


def test_scanner_finds_a_flash_name_check():
    tree = ast.parse(
        "class M:\n def f(self):\n  if 'flash' in self.config._attn_implementation: pass\n"
    )
    assert _places(tree) == {"M.f"}
    assert _places(ast.parse("def g(c):\n return c._attn_implementation == 'sdpa'\n")) == set()


def test_every_flash_name_check_in_decoder_models_is_known():
    new = sorted(_flash_name_checks() - set(KNOWN))
    assert not new, (
        f"transformers {transformers.__version__} branches on the attention implementation name "
        f"containing 'flash' in new places, where varlen_packed takes the non-flash branch: {new}. "
        "Check what each does with varlen_packed's (B, 1, 1, K) padding mask or document offsets, "
        "handle or refuse it, and add it to KNOWN with the reason"
    )
