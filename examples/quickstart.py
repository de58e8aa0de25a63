"""Quickstart: train a tiny random-init Llama on packed, padding-free batches.

    python examples/quickstart.py            # CPU: well under a minute; uses the GPU if present

Needs: the base install only; no network and no data files (the model is built from a config).

Built-in deterministic data (no downloads): documents of random lengths whose tokens follow simple
learnable rules (counting with a per-document stride), packed by token budget with
``hf_varlen.pack_by_tokens`` and flattened by ``hf_varlen.PackingCollator``. The model runs with
``attn_implementation="varlen_packed"``, so no token ever attends across a document boundary.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_varlen


def make_documents(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length = int(torch.randint(8, 120, (1,), generator=g))
        start, stride = (int(x) for x in torch.randint(1, vocab, (2,), generator=g))
        stride = 1 + stride % 7
        docs.append([(start + i * stride) % vocab for i in range(length)])
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument(
        "--backend", default="auto", help=f"one of {hf_varlen.available_backends()} or auto"
    )
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    vocab = 256
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen_packed").to(
        device, dtype
    )
    hf_varlen.set_backend(args.backend, model=model)  # this model only; the process default stays
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    docs = make_documents(2000, vocab)
    packing = hf_varlen.pack_by_tokens([len(d) for d in docs], args.tokens_per_batch, seed=0)
    collator = hf_varlen.PackingCollator()
    print(
        f"device={device} dtype={dtype} backend={args.backend} docs={len(docs)} "
        f"batches={len(packing.batches)} packing_efficiency={packing.stats.packing_efficiency:.3f} "
        f"(padded batches would use {packing.stats.padded_efficiency:.3f} of their tokens)"
    )

    model.train()
    tokens, t0, first = 0, None, None
    for step, idx in enumerate(packing.batches[: args.steps]):
        batch = collator([{"input_ids": docs[i]} for i in idx])
        batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:  # exclude warm-up from the throughput
            first, t0 = loss.item(), time.perf_counter()
            continue
        tokens += batch["input_ids"].numel()
        if step % 5 == 0 or step == args.steps - 1:
            if device == "cuda":
                torch.cuda.synchronize()
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {step:3d}  loss {loss.item():.4f}  tokens/s {rate:,.0f}")
    print(f"loss {first:.3f} -> {loss.item():.3f}")


if __name__ == "__main__":
    main()
