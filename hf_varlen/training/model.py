"""Tokenizer and model construction for training, with the checks that must precede step 1.

- ``load_tokenizer``: the built-in byte tokenizer for presets (or ``--tokenizer bytes``), else
  ``AutoTokenizer`` (right padding, pad token = eos when the tokenizer has none).
- ``build_model``: a random-init preset (``builtin.PRESETS`` + ``--config-overrides``, vocabulary
  rounded up to a multiple of 64) or ``from_pretrained``; attention implementation ``varlen_packed``
  for packed batches and ``sdpa`` for the padded baseline; ``use_cache=False`` (a cache disables
  transformers' packed-sequence handling in the baselines and wastes memory in training). A model
  that ``varlen_packed`` cannot serve is refused by the library's own rule (``varlen_refusal``);
  a hybrid model's linear-attention layers are installed to restart at document boundaries.
- ``apply_kernels`` / ``apply_lora``: kernels and adapters on the built model (model_kernels.py).
- ``check_load_in_4bit`` / ``quantization_kwargs``: QLoRA (``--load-in-4bit``): bitsandbytes NF4
  through transformers' ``BitsAndBytesConfig``, loaded straight onto the run's one GPU. A preset
  (random init, no checkpoint) is saved once to a temporary folder and reloaded quantised, so
  both go through ``from_pretrained``'s quantiser, the one supported way to quantise.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch

from .builtin import PRESETS, byte_tokenizer, tiny_shape
from .model_kernels import (  # noqa: F401  moved to model_kernels.py, still importable here
    LARGE_VOCAB,
    apply_kernels,
    apply_lora,
    fused_loss_choice,
)
from .options import ModelOptions
from .sources import hub_access, local_or_hub

logger = logging.getLogger("hf_varlen.training")


@contextlib.contextmanager
def hub_answers(flag: str, source: str):
    """transformers turns the Hub's "no such repository / revision" and "gated" answers into a bare
    OSError; name the option and the fix instead (a FileNotFoundError: a usage error, exit 2)."""
    try:
        yield
    except OSError as exc:
        from huggingface_hub.errors import (
            GatedRepoError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, GatedRepoError):  # before its base class, RepositoryNotFoundError
            fix = "it is gated: accept its terms on its Hub page, then `hf auth login`"
        elif isinstance(cause, RepositoryNotFoundError):
            fix = (
                "the Hugging Face Hub has no such repository (or it is private: `hf auth "
                "login`); check the id, or pass a local folder"
            )
        elif isinstance(cause, RevisionNotFoundError):
            fix = "the Hub repository has no such revision; check the id"
        else:
            raise
        raise FileNotFoundError(f"{flag} {source!r}: {fix}") from exc


def load_tokenizer(cfg: ModelOptions):
    name = cfg.tokenizer
    if name == "bytes" or (name is None and cfg.model in PRESETS):
        return byte_tokenizer()
    from transformers import AutoTokenizer

    flag = "--tokenizer" if name else "--model"
    source, local = local_or_hub(flag, name or cfg.model)
    extra = {} if local else hub_access(flag, source, filename="tokenizer_config.json")
    with hub_answers(flag, source):
        tok = AutoTokenizer.from_pretrained(source, **extra)
    tok.padding_side = "right"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(
                f"--tokenizer {name or cfg.model!r} has neither a pad nor an eos token; "
                "choose a tokenizer with an eos token"
            )
        tok.pad_token = tok.eos_token
    return tok


def pad_id(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)


def _parse_overrides(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"--config-overrides: expected key=value items, got {item!r}")
        key, raw = (s.strip() for s in item.split("=", 1))
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lower() in ("none", "null"):
            value = None
        out[key] = value
    return out


def resolve_precision(cfg: ModelOptions, device: torch.device) -> str:
    if cfg.precision != "auto":
        cuda_bf16 = cfg.precision.startswith("bf16") and device.type == "cuda"
        if cuda_bf16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--precision {cfg.precision}: this GPU has no bf16 support")
        return cfg.precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def attn_implementation(cfg: ModelOptions) -> str:
    return "sdpa" if cfg.padded else cfg.attn_implementation


def check_load_in_4bit(cfg: ModelOptions, device: torch.device, processes: int) -> None:
    """Refuse a ``--load-in-4bit`` this run cannot honour, before anything is loaded (the flag
    combinations are checked by ``TrainConfig.validate``)."""
    if not cfg.load_in_4bit:
        return
    if device.type != "cuda":
        raise ValueError(
            f"--load-in-4bit needs a CUDA GPU (bitsandbytes' 4-bit matmul), but this run's device "
            f"is {device.type!r}; run on a GPU or drop --load-in-4bit"
        )
    if processes > 1:
        raise ValueError(
            f"--load-in-4bit trains on one GPU: a 4-bit base cannot be sharded by FSDP2 or "
            f"replicated here, got {processes} processes; launch one process or drop --load-in-4bit"
        )


def quantization_kwargs(device: torch.device) -> dict[str, Any]:
    """``from_pretrained`` keywords of ``--load-in-4bit``: NF4 with double quantisation (the QLoRA
    recipe: ~0.4 bit less per weight), bf16 compute, every weight on the run's GPU (bitsandbytes
    quantises while loading there; accelerate then leaves the model where it is)."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return {
        "quantization_config": config,
        "device_map": {"": index if index is not None else str(device)},
    }


def build_model(cfg: ModelOptions, tokenizer, precision: str, device: torch.device | None = None):
    """The model in the weight dtype of ``precision``, ``use_cache`` off. Presets are initialised
    directly on ``device`` (a 1B model's random init is slow on the host); loaded models stay on
    the CPU until ``accelerator.prepare`` moves them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = attn_implementation(cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    overrides = _parse_overrides(cfg.config_overrides)
    if cfg.model in PRESETS:
        model_type, shape = PRESETS[cfg.model]
        vocab = 64 * math.ceil(len(tokenizer) / 64)
        if cfg.model.startswith("tiny-") and "hidden_size" not in overrides:
            small = tiny_shape(shape, vocab)
            if small is not shape:
                logger.info(
                    "%s: hidden size %d instead of %d, so that the %s-token embedding stays tiny "
                    "(--config-overrides hidden_size=%d keeps it)",
                    cfg.model,
                    small["hidden_size"],
                    shape["hidden_size"],
                    f"{vocab:,}",
                    shape["hidden_size"],
                )
            shape = small
        special = {
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
        }
        fields = {**shape, "vocab_size": vocab, **special}
        config = AutoConfig.for_model(model_type, **fields)
        for key in overrides:
            if not hasattr(config, key):
                raise ValueError(
                    f"--config-overrides: {key!r} is not a field of {type(config).__name__}"
                )
        if overrides:  # built again, not patched: fields derived at init (layer_types) follow
            config = AutoConfig.for_model(model_type, **{**fields, **overrides})
        config.use_cache = False
        with torch.device(device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
        if cfg.load_in_4bit:  # no checkpoint to quantise: save the preset once, reload in 4-bit
            import tempfile

            with tempfile.TemporaryDirectory(prefix="hf_varlen_4bit_") as folder:
                model.save_pretrained(folder)
                del model  # its full-precision weights go before the 4-bit copy loads
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                model = AutoModelForCausalLM.from_pretrained(
                    folder,
                    attn_implementation=attn,
                    dtype=dtype,
                    **quantization_kwargs(device or torch.device("cpu")),
                )
            model.config.use_cache = False
    else:
        source, local = local_or_hub("--model", cfg.model)
        extra = {} if local else hub_access("--model", source)
        if overrides:  # the config settled before any layer is built from it
            with hub_answers("--model", source):
                config, unused = AutoConfig.from_pretrained(
                    source, return_unused_kwargs=True, **extra, **overrides
                )
            unknown = sorted(set(unused) & set(overrides))
            if unknown:  # from_pretrained would drop them without a word
                raise ValueError(
                    f"--config-overrides: {unknown[0]!r} is not a field of {type(config).__name__}"
                )
            _cut_layer_types(config, overrides)
            extra["config"] = config
        if cfg.load_in_4bit:
            extra.update(quantization_kwargs(device or torch.device("cpu")))
        try:
            with hub_answers("--model", source):
                model = AutoModelForCausalLM.from_pretrained(
                    source, attn_implementation=attn, dtype=dtype, **extra
                )
        except ValueError as exc:
            if "attn_implementation" in str(exc):
                raise ValueError(
                    f"--model {cfg.model!r} rejected attn_implementation={attn!r}: {exc}. Hint: "
                    "use --padded (sdpa baseline) or --attn-implementation sdpa/eager"
                ) from exc
            raise
        model.config.use_cache = False
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"--tokenizer has {len(tokenizer)} tokens but --model {cfg.model!r} embeds only "
                f"{model.get_input_embeddings().num_embeddings}; use the model's own tokenizer"
            )
    check_attention(model, attn, cfg.model)
    return model


def _cut_layer_types(config, overrides: dict[str, Any]) -> None:
    """Keep a loaded config's ``layer_types`` (one entry per layer: full / sliding / linear
    attention) as long as ``num_hidden_layers`` when an override cut the layers: transformers builds
    layer i from entry i, so the first N entries are the layers kept, and its config validation
    refuses to save a list of another length. An explicit ``layer_types`` override is left as
    written; more layers than types is refused (which type would they be?)."""
    layers = overrides.get("num_hidden_layers")
    types = getattr(config, "layer_types", None)
    if layers is None or "layer_types" in overrides or not isinstance(types, list | tuple):
        return
    if len(types) > layers:
        config.layer_types = list(types[:layers])
    elif len(types) < layers:
        raise ValueError(
            f"--config-overrides: num_hidden_layers={layers} is more than the "
            f"{len(types)} layer types of {type(config).__name__}; also give layer_types"
        )


def check_attention(model, attn: str, name: str) -> None:
    """Refuse a model whose attention layers would silently ignore ``attn``; for varlen_packed,
    refuse exactly what the library refuses (``varlen_refusal``, the one rule) and restart the
    gated DeltaNet layers of a hybrid model at every document boundary."""
    if attn in ("eager", "sdpa"):
        return
    from ..integrations.transformers import DEFAULT_NAME, dispatches_attention, varlen_refusal

    hint = "Hint: train it with --padded (sdpa baseline) or --attn-implementation sdpa"
    cls = type(model)
    if attn == DEFAULT_NAME:
        refusal = varlen_refusal(model)
        if refusal is not None:
            raise ValueError(f"--model {name!r}: {refusal}. {hint}")
        _install_linear_attention(model, name)
    elif not dispatches_attention(cls):
        raise ValueError(
            f"--model {name!r} ({cls.__name__}) does not dispatch attention through transformers' "
            f"AttentionInterface, so attn_implementation={attn!r} cannot take effect. {hint}"
        )
    got = getattr(model.config, "_attn_implementation", None)
    if got != attn:
        raise ValueError(
            f"--model {name!r} ended up with attn_implementation={got!r} instead of {attn!r}; "
            "it may not support custom attention functions. Hint: --padded or "
            "--attn-implementation sdpa"
        )


def _install_linear_attention(model, name: str) -> None:
    """Hybrid models: their gated DeltaNet layers restart at every packed document boundary."""
    from ..integrations.linear_attention import install_linear_attention

    layers = install_linear_attention(model)
    if layers:
        logger.info(
            "--model %r: %d linear-attention layer(s) restart their state at every document "
            "boundary (hf_varlen.install_linear_attention)",
            name,
            layers,
        )


def _packed(cfg: ModelOptions) -> bool:
    return not cfg.padded and cfg.attn_implementation == "varlen_packed"


def check_backend(cfg: ModelOptions) -> None:
    """Validate ``--attn-backend`` before anything is loaded; changes nothing."""
    if not _packed(cfg) or cfg.attn_backend == "auto":
        return
    import hf_varlen

    if cfg.attn_backend in hf_varlen.available_backends():
        return
    try:  # raises with the reason (unknown, or cannot run here); the throwaway module is discarded
        hf_varlen.set_backend(cfg.attn_backend, model=torch.nn.Module())
        reason = "not available here"
    except (ValueError, RuntimeError) as exc:
        reason = str(exc)
    raise ValueError(
        f"--attn-backend {cfg.attn_backend!r}: {reason}. Available here: "
        f"{hf_varlen.available_backends()} (or 'auto')"
    )


def scope_backend(model, cfg: ModelOptions) -> None:
    """Give ``model`` the ``--attn-backend`` choice (its own scope: the process-wide default that
    ``hf_varlen.set_backend(name)`` sets for everything else stays as it was). 'auto' leaves the
    model to the process default."""
    if _packed(cfg):
        import hf_varlen

        hf_varlen.set_backend(cfg.attn_backend, model=model)


def matmul_flops_per_token(model) -> float:
    """Training FLOPs per token of the linear layers: 2 (forward) + 2 (input grad) per weight,
    + 2 more (weight grad) when it is trained. Embedding lookups cost no FLOPs."""
    total = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # in x out: a 4-bit weight packs two per byte
            w = module.weight
            total += module.in_features * module.out_features * (6.0 if w.requires_grad else 4.0)
    return total


def parameter_count(model, trainable_only: bool = False) -> int:
    """Parameters of ``model`` as the model has them: a bitsandbytes 4-bit weight (``Params4bit``)
    stores two values per byte of its storage type, so its ``numel()`` is a fraction of its count
    (transformers' ``num_parameters`` counts it the same way)."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        n = p.numel()
        if type(p).__name__ == "Params4bit":
            storage = getattr(p, "quant_storage", torch.uint8)
            n *= 2 * storage.itemsize
        total += n
    return total


def attention_dims(model) -> tuple[int, int]:
    """(layers, heads * head_dim of the queries) for the attention FLOP estimate."""
    config = model.config
    config = getattr(config, "text_config", config)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (
        int(getattr(config, "hidden_size", 0) or 0) // max(heads, 1)
    )
    return layers, heads * int(head_dim)
