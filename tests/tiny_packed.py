"""A tiny packed Llama and collator-style batches for the model-level offset tests.

tiny_llama(layers=3, backend=None)  vocab 50, hidden 32, 4 / 2 heads, ``varlen_packed``; with
                                    ``backend`` scoped to this model (hf_varlen.set_backend)
collator_batch(cu, max_len, n=12)   one packed row of n tokens with the given cu_seq_lens_q/k
                                    and max_length_q/k (as the collator emits them)
"""

from __future__ import annotations

import torch


def tiny_llama(layers: int = 3, backend: str | None = None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_varlen

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="varlen_packed")
    if backend is not None:
        hf_varlen.set_backend(backend, model=model)
    return model


def collator_batch(cu, max_len, n: int = 12) -> dict:
    cu = torch.tensor(cu, dtype=torch.int32)
    return dict(
        input_ids=torch.randint(0, 50, (1, n)),
        position_ids=torch.arange(n)[None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
    )
