"""transformers integration: the "varlen_packed" attention function and its mask function.

transformers calls ``fn(module, query, key, value, attention_mask, dropout, scaling, **kwargs)`` with
query (B, H_q, T_q, D) and key/value (B, H_kv, T_k, D) (GQA not expanded) and expects
((B, T_q, H_q, D), None). RoPE has already been applied by the attention module.

Where documents come from (first match wins; see hf_varlen.metadata):
  1. collator kwargs ``cu_seq_lens_q/k`` + ``max_length_q/k`` (DataCollatorWithFlattening, TRL 1.16,
     hf_varlen.PackingCollator);
  2. a 2-D padding mask (our mask function passes it through only when a row really has padding;
     it goes before position_ids because padding cannot be expressed by positions);
  3. packed ``position_ids`` of a batch of one row whose positions restart (TRL <= 1.15, plain
     models); converted once per forward pass, shared by every layer;
  4. otherwise each row is one causal sequence.

Attention sinks (``s_aux``, gpt-oss / granite_swa) go to ``varlen_attention(sinks=...)``.
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import weakref

import torch

from ..backends.registry import MODEL_BACKEND_ATTR
from ..functional import batch_call, dispatch
from ..metadata import (
    BatchState,
    VarlenMetadata,
    from_collator_kwargs,
    from_padding_mask,
    from_position_ids,
    from_rows,
)
from ..ops.common import tracing
from .linear_attention import is_installed as is_linear_attention_installed
from .linear_attention import is_linear_attention_layer, stateful_layer_kinds

DEFAULT_NAME = "varlen_packed"


def attention_dtype(module: torch.nn.Module, query, key, value) -> torch.dtype:
    """The one dtype q, k and v are cast to, decided as transformers' FlashAttention path does.

    For an fp32 query (fp32 weights under autocast, where RoPE promotes q and k to fp32 while v stays
    in the autocast dtype; or fp32 norms in a half-precision PEFT model): the autocast dtype of the
    query's device if autocast is on, else ``config.dtype`` for a quantized model, else the weight
    dtype of the module's first Linear layer. Otherwise, or when none of these applies: q, k, v's
    own dtype if they share one, else their promoted (common) dtype. Unlike transformers, which
    casts only an fp32 query and leaves any other mix to fail in the kernel, every mix is resolved.
    """
    if query.dtype == torch.float32:
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_is_quantized"):
            dtype = getattr(config, "dtype", None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype
        linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        if linear is not None and linear.weight.dtype.is_floating_point:
            return linear.weight.dtype
    if query.dtype == key.dtype == value.dtype:
        return query.dtype
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


_MASK_CONTRACT = (
    "varlen_packed implements the FlashAttention contract (a 2-D padding mask or document "
    "offsets, a sliding window, a logit softcap)"
)
_UNSUPPORTED: dict[type, str | None] = {}  # config class -> why its model cannot run (None: it can)


def _model_name(config) -> str:
    return f"model_type={getattr(config, 'model_type', None)!r} ({type(config).__name__})"


def _dispatches_through_interface(model_cls: type) -> bool:
    """Whether the modeling file of ``model_cls`` calls its attention through transformers'
    ``ALL_ATTENTION_FUNCTIONS``: then the class flag ``_supports_attention_backend = False`` is
    stale (transformers moves families onto the interface release by release and some, e.g.
    stablelm and the hybrid Qwen3-Next / Qwen3.5 / OLMo-hybrid, keep the flag), and the family
    runs under varlen_packed; tests/models/test_all_families.py proves each such family exact."""
    module = sys.modules.get(model_cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):  # no source (a frozen or compiled module): keep the flag's word
        return False
    return (
        "ALL_ATTENTION_FUNCTIONS.get_interface(" in source or "ALL_ATTENTION_FUNCTIONS[" in source
    )


def dispatches_attention(model_cls: type) -> bool:
    """Whether ``model_cls`` calls its attention through transformers' AttentionInterface (its
    class flag, or a stale flag over a modeling file that dispatches anyway), so that any
    registered ``attn_implementation`` name takes effect."""
    return model_cls.is_backend_compatible() or _dispatches_through_interface(model_cls)


def _unsupported_reason(model_cls: type) -> str | None:
    """Why a model class cannot run under varlen_packed, or None. Class flags (and whether its
    modeling file dispatches through the attention interface) and its forward's signature only."""
    name = model_cls.__name__
    stale_flag = not model_cls.is_backend_compatible() and _dispatches_through_interface(model_cls)
    if stale_flag and "position_ids" not in inspect.signature(model_cls.forward).parameters:
        return (
            f"{name} keeps _supports_attention_backend = False and its forward takes no "
            "position_ids (learned positions counted from the start of the row, e.g. the "
            "decoders of encoder-decoder families), so the positions of a packed row cannot "
            "restart at each document"
        )
    if "shared_kv_states" in inspect.signature(model_cls.forward).parameters:
        return (
            f"{name} is a speculative-decoding assistant: its queries attend to the target "
            "model's key/value states (shared_kv_states) through bidirectional masks it builds "
            "as 4-D (a flipped sliding window), not causally over documents of its own row"
        )
    if not dispatches_attention(model_cls):
        return (
            f"{name} does not dispatch attention through transformers' AttentionInterface "
            "(legacy attention classes, _supports_attention_backend = False), so varlen_packed "
            "would never run and its own attention would get no mask"
        )
    if not getattr(model_cls, "_supports_flash_attn", False):
        return (
            f"{name} declares _supports_flash_attn = False: its attention needs more than "
            f"{_MASK_CONTRACT}, e.g. a 4-D mask (a DSA indexer, a position bias, chunked "
            "attention)"
        )
    return None


def _check_config(config) -> None:
    """Raise for a model whose config maps (transformers' auto classes) to an unsupported class."""
    key = type(config)
    if key not in _UNSUPPORTED:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        try:
            model_cls = MODEL_MAPPING[key]
        except (KeyError, ValueError):  # a custom model: nothing to look up, nothing to refuse
            model_cls = None
        _UNSUPPORTED[key] = None if model_cls is None else _unsupported_reason(model_cls)
    reason = _UNSUPPORTED[key]
    if reason is not None:
        raise ValueError(
            f"attn_implementation='varlen_packed' cannot serve {_model_name(config)}: {reason}. "
            "Load it with attn_implementation='sdpa' or 'eager'"
        )


def _config_reason(config) -> str | None:
    """Why this config (not its class) needs more than varlen_packed does, or None: the fields
    that make transformers refuse FlashAttention for the same model."""
    if getattr(config, "alibi", False) is True:
        return (
            "config.alibi=True adds an ALiBi position bias to the attention mask; "
            f"{_MASK_CONTRACT}, which cannot carry it"
        )
    if getattr(config, "prefix_lm", False) is True:
        return (
            "config.prefix_lm=True needs the PrefixLM 4-D mask overlay (a bidirectional "
            f"prefix); {_MASK_CONTRACT}, which cannot carry it; set config.prefix_lm=False to "
            "train it causally"
        )
    return None


def _config_fields_refusal(config) -> str | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    reason = _config_reason(config) or (_config_reason(text) if text is not config else None)
    if reason is None:
        return None
    return (
        f"attn_implementation='varlen_packed' cannot serve {_model_name(config)}: {reason}. "
        "Load it with attn_implementation='sdpa' or 'eager'"
    )


def _check_config_fields(config) -> None:
    refusal = _config_fields_refusal(config)
    if refusal is not None:
        raise ValueError(refusal)


def _stateful_refusal(config, kinds: list[str]) -> str:
    return (
        f"{_model_name(config)} has layers that carry a state along the row ({', '.join(kinds)}"
        "), which would flow from one packed document into the next. "
        "hf_varlen.install_linear_attention(model) makes gated DeltaNet layers (Qwen3-Next, "
        "Qwen3.5, OLMo-hybrid) restart at every document boundary; other such layers (Mamba, "
        "lightning attention, RG-LRU, short convolutions) cannot be packed yet: train this "
        "model on padded, unpacked batches"
    )


def varlen_refusal(model: torch.nn.Module) -> str | None:
    """Why attn_implementation='varlen_packed' cannot serve ``model``, as one line naming the
    model, the reason and the alternative; None when it can. The one rule behind ``check_model``
    and ``hf-varlen train``'s model check:

    - config fields that need a 4-D mask (ALiBi, a PrefixLM prefix);
    - class flags, read with whether the modeling file dispatches through the interface anyway;
    - speculative-decoding assistants (a forward taking the target's ``shared_kv_states``);
    - layers that carry a state along the row, except gated DeltaNet layers, which
      ``install_linear_attention`` restarts at every document boundary (accepted here whether or
      not installed yet: the first packed forward refuses them until they are).
    """
    config = getattr(model, "config", None)
    if config is not None and (refusal := _config_fields_refusal(config)) is not None:
        return refusal
    reason = _unsupported_reason(type(model))
    if reason is not None:
        return (
            f"attn_implementation='varlen_packed' cannot serve {_model_name(config)}: {reason}. "
            "Load it with attn_implementation='sdpa' or 'eager'"
        )
    kinds = stateful_layer_kinds(config) if config is not None else []
    restartable = any(is_linear_attention_layer(m) for m in model.modules())
    if [k for k in kinds if not (restartable and k == "linear_attention")]:
        return _stateful_refusal(config, kinds)
    if not kinds:
        conv = next((n for n, m in model.named_modules() if _decoder_convolution(n, m)), None)
        if conv is not None:
            return _stateful_refusal(config, [f"a causal convolution, {conv}"])
    return None


def _row_convolution(module: torch.nn.Module) -> bool:
    """A 1-D convolution wider than one token (along the row, in a decoder: ZAYA's CCA q/k
    convolution, Mamba's and linear attention's short convolutions)."""
    return isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1


def _decoder_convolution(name: str, module: torch.nn.Module) -> bool:
    """A row convolution inside a decoder layer (``...layers.<i>....``), not in an audio or vision
    encoder, whose convolutions run over their own inputs before any token is packed."""
    return (
        _row_convolution(module)
        and re.search(r"(^|\.)layers\.\d+\.", name) is not None
        and re.search(r"audio|vision|visual|encoder", name) is None
    )


_CONVOLVES: dict[type, bool] = {}  # attention class -> whether it holds a row convolution


def _convolves(module: torch.nn.Module) -> bool:
    cls = type(module)
    if cls not in _CONVOLVES:
        _CONVOLVES[cls] = any(_row_convolution(m) for m in module.modules())
    return _CONVOLVES[cls]


def check_model(model: torch.nn.Module) -> None:
    """Raise now, naming the model, if it cannot run under varlen_packed (no forward needed;
    the rule: ``varlen_refusal``).

    The class checks run by themselves at the first forward (from the mask function); this also
    covers models that never build a mask through transformers' masking utilities, and refuses
    layers carrying a state along the row that no installer restarts.
    """
    refusal = varlen_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)


def _is_bidirectional(fn, depth: int = 0) -> bool:
    """Whether a transformers mask function is, or combines (``and_masks`` / ``or_masks`` keep
    their parts in closures), one of its bidirectional ones (named so: ``bidirectional_mask_
    function``, ``sliding_window_bidirectional_overlay.<locals>...``)."""
    if "bidirectional" in getattr(fn, "__qualname__", ""):
        return True
    if depth >= 3:
        return False
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        parts = held if isinstance(held, (tuple, list)) else (held,)
        if any(callable(f) and _is_bidirectional(f, depth + 1) for f in parts):
            return True
    return False


def _check_bidirectional_cross(config, kwargs) -> None:
    """Raise for a bidirectional mask from queries over keys of another length: attention to
    another sequence's key/value states (Gemma 4's speculative-decoding assistant attends to its
    target model's), whose mask varlen_packed cannot build from documents of the queries' row.
    Checked at every mask call, so a model loaded with varlen_packed is refused at its first
    forward, not only by check_model."""
    q_len, kv_len = kwargs.get("q_length"), kwargs.get("kv_length")
    if q_len is None or kv_len is None or q_len == kv_len:
        return
    if not _is_bidirectional(kwargs.get("mask_function")):
        return
    raise ValueError(
        f"attn_implementation='varlen_packed' cannot serve {_model_name(config)}: it builds a "
        f"bidirectional mask from {q_len} queries over {kv_len} keys of another sequence (e.g. "
        "a speculative-decoding assistant attending to its target model's key/value states), "
        "not causally over documents of its own row. Load it with attn_implementation='sdpa' "
        "or 'eager'"
    )


class _LastMaskCall(threading.local):
    """What the last mask call of this thread saw, for the attention function of the same forward.

    transformers detects packed position_ids (positions that do not step by +1) before it calls
    the mask function, and then hands it a mask function that separates the documents and
    ``allow_is_causal_skip=False``. Some models (e.g. persimmon, ministral3, cohere_compass) never
    pass position_ids on to their attention layers; there, this record is the only evidence that a
    row packs several documents. Evaluated lazily: only when a layer got neither position_ids nor
    cu_seq_lens.
    """

    config = None  # weakref to the config of that call
    probe = None  # (mask_function, batch_size, q_length, q_offset, kv_offset, device)
    packed = None  # the probe's verdict once evaluated


_LAST_MASK_CALL = _LastMaskCall()


def _remember_mask_call(kwargs) -> None:
    record = _LAST_MASK_CALL
    config = kwargs.get("config")
    suspect = (
        config is not None
        and kwargs.get("attention_mask") is None
        and kwargs.get("allow_is_causal_skip") is False
        and callable(kwargs.get("mask_function"))
    )
    if not suspect:
        record.config = record.probe = record.packed = None
        return
    record.config = weakref.ref(config)
    record.probe = tuple(
        kwargs.get(k) for k in ("mask_function", "batch_size", "q_length", "q_offset", "kv_offset")
    ) + (kwargs.get("device"),)
    record.packed = None


def _documents_restart(probe) -> bool:
    """True when the mask function forbids some token from seeing its predecessor: a new document."""
    fn, bsz, q_len, q_offset, kv_offset, device = probe
    if not bsz or not q_len or q_len < 2:
        return False
    rows = torch.arange(bsz, device=device)[:, None]
    head = torch.zeros(1, 1, dtype=torch.long, device=device)
    i = torch.arange(1, q_len, device=device)[None, :]
    sees_previous = fn(rows, head, i + (q_offset or 0), i - 1 + (kv_offset or 0))
    return not bool(torch.as_tensor(sees_previous).all())


def _check_positions_reached(module, query, key) -> None:
    """Raise if the model dropped the position_ids of a batch packed by position_ids only."""
    record = _LAST_MASK_CALL
    config = getattr(module, "config", None)
    if record.config is None or config is None or record.config() is not config:
        return
    if query.shape[2] != key.shape[2]:
        return
    if record.packed is None:
        record.packed = _documents_restart(record.probe)
    if record.packed:
        raise ValueError(
            f"{_model_name(config)}: its attention layer {type(module).__name__} does not receive "
            "position_ids, and this batch packs several documents into one row by position_ids "
            "alone, so varlen_packed cannot see where the documents start (it would attend across "
            "them). Give the batch the document offsets cu_seq_lens_q/k and max_length_q/k: "
            "hf_varlen.PackingCollator() adds them by default, as does "
            "DataCollatorWithFlattening(return_flash_attn_kwargs=True)"
        )


def _metadata(query, key, attention_mask, kwargs) -> VarlenMetadata:
    bsz, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if cu_q is None or cu_k is None or max_q is None or max_k is None:
            raise ValueError(
                "varlen_packed got only some of cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k; "
                "pass all four (DataCollatorWithFlattening(return_flash_attn_kwargs=True) or "
                "hf_varlen.PackingCollator do) or none of them"
            )
        if attention_mask is not None:
            raise ValueError(
                "varlen_packed got both packed-sequence kwargs (cu_seq_lens_*) and a padding "
                "attention_mask; packed batches carry no padding mask: drop attention_mask"
            )
        # checked to cover the batch once per forward in eager mode (one sync), never per layer
        return from_collator_kwargs(
            cu_q, cu_k, max_q, max_k, bsz * q_len, bsz * kv_len, device=query.device
        )
    if attention_mask is not None:
        # (B, K) from a caller, or (B, 1, 1, K) from our mask function (possibly sliced on dim 2)
        padding = attention_mask.dim() == 2 or (
            attention_mask.dim() == 4 and attention_mask.shape[1] == attention_mask.shape[2] == 1
        )
        if not padding:
            raise ValueError(
                f"varlen_packed expects a (batch, kv_len) or (batch, 1, 1, kv_len) padding mask, "
                f"got shape {tuple(attention_mask.shape)}; was the model built with another "
                "attn_implementation's mask?"
            )
        return from_padding_mask(attention_mask, q_len)
    position_ids = kwargs.get("position_ids")
    if bsz == 1 and q_len == kv_len and q_len > 1 and position_ids is not None:
        if position_ids.numel() != q_len:
            raise ValueError(
                f"varlen_packed got position_ids of shape {tuple(position_ids.shape)} for a batch "
                f"of {q_len} tokens; position_ids must have one entry per token (1, {q_len})"
            )
        return from_position_ids(position_ids)
    return from_rows(bsz, q_len, kv_len, query.device)


_ROW_POSITIONS: dict[type, bool] = {}  # attention class -> positions counted from padding_idx


def _positions_from_padding_idx(module) -> bool:
    """RoBERTa-style embeddings (positions start at padding_idx + 1, counted from the row start
    unless position_ids are given): packed 0-based position_ids would shift every position."""
    cls = type(module)
    if cls not in _ROW_POSITIONS:
        try:
            source = inspect.getsource(sys.modules[cls.__module__])
        except (KeyError, OSError, TypeError):
            source = ""
        _ROW_POSITIONS[cls] = "def create_position_ids_from_input_ids" in source
    return _ROW_POSITIONS[cls]


_ROWS_CHECKED = BatchState()  # (config, attention class, ...) whose packed rows passed


def _check_packed_row(module, meta: VarlenMetadata, kwargs) -> None:
    """Raise for a row packing several documents where something besides attention would cross
    document boundaries: layers that carry a state along the row (see
    hf_varlen.integrations.linear_attention), or positions that packing cannot restart. Checked
    once per batch and model (``_ROWS_CHECKED``), not per layer."""
    config = getattr(module, "config", None)
    if config is None:
        return
    key = (  # the entry holds the config, so its id is not reused while the entry lives
        id(config),
        type(module),
        is_linear_attention_installed(config),
        kwargs.get("cu_seq_lens_q") is None,
    )
    _ROWS_CHECKED.get_or_compute(meta, key, lambda: _check_packed_row_now(module, config, kwargs))


def _check_packed_row_now(module, config, kwargs):
    kinds = stateful_layer_kinds(config)
    # installed gated DeltaNet layers restart; any other state-carrying kind still crosses over
    restarted = ("linear_attention",) if is_linear_attention_installed(config) else ()
    if [k for k in kinds if k not in restarted]:
        raise ValueError(_stateful_refusal(config, kinds))
    if not kinds and _convolves(module):
        raise ValueError(
            _stateful_refusal(config, [f"a causal convolution in {type(module).__name__}"])
        )
    if kinds and kwargs.get("cu_seq_lens_q") is None:
        raise ValueError(
            f"{_model_name(config)}: this batch packs several documents into one row by "
            "position_ids alone, which its linear-attention layers never receive; give the batch "
            "the document offsets cu_seq_lens_q/k and max_length_q/k (hf_varlen.PackingCollator() "
            "adds them, as does DataCollatorWithFlattening(return_flash_attn_kwargs=True))"
        )
    if _positions_from_padding_idx(module):
        raise ValueError(
            f"{_model_name(config)} counts its learned positions from padding_idx + 1 "
            "(RoBERTa-style embeddings), so the 0-based position_ids of a packed row do not give "
            "each document the positions it has alone; train this model on padded, unpacked "
            "batches"
        )
    return config


def varlen_packed_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function for ``attn_implementation="varlen_packed"``."""
    # One dtype for q, k, v on every backend (fp32 weights under autocast mix them); the cast is
    # silent, as in transformers' FlashAttention path minus its once-per-process warning (no
    # logging inside a traced region).
    dtype = attention_dtype(module, query, key, value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    bsz, h_q, q_len, head_dim = query.shape
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if (
        attention_mask is None
        and kwargs.get("position_ids") is None
        and kwargs.get("cu_seq_lens_q") is None
        and not tracing()
    ):
        _check_positions_reached(module, query, key)
    if (
        attention_mask is not None
        and attention_mask.dim() in (2, 4)
        and attention_mask.shape[-1] < key.shape[2]
    ):
        # A static cache hands over all of its slots (max_cache_len) while the padding mask covers the
        # tokens seen so far, which fill its first slots: the rest are empty (zeros), never to be
        # attended to, and the mask's unpadding indices are laid out for its own length. Keep the
        # filled slots, as transformers' FlashAttention path does.
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    meta = _metadata(query, key, attention_mask, kwargs)
    # is_compiling first: Dynamo would otherwise guard on the number of documents (a recompile
    # per pack size)
    if not tracing() and bsz == 1 and meta.cu_seqlens_q.shape[0] > 2:
        _check_packed_row(module, meta, kwargs)
    # (B, H, T, D) -> (B*T, H, D): a view for B == 1 (packed batches), a copy otherwise.
    q = query.transpose(1, 2).reshape(bsz * q_len, h_q, head_dim)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    if meta.indices_q is not None:
        q, k, v = q[meta.indices_q], k[meta.indices_k], v[meta.indices_k]
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        # HF semantics: a token sees itself and the sliding_window - 1 tokens on each side it may
        # see (AttentionParams.create folds causality in: right = 0).
        window = (sliding_window - 1, sliding_window - 1)
    # The metadata goes to the backend as metadata.py built and checked it (once per batch); the
    # layer's own arguments are checked and described once per batch and kind of layer
    # (functional.batch_call), so layers 2..N of a batch go straight to the backend.
    params, request = batch_call(
        q,
        k,
        v,
        meta,
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window,
        softcap=float(softcap or 0.0),
        dropout_p=float(dropout or 0.0),
        # attention sinks (gpt-oss, granite_swa: one learned logit per query head); a backend
        # without them is skipped by "auto" and refused by name when chosen explicitly
        sinks=kwargs.get("s_aux"),
    )
    backend = getattr(module, MODEL_BACKEND_ATTR, "auto")  # set_backend(name, model=...)
    out = dispatch(q, k, v, meta, params, backend, request=request)
    if meta.indices_q is not None:
        full = out.new_zeros(bsz * q_len, h_q, out.shape[-1])
        out = full.index_copy(0, meta.indices_q, out)
    return out.view(bsz, q_len, h_q, out.shape[-1]), None


def varlen_packed_mask(*args, **kwargs):
    """Mask function: None for packed / unpadded batches, else the bool padding mask (B, 1, 1, K).

    The contract of transformers' FlashAttention mask function (which we reuse): the attention
    function unpads by itself, so no dense (T x T) mask is ever built. The padding mask is handed
    on as a (B, 1, 1, K) view rather than (B, K) because our name does not contain "flash": model
    code that treats every non-flash mask as 4-D (e.g. Gemma 4 slicing ``mask[:, :, -n:, :]`` for
    its KV-shared layers) must find four dimensions, and dims of size 1 survive any such slice.
    Called once per forward
    before any layer, it is also where a model that cannot run under varlen_packed (legacy
    attention, a 4-D mask) is refused, and where packed position_ids are noted for the attention
    function. Both checks are skipped while torch.compile traces (they run in eager mode).
    """
    from transformers.masking_utils import flash_attention_mask

    if not tracing():
        config = kwargs.get("config")
        if config is not None:
            _check_config(config)
            _check_config_fields(config)
        _check_bidirectional_cross(config, kwargs)
        _remember_mask_call(kwargs)
    mask = flash_attention_mask(*args, **kwargs)
    if mask is None:
        mask = _static_cache_prefix(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        # (B, K) -> (B, 1, 1, K): models that slice masks as 4-D unless the name says "flash"
        # (Gemma 4's KV-shared layers) keep the padding mask intact (_padding_mask_2d undoes it)
        mask = mask[:, None, None, :]
    return mask


def _static_cache_prefix(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, *args, **kwargs
) -> torch.Tensor | None:
    """(B, n) all-True mask over a static cache's n filled slots, or None when every slot is.

    A static cache hands every layer all of its max_cache_len slots, filled from slot 0 up to
    the last query (n = q_offset + q_length). FlashAttention's mask function says None for an
    unpadded batch, after which the empty slots (zeros) would count as keys: a query would give
    them weight exp(0). A mask of the filled length makes the attention function keep only
    those slots (as it does for a padded batch, whose mask has the same length), with the
    queries as its last q_length columns. The static cache's q_offset is a 0-d tensor: reading
    it is one host sync per forward (the padding-mask path already pays one). A dynamic cache has
    exactly q_offset + q_length slots, and training (no cache) q_length: no mask there."""
    if kv_offset != 0 or kv_length <= q_length:
        return None
    filled = int(q_offset) + q_length  # host read of the static cache's offset (see above)
    if filled >= kv_length:
        return None
    device = q_offset.device if isinstance(q_offset, torch.Tensor) else kwargs.get("device")
    return torch.ones(batch_size, filled, dtype=torch.bool, device=device)


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``name`` with transformers' AttentionInterface and AttentionMaskInterface.

    Idempotent. Returns the name, for ``from_pretrained(..., attn_implementation=name)``.
    """
    if "flash" in name:
        raise ValueError(
            f"name={name!r}: transformers treats any implementation name containing 'flash' as "
            "FlashAttention and switches on flash-only code paths; choose another name"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, varlen_packed_forward)
    AttentionMaskInterface.register(name, varlen_packed_mask)
    return name
