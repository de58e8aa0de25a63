"""The run's kernels and adapters on a built model.

- ``fused_loss_choice``: whether the fused linear cross-entropy runs (``--fused-loss auto`` turns it
  on for large vocabularies on CUDA, where the logits' memory is what it saves).
- ``apply_kernels``: ``hf_varlen.kernelize`` when present and wanted (guarded import), and the text
  the run summary shows for it.
- ``apply_lora``: peft LoRA adapters.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .options import ModelOptions

logger = logging.getLogger("hf_varlen.training")


# The logits of one micro-batch at this vocabulary (x the token budget x 4 bytes, several copies in
# backward) dominate memory: 4096 tokens x 32K x 4 B = 0.5 GiB per copy.
LARGE_VOCAB = 32768


def fused_loss_choice(cfg: ModelOptions, device: torch.device, vocab: int) -> tuple[bool, str]:
    """Whether the fused linear cross-entropy is wanted, and why (for the summary).

    auto: on wherever it saves memory without costing speed: on CUDA (the Triton row kernel), on
    the CPU (the chunked torch path: the same speed as transformers' loss at a 320-token vocabulary,
    and no [tokens, vocab] logits at 151K), elsewhere from a ``LARGE_VOCAB`` vocabulary on.
    Independent of ``--fused-kernels``.
    """
    if cfg.fused_loss != "auto":
        return cfg.fused_loss == "on", f"--fused-loss {cfg.fused_loss}"
    if device.type in ("cuda", "cpu"):
        return True, f"auto: on for {device.type.upper()}"
    if vocab >= LARGE_VOCAB:
        return True, f"auto: {vocab:,}-token vocabulary"
    return False, f"auto: {vocab:,}-token vocabulary on {device.type}"


def apply_kernels(model, cfg: ModelOptions, device: torch.device) -> tuple[str, bool, str]:
    """Fused kernels (RoPE, GLU, RMSNorm) and the fused cross-entropy via ``hf_varlen.kernelize``.

    ``--fused-kernels`` switches the layer kernels (auto: on with CUDA), ``--fused-loss`` the loss
    (auto: ``fused_loss_choice``), so each part can be measured on its own. Returns (what happened
    to the layers, whether the fused cross-entropy loss was installed, which loss runs and why).
    Called on the CPU model before ``accelerator.prepare`` moves it, so the target device is passed
    explicitly.
    """
    layers = cfg.fused_kernels == "on" or (cfg.fused_kernels == "auto" and device.type == "cuda")
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0] if head is not None else model.config.vocab_size)
    loss, why = fused_loss_choice(cfg, device, vocab)
    text = ""
    if not layers:
        reason = "--fused-kernels off" if cfg.fused_kernels == "off" else "auto: no CUDA device"
        text = f"off ({reason})"
    installed = False
    if layers or loss or cfg.fused_lora:
        from hf_varlen import kernelize

        report = kernelize(
            model,
            rope=layers,
            glu=layers,
            rmsnorm=layers,
            cross_entropy=loss,
            lora=cfg.fused_lora,
            device=device.type,
        )
        if cfg.fused_lora:
            _check_fused_lora(report)
        installed = report.installed("cross_entropy")
        if installed and device.type == "cpu":
            # Training on the CPU runs the chunked torch path: under TRITON_INTERPRET=1 (kernel
            # tests) "auto" would pick the Triton interpreter, ~1.7 s more per tiny step.
            from hf_varlen import install_fused_cross_entropy

            install_fused_cross_entropy(model, backend="torch")  # idempotent: updates the option
        text = _kernels_text(report) if layers else f"layer kernels {text}; {_kernels_text(report)}"
        if loss and not installed:
            failed = report.left_alone.get("cross_entropy", "not installed")
            if cfg.fused_loss == "on":  # an explicit request never falls back
                raise ValueError(
                    f"--fused-loss on: the fused cross-entropy cannot be installed on this model: "
                    f"{failed}. Hint: --fused-loss auto (falls back to transformers' loss and says "
                    "so) or --fused-loss off"
                )
            why = f"{why}, but the fused loss could not be installed: {failed}"
            logger.warning("--fused-loss: %s", why)
    name = "hf_varlen fused linear cross-entropy" if installed else "transformers' cross-entropy"
    return text, installed, f"{name} ({why})"


def _check_fused_lora(report) -> None:
    """--fused-lora is explicit: every LoRA layer runs the op, or the run stops with the reason."""
    from hf_varlen.integrations.kernelize.peft_lora import LEFT_ALONE_PREFIX

    left = {n: why for n, why in report.left_alone.items() if why.startswith(LEFT_ALONE_PREFIX)}
    if left or not report.installed("lora"):
        name, why = next(iter(left.items()), ("lora", report.left_alone.get("lora", "none")))
        raise ValueError(
            f"--fused-lora: {len(left) or 'no'} LoRA layer(s) cannot run the one-op LoRA "
            f"projection ({name}: {why}); drop --fused-lora"
        )


def _kernels_text(report) -> str:
    """The kernelize report for a CLI user: what ran fused, and why the rest did not (the
    reasons themselves, not a pointer at ``report.left_alone``)."""
    done = ", ".join(f"{k} x{n}" for k, n in report.counts.items() if n) or "nothing"
    text = f"hf_varlen.kernelize [{report.path}]: replaced {done}"
    if report.left_alone:
        # kernelize's reasons end in hints for its Python caller ("; pass device=..."), which a
        # CLI user cannot act on: keep the reason itself.
        reasons = Counter(r.split("; pass ")[0] for r in report.left_alone.values()).most_common()
        why = "; ".join(f"{r} (x{n})" if len(reasons) > 1 else r for r, n in reasons[:2])
        more = f"; and {len(reasons) - 2} other reasons" if len(reasons) > 2 else ""
        text += f"; left {len(report.left_alone)} modules alone: {why}{more}"
    return text


def apply_lora(model, cfg: ModelOptions):
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need a grad-requiring input
    return model
