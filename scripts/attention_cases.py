"""Attention benchmark cases: packs of real document lengths (shared alpaca / lima data), the head
configs, and what a case costs at least (useful FLOPs, HBM-traffic floor).

``scripts/data/lengths_{alpaca,lima}.json`` hold the token counts of every example (Qwen2 tokenizer,
the alpaca prompt format of ../shared/data/README.md, no special tokens), so the GPU machine, which
has no copy of ../shared, needs no data. ``make_lengths`` regenerates them.
"""

from __future__ import annotations

import json
from pathlib import Path

LENGTHS_DIR = Path(__file__).resolve().parent / "data"
HEADS = {
    "32/8/128": (32, 8, 128),
    "16/16/64": (16, 16, 64),
    "32/8/64": (32, 8, 64),  # GQA at head dim 64 (Llama-3.2-1B)
    "40/8/128": (40, 8, 128),
    "16/8/256": (16, 8, 256),  # head dim 256 (Gemma 2/3), where a backend supports it
}
HBM_BYTES_PER_S = 4.3e12


def useful_flops_fwd(lengths, h_q, d) -> float:
    """Causal forward FLOPs inside the documents: sum of 4 * L^2 * D * H_q / 2."""
    return sum(4.0 * n * n * d * h_q / 2 for n in lengths)


def floor_ms(total, h_q, h_kv, d, elem=2) -> tuple[float, float]:
    """HBM-traffic bound (forward, forward+backward) in ms: read q, k, v, write o; the backward
    reads q, k, v, o, dO and writes dq, dk, dv."""
    q, kv = total * h_q * d * elem, total * h_kv * d * elem
    fwd = 2 * q + 2 * kv
    bwd = 4 * q + 4 * kv
    return fwd / HBM_BYTES_PER_S * 1e3, (fwd + bwd) / HBM_BYTES_PER_S * 1e3


def alpaca_text(ex: dict) -> str:
    """The alpaca prompt format of ../shared/data/README.md (no preamble, no special tokens)."""
    if ex.get("input"):
        return (
            f"### Instruction:\n{ex['instruction']}\n\n### Input:\n{ex['input']}\n\n"
            f"### Response:\n{ex['output']}"
        )
    return f"### Instruction:\n{ex['instruction']}\n\n### Response:\n{ex['output']}"


def make_lengths(shared_data: Path) -> None:
    """Tokenize alpaca_5000 and lima with the Qwen2 tokenizer; write scripts/data/lengths_*.json."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shared_data / "tokenizers" / "qwen2"))
    LENGTHS_DIR.mkdir(exist_ok=True)
    for name, rel in (("alpaca", "alpaca/alpaca_5000.json"), ("lima", "lima/lima.json")):
        data = json.loads((shared_data / rel).read_text(encoding="utf-8"))
        texts = [alpaca_text(ex) for ex in data]
        lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
        (LENGTHS_DIR / f"lengths_{name}.json").write_text(json.dumps(lengths) + "\n")
        s = sorted(lengths)
        print(f"{name}: {len(s)} docs, median {s[len(s) // 2]}, max {s[-1]}, total {sum(s)}")


def load_lengths(name: str) -> list[int]:
    path = LENGTHS_DIR / f"lengths_{name}.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run with --make-lengths --shared-data <path> first")
    return json.loads(path.read_text())


def pack(lengths: list[int], total: int) -> list[int]:
    """Documents in dataset order until ``total`` tokens; the last one is cut to fit exactly."""
    out, used = [], 0
    for n in lengths:
        n = min(n, total - used)
        out.append(n)
        used += n
        if used == total:
            return out
    raise ValueError(f"not enough documents for {total} tokens")


def cases() -> dict[str, list[int]]:
    alpaca, lima = load_lengths("alpaca"), load_lengths("lima")
    return {
        "alpaca16k": pack(alpaca, 16384),
        "alpaca64k": pack(alpaca, 65536),
        "lima64k": pack(lima, 65536),
        "128+128+4096": [128, 128, 4096],
        "32k+alpaca32k": [32768] + pack(alpaca, 32768),
        "8x8k": [8192] * 8,
        "128k": [131072],  # one long-context document (the FA4 parity target of issue 16)
    }


# Where "auto" should switch from our kernel to FA4 (backends/registry.py LONG_DOCUMENT_TOKENS): 64K
# packs of one document length, and short alpaca packs holding one longer document (the rule sees
# only the longest document, so these tell what it costs the mostly-short packs it also moves).
CROSSOVER_LENGTHS = (256, 512, 1024, 2048, 4096)


def crossover_cases() -> dict[str, list[int]]:
    alpaca = load_lengths("alpaca")
    out = {f"64k_of_{n}": [n] * (65536 // n) for n in CROSSOVER_LENGTHS}
    for n in (1024, 4096, 8192):
        out[f"{n // 1024}k+alpaca"] = [n] + pack(alpaca, 65536 - n)
    return out
