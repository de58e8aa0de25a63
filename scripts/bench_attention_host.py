"""Host time of the varlen_packed attention function per layer, on CPU.

A tiny 16-layer Llama runs packed batches (collator offsets and position_ids, as
``hf_varlen.PackingCollator`` gives them) under ``attn_implementation="varlen_packed"``; every
attention call is timed with the calling thread's CPU time (``time.thread_time``: less sensitive
to other processes on a shared machine than wall time), minus the time inside the backend
function itself (the per-document SDPA loop), so what is left is the host work around it:
metadata, checks, params, backend choice. Layer 1 of a batch builds the batch's state; layers
2..16 should find it.

    python scripts/bench_attention_host.py [--steps 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

import hf_varlen  # noqa: F401  (registers varlen_packed)
from hf_varlen.backends import registry
from hf_varlen.integrations import transformers as integration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="batches (the first 10 warm up)")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="varlen_packed")
    lengths = [40, 30, 58]
    total = sum(lengths)
    cu = torch.tensor([0, 40, 70, 128], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    calls, inside = [], []

    def timed(*a, **kw):
        t0 = time.thread_time()
        out = integration.varlen_packed_forward(*a, **kw)
        calls.append(time.thread_time() - t0)
        return out

    spec = registry.get_spec("sdpa")

    def backend(*a):
        t0 = time.thread_time()
        out = spec.fn(*a)
        inside.append(time.thread_time() - t0)
        return out

    AttentionInterface.register("varlen_packed", timed)
    registry._REGISTRY["sdpa"] = dataclasses.replace(spec, fn=backend)
    per_batch = []
    for step in range(args.steps):
        batch = dict(
            input_ids=torch.randint(0, 64, (1, total)),
            position_ids=pos.clone(),
            cu_seq_lens_q=cu.clone(),  # new tensors per batch, as a collator gives them
            cu_seq_lens_k=cu.clone(),
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        )
        calls.clear()
        inside.clear()
        with torch.no_grad():
            model(**batch)
        if step >= 10:
            per_batch.append([c - i for c, i in zip(calls, inside)])
    first = statistics.median(b[0] for b in per_batch) * 1e6
    rest = statistics.median(x for b in per_batch for x in b[1:]) * 1e6
    print(f"host time per attention call, backend excluded: layer 1 {first:.1f} us, ", end="")
    print(f"layers 2..{cfg.num_hidden_layers} {rest:.1f} us (median of {len(per_batch)} batches)")


if __name__ == "__main__":
    main()
