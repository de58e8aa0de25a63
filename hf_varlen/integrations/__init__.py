"""hf_varlen inside Hugging Face models and trainers, one package per concept.

    transformers.py      the ``varlen_packed`` AttentionInterface + mask function, check_model
    linear_attention.py  install_linear_attention: gated DeltaNet layers restart per document
    kernelize/           kernelize(model): fused RMSNorm / RoPE / GLU (+ loss, LoRA) in a model
    fused_loss/          install_fused_cross_entropy: the fused linear cross-entropy as the HF loss
    trainers/            VarlenTrainer, VarlenSFTTrainer, VarlenDPO/GRPOTrainer, callbacks
    hub/                 the kernel-hub package (layers, FlashAttention-style entry points, builder)

The flat module paths of earlier releases (``integrations.loss``, ``.trl``, ``.hub_package``, ...)
still import, with a DeprecationWarning, for one release.
"""
