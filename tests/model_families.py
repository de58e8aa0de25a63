"""Every decoder family of the installed transformers under varlen_packed: run or refused.

For each model type whose causal-LM auto class is a ``*ForCausalLM``, a tiny random config is made
by shrinking the family's default config (two to four layers keeping one of each layer type,
hidden 64, 4 heads, vocabulary 99, few experts; sub-configs alike; ``FIXES`` per family where the
default config cannot build a model) and the padding-free checks of
transformers' FlashAttention tests are restated for ``varlen_packed`` (CPU, fp32), against eager
``each document alone`` references in fp64 and fp32 under the numerics rule:

- padding-free with position_ids: the documents packed in one row, positions restarting;
- padding-free with the collator's kwargs (cu_seq_lens_q/k, max_length_q/k);
- inference equivalence: a left-padded and a right-padded batch (real tokens compared);
- generation: greedy ``generate`` on the left-padded batch gives eager's tokens.

Outcome per family (``Outcome.status``):
- ``supported``: every check holds;
- ``refused``: hf_varlen raised its ValueError naming the model (the reason is kept);
- ``fails``: a check does not hold, or the forward dies elsewhere (a bug: the test fails);
- ``untested``: the tiny config or the eager reference itself cannot be built or run on CPU
  (the harness's limit, not a verdict on hf_varlen; the reason is kept).

``scripts/models_table.py`` writes docs/models.md from these outcomes;
tests/models/test_all_families.py checks each family and that the page matches.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import logging
import pathlib
import warnings

import torch
from tiny_packed import padded

import hf_varlen
from hf_varlen.integrations.transformers import check_model
from hf_varlen.testing import numerics_error

ATTN = hf_varlen.ATTN_IMPLEMENTATION
VOCAB = 99
LENGTHS = [5, 7, 3]

# default-config key -> tiny value, set wherever the key exists (top level and sub-configs)
SHRINK = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "intermediate_size": 96,
    "ffn_dim": 96,
    "n_inner": 96,
    "ffn_hidden_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "global_head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "lru_width": 64,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "sliding_window": 4,
    "attention_window_size": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_kv_shared_layers": 0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}
# Per-family settings on top of the shrunk dict ("a.b" reaches into the sub-config "a"; DROP
# removes a key so the config derives it again): where a family's default config does not build a
# model at all (fields left None, or checks the shrink breaks), the values its own transformers test
# config uses, or the smallest that pass its config's checks.
DROP = object()
FIXES = {
    # 5.25's default rope_parameters is {} while every layer looks up its layer type's entry
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # the attention reads attn_config.rope_theta, which 5.25 moved to the top-level rope_parameters
    # (and its clamp needs a clip_qkv, as in its transformers test config)
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    # to_dict() writes each layer as an (attention, mlp) pair, hence the doubled counts: one input,
    # one looped and one output layer, the full-attention layer last
    "dory": {
        "layer_types": ["sliding_attention", "mlp"] * 2 + ["full_attention", "mlp"],
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
    },
    # sliding layers take their MLA shapes from swa_* aliases (released-checkpoint sizes otherwise)
    "dots3_note.text_config": {
        "per_layer_config": DROP,
        "head_dim": 16,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_qk_rope_head_dim": 8,
        "swa_v_head_dim": 16,
    },
    # the indexer/KV-source layout names layers of the 50-layer default: derive it again
    # (and its indexer heads are at most the query heads of one key head)
    "kolibri1_1": {
        "index_layers": DROP,
        "kv_source_layers": DROP,
        "mlp_only_layers": DROP,
        "index_num_heads": 2,
    },
    # 5.25's default leaves layer_types None while every layer reads it: one conv, one attention
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # the QSA indexer's fields default to None while its layers need them
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # the shared transformer block is tied across hybrid layers: keep two of them
    "zamba": {
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "num_hidden_layers": 4,
        # widths derived from hidden_size again (the defaults' are stored absolute)
        "attention_hidden_size": DROP,
        "attention_head_dim": DROP,
        "mamba_dt_rank": "auto",
        "use_mamba_kernels": False,
    },
    # an encoder with per-language adapters: its forward needs a language (its test sets one)
    "xmod": {"default_language": "en_XX"},
}
FIXES["dots3_note_text"] = FIXES["dots3_note.text_config"]
# the vision and audio towers' adapters map their own (shrunk) width to the text width
_ADAPTER = {"adapter_out_dim": SHRINK["hidden_size"]}
FIXES["dots3_note.vision_config"] = {"adapter_in_dim": SHRINK["hidden_size"], **_ADAPTER}
FIXES["dots3_note.audio_config"] = {"adapter_input_size": SHRINK["hidden_size"], **_ADAPTER}
FIXES["qwen4_exp.text_config"] = FIXES["qwen4_exp_text"]
# Keyword arguments for the default config itself, where it fails its own checks
CONFIG_KWARGS = {
    # the assistant reads the target's KV states and has no per-layer inputs of its own
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}
# Families whose *ForCausalLM is the decoder of a composite model: it is built from that sub-config
# (model_type "<family>_<sub-config>"), one codebook so that input_ids are (batch, time) as for text
DECODER_OF = {"musicgen": "decoder", "musicgen_melody": "decoder"}
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
# no dropout anywhere: train-mode randomness is not what is compared
DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop")


@dataclasses.dataclass
class Outcome:
    family: str
    status: str  # supported | refused | fails | untested
    reason: str = ""


def families() -> list[str]:
    """Model types whose causal-LM auto class is a *ForCausalLM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(
        k for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if v.endswith("ForCausalLM")
    )


def _first_of_each(types: list) -> list[int]:
    """Indices keeping the first layer of each distinct type, and at least two layers."""
    seen, keep = set(), []
    for i, t in enumerate(types):
        key = repr(t)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    if len(keep) < 2 and len(types) >= 2:
        keep = sorted({*keep, 1 if keep[0] == 0 else 0})
    return keep


def _shrink(d: dict) -> dict:
    """The default config dict ``d`` made tiny (recursing into sub-config dicts)."""
    default, d = d, dict(d)
    for k, v in list(d.items()):
        if isinstance(v, dict) and ("model_type" in v or any(x in v for x in LAYER_KEYS)):
            d[k] = _shrink(v)
    n_layers = next((d[k] for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    keep = list(range(min(2, n_layers))) if n_layers else None
    for key in ("layer_types", "layers_block_type"):  # keep one layer of each kind
        if n_layers and isinstance(d.get(key), list) and len(d[key]) == n_layers:
            keep = _first_of_each(d[key])
            break
    cycle = d.get("block_types")  # a repeating pattern (recurrent_gemma): one full cycle
    if n_layers and isinstance(cycle, list) and 1 < len(cycle) < n_layers:
        keep = list(range(len(cycle)))
    if keep is not None:
        for k, v in list(d.items()):
            if isinstance(v, list) and len(v) == n_layers and n_layers > 1:
                d[k] = [SHRINK[k] if k in SHRINK else v[i] for i in keep]
        for k in LAYER_KEYS:
            if isinstance(d.get(k), int):
                d[k] = len(keep)
    if isinstance(d.get("attn_layer_period"), int) and isinstance(d.get("attn_layer_offset"), int):
        d["attn_layer_period"], d["attn_layer_offset"] = 2, 1  # jamba: keep an attention layer
    if isinstance(d.get("per_layer_config"), dict):  # per-layer overrides of layers now gone
        d["per_layer_config"] = {}
    for k, v in SHRINK.items():
        if d.get(k) == 0 and k not in ("pad_token_id", "bos_token_id", "eos_token_id"):
            continue  # 0 switches a feature off (e.g. per-layer inputs): keep it off
        if (
            k in d
            and (d[k] is None or isinstance(d[k], (int, float)))
            and k != "sliding_window"
            or k == "sliding_window"
            and isinstance(d.get(k), int)
        ):
            d[k] = v
    for k in ("num_experts_per_tok", "moe_topk"):  # never more experts per token than by default
        if isinstance(d.get(k), int) and k in default:
            d[k] = min(d[k], default[k]) if isinstance(default[k], int) else d[k]
    hidden = d.get("hidden_size")
    if isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_expand"), int):
        # Mamba heads x head size == the inner width (mamba_d_ssm where set, else expand x hidden)
        inner = d.get("mamba_d_ssm") or d["mamba_expand"] * hidden
        d["mamba_n_heads"], d["mamba_d_head"] = 4, inner // 4
    mamba2 = ("expand", "num_heads", "head_dim")  # heads x head size == expand x hidden
    if "n_groups" in d and all(isinstance(d.get(k), int) for k in mamba2):
        d["head_dim"] = d["expand"] * hidden // d["num_heads"]
        d["n_groups"] = 1
    if "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: head_dim is the rotary part
        d["head_dim"] = SHRINK["qk_rope_head_dim"]
    if "qk_rope_head_dim" in d:  # MLA: one key per query head; the stored query width derived
        if isinstance(d.get("num_key_value_heads"), int):
            d["num_key_value_heads"] = d.get("num_attention_heads", SHRINK["num_attention_heads"])
        if isinstance(d.get("qk_head_dim"), int):
            d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if isinstance(d.get("rotary_dim"), int):
        d["rotary_dim"] = 8
    if "is_decoder" in d:  # encoder families' *ForCausalLM run causal only as decoders
        d["is_decoder"] = True
    for k in DROPOUT_KEYS:
        if isinstance(d.get(k), float):
            d[k] = 0.0
    for k in ("transformers_version", "architectures", "_name_or_path", "auto_map", "dtype"):
        d.pop(k, None)
    return d


def _fix(family: str, d: dict) -> dict:
    """``d`` with FIXES[family] (and FIXES[family.sub]) applied."""
    for name, fixes in FIXES.items():
        if name.split(".")[0] != family:
            continue
        target = d
        for part in name.split(".")[1:]:
            target = target[part]
        for key, value in fixes.items():
            *path, last = key.split(".")
            where = target
            for part in path:
                where = where[part]
            if value is DROP:
                where.pop(last, None)
            else:
                where[last] = copy.deepcopy(value)
    return d


def tiny_config(family: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(family, **CONFIG_KWARGS.get(family, {}))
    if family in DECODER_OF:
        default = getattr(default, DECODER_OF[family])
        default.num_codebooks = 1
    cfg = type(default).from_dict(_fix(family, _shrink(default.to_dict())))
    cfg.use_cache = False
    return cfg


def _build(cfg, attn: str, dtype=torch.float32):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = copy.deepcopy(cfg)
    # the eager experts loop runs in fp64 too (grouped_mm does not): the fp64 reference
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    owner = next((f for f, sub in DECODER_OF.items() if cfg.model_type == f"{f}_{sub}"), None)
    if owner is not None:  # the auto class maps only the composite config to this class
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[owner])
        model = cls._from_config(cfg, attn_implementation=attn)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    if attn == ATTN:  # hybrid models: linear-attention layers restart at document boundaries
        hf_varlen.install_linear_attention(model)
    return model.eval().to(dtype)


def _docs(cfg) -> list[torch.Tensor]:
    vocab = getattr(cfg.get_text_config(), "vocab_size", VOCAB) or VOCAB
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, min(vocab, VOCAB), (n,), generator=g) for n in LENGTHS]


def _check(name, got, hi, lo) -> str | None:
    ok, msg = numerics_error(got, hi, lo)
    return None if ok else f"{name}: {msg}"


_PACKAGE = str(pathlib.Path(hf_varlen.__file__).parent)


def _refusal(exc: BaseException) -> str | None:
    """hf_varlen's own refusal (a ValueError raised in hf_varlen's code; its first line), or
    transformers refusing the name at load; None for any other error."""
    msg = str(exc)
    if isinstance(exc, KeyError) and ATTN in msg:
        return f"transformers refuses the name at load (its own attention-class table): {msg}"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if (
        isinstance(exc, ValueError)
        and tb is not None
        and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)
    ):
        return msg.splitlines()[0]
    return None


def _run_checks(cfg, model, docs, hi, lo, notes: list[str]) -> str | None:
    """None when all hold, else what failed first; ``notes`` collects partial refusals."""
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    hi_all, lo_all = torch.cat(hi), torch.cat(lo)
    got = model(**batch, use_cache=False).logits[0]
    bad = _check("packed by the collator", got, hi_all, lo_all)
    if bad:
        return bad
    try:
        got = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]
    except ValueError as exc:
        # loud and pointing at the collator's offsets (checked above): a refusal of this style
        # of packing only, kept as a note
        if "cu_seq_lens_q/k" not in str(exc) or _refusal(exc) is None:
            raise
        notes.append("packing by position_ids alone refused: needs cu_seq_lens_q/k")
    else:
        bad = _check("packed by position_ids", got, hi_all, lo_all)
        if bad:
            return bad
    for side in ("left", "right"):
        ids, mask, spans = padded(docs, side)
        # positions count real tokens, as generate() makes them (each row then equals its
        # document alone for absolute as well as relative position encodings)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for i, span in enumerate(spans):
            bad = _check(f"{side}-padded row {i}", logits[i, span], hi[i], lo[i])
            if bad:
                return bad
    return None


def _generation(cfg, eager, model, docs) -> str | None:
    ids, mask, _ = padded(docs, "left")
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    kw["use_cache"] = True
    want = eager.generate(ids, **kw)
    got = model.generate(ids, **kw)
    if not torch.equal(got, want):
        return f"greedy generation differs from eager: {got[:, -3:].tolist()} vs {want[:, -3:].tolist()}"
    return None


@contextlib.contextmanager
def _quiet():
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.getLogger("transformers").setLevel(level)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200].rstrip()


@functools.cache
def outcome(family: str) -> Outcome:
    """Run the checks for ``family`` once per process."""
    with _quiet(), torch.no_grad():
        try:
            cfg = tiny_config(family)
            docs = _docs(cfg)
        except Exception as exc:  # the harness cannot make this family's tiny config
            return Outcome(family, "untested", f"tiny config: {_one_line(exc)}")
        try:  # refusals come first (class flags, then the first forward): no reference needed
            model = _build(cfg, ATTN)
            check_model(model)
            model(input_ids=docs[0][None], use_cache=False)
        except Exception as exc:
            reason = _refusal(exc)
            if reason is not None:
                return Outcome(family, "refused", reason)
            # fall through: the eager reference tells a harness limit from a failure of ours
        try:
            refs = []
            for dtype in (torch.float64, torch.float32):
                ref = _build(cfg, "eager", dtype)
                refs.append([ref(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        except Exception as exc:  # the harness cannot make this family run on CPU at all
            return Outcome(family, "untested", f"tiny eager model: {_one_line(exc)}")
        try:
            notes: list[str] = []
            bad = _run_checks(cfg, model, docs, *refs, notes)
            if bad is None:
                bad = _generation(cfg, ref, model, docs)
        except Exception as exc:
            reason = _refusal(exc)
            if reason is not None:
                return Outcome(family, "refused", reason)
            return Outcome(family, "fails", _one_line(exc))
    if bad is not None:
        return Outcome(family, "fails", bad[:300])
    return Outcome(family, "supported", "; ".join(notes))


# ---- the supported-models page (docs/models.md), written by scripts/models_table.py ----

_STATUS_WORDS = {
    "supported": "supported",
    "refused": "refused",
    "untested": "not tested here",
    "fails": "FAILS",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(outcomes: list[Outcome]) -> str:
    """docs/models.md for these outcomes (one row per family, sorted by family)."""
    import transformers

    counts = {s: sum(o.status == s for o in outcomes) for s in _STATUS_WORDS}
    lines = [
        "# Supported models",
        "",
        "<!-- generated by scripts/models_table.py from tests/model_families.py; do not edit -->",
        "",
        f"Every decoder family (`*ForCausalLM`) of transformers {transformers.__version__}, run "
        "by tests/models/test_all_families.py: a tiny random config shrunk from the family's "
        'default config, CPU, fp32, `attn_implementation="varlen_packed"` against eager with each '
        "document run alone (numerics rule): a packed batch (collator offsets, and position_ids "
        "alone), a left- and a right-padded batch, and greedy generation on the left-padded "
        "batch. Hybrid models get `hf_varlen.install_linear_attention(model)` first.",
        "",
        "- **supported**: every check holds (a note says what is refused within it);",
        "- **refused**: hf_varlen raises, naming the model and why (the reason below);",
        "- **not tested here**: the shrunk config or the eager reference cannot be built or run "
        "on CPU (a limit of the test's config shrinking, not a verdict).",
        "",
        f"Totals: {counts['supported']} supported, {counts['refused']} refused, "
        f"{counts['untested']} not tested here"
        + (f", {counts['fails']} FAILING" if counts["fails"] else "")
        + f" (of {len(outcomes)}).",
        "",
        "| family | status | reason / note |",
        "|---|---|---|",
    ]
    for o in sorted(outcomes, key=lambda o: o.family):
        lines.append(f"| `{o.family}` | {_STATUS_WORDS[o.status]} | {_cell(o.reason)} |")
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, tuple[str, str]]:
    """family -> (status word, reason) from a rendered page."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            family, status, reason = (c.strip() for c in line[1:-1].split(" | ", 2))
            rows[family.strip("`")] = (status, reason)
    return rows
