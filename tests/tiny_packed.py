"""Tiny random decoders and collator-style batches, shared by the model-level tests.

TINY                                the one tiny decoder shape of the model tests: vocab 97,
                                    hidden 64, FFN 96, 2 layers, 4 query / 2 KV heads
tiny_config(**overrides)            TINY with max_position_embeddings 256, then the overrides
TOKENS                              pad / bos / eos ids 0 / 1 / 2, for tests that pad or generate
KERNEL_SHAPE                        TINY with FFN 128, vocabulary 128, head_dim 16 (kernelize)
family_config(kind, **overrides)    the transformers config of ``kind`` (FAMILIES: llama, qwen3,
                                    mistral, gemma2) on tiny_config(**overrides), with the
                                    family's own features on (head_dim 16, sliding windows,
                                    Gemma 2's softcaps and alternating layers)
tiny_model(kind, attn, **overrides) family_config's model, seeded (torch.manual_seed(0)) and
                                    without KV cache; the ``tiny_model`` fixture of conftest.py
tiny_llama(layers=3, backend=None)  vocab 50, hidden 32, 4 / 2 heads, ``varlen_packed``; with
                                    ``backend`` scoped to this model (hf_varlen.set_backend)
docs_and_batch(lengths, vocab)      random documents of these lengths (ids from 3: no special
                                    token) and their PackingCollator batch without labels
padded(docs, side)                  the documents as one "left" or "right"-padded batch (pad id
                                    0): ids, attention mask, each row's slice of real tokens
collator_batch(cu, max_len, n=12)   one packed row of n tokens with the given cu_seq_lens_q/k
                                    and max_length_q/k (as the collator emits them)
"""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# the kernelize and kernel-hub tests' decoder: TINY with FFN 128, vocabulary 128, head_dim 16
KERNEL_SHAPE = dict(TINY, intermediate_size=128, vocab_size=128, head_dim=16)

# kind -> (transformers config class, what the family adds to the shared shape)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}


def tiny_config(**overrides) -> dict:
    return {**TINY, "max_position_embeddings": 256, **overrides}


def family_config(kind: str, **overrides):
    import transformers

    name, features = FAMILIES[kind]
    return getattr(transformers, name)(**tiny_config(**{**features, **overrides}))


def tiny_model(kind: str = "llama", attn: str = "varlen_packed", **overrides):
    from transformers import AutoModelForCausalLM

    cfg = family_config(kind, use_cache=False, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


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


def docs_and_batch(lengths, vocab: int):
    import hf_varlen

    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    batch = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    return docs, batch


def padded(docs, side: str):
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    spans = []
    for i, d in enumerate(docs):
        span = slice(width - len(d), width) if side == "left" else slice(0, len(d))
        ids[i, span], mask[i, span] = d, 1
        spans.append(span)
    return ids, mask, spans


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
