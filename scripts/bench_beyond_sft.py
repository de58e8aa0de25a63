"""Packed vs padded beyond SFT: DPO's and GRPO's log-prob passes, and a vision-language step.

One forward + backward of the pass each trainer runs, timed per batch of real data, in three modes:

    packed        hf_varlen: one packed row through varlen_packed (VarlenDPOTrainer /
                  VarlenGRPOTrainer's pass, MultimodalPackingCollator for the VLM)
    padded        the padded batch TRL builds, through varlen_packed (padding-mask path)
    padded_sdpa   the padded batch through sdpa (TRL's default attention)

Tasks (``--tasks``):

    dpo    chosen + rejected of alpaca pairs (the chosen answer and another example's answer as the
           rejected one), right-padded (TRL's DataCollatorForPreference layout); the policy pass
           with gradients, the reference pass without
    grpo   alpaca prompts left-padded + answers as completions right-padded (GRPO's layout); the
           policy log-prob pass with gradients
    vlm    a Qwen2.5-VL-shaped model (its text shape cut to --vlm-layers layers) on alpaca text with
           a synthetic image in every other example (grids of 16-32 patches a side)

Reports real tokens/s (median step after --warmup), peak memory and the per-step max relative
difference of the summed log-probs against padded_sdpa (a mode that disagrees is flagged).

    python scripts/bench_beyond_sft.py --tokenizer runs/shared/qwen2 \\
        --alpaca runs/shared/alpaca_5000.json --batch-sizes 8,32 --out out/beyond_sft
    python scripts/bench_beyond_sft.py --tiny --steps 2 --warmup 0   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import run_header  # noqa: E402

import hf_varlen  # noqa: E402, F401  (registers varlen_packed)

MODES = ("packed", "padded", "padded_sdpa")
TASKS = ("dpo", "grpo", "vlm")


def _alpaca(path: str | None, tokenizer, n: int, max_length: int, vocab: int, seed: int):
    """(prompt ids, answer ids) pairs: alpaca through the tokenizer, or random lengths (--tiny)."""
    g = torch.Generator().manual_seed(seed)
    if path is None:
        return [
            (torch.randint(3, vocab, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g),
             torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g))
            for _ in range(n)
        ]  # fmt: skip
    rows = json.loads(Path(path).read_text())[:n]
    pairs = []
    for r in rows:
        prompt = tokenizer(r["instruction"] + ("\n" + r["input"] if r.get("input") else ""))[
            "input_ids"
        ]
        answer = tokenizer(r["output"])["input_ids"]
        half = max_length // 2
        pairs.append(
            (
                torch.tensor(prompt[:half]),
                torch.tensor(answer[: max_length - min(len(prompt), half)]),
            )
        )
    return pairs


def _rows(seqs, scored, left: list[int] | None = None):
    """Padded (R, L) input_ids / attention_mask / labels; ``left[i]`` pads row i on the left."""
    length = max(len(s) + (left[i] if left else 0) for i, s in enumerate(seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, sc) in enumerate(zip(seqs, scored)):
        o = left[i] if left else 0
        ids[i, o : o + len(s)] = s
        mask[i, o : o + len(s)] = 1
        labels[i, o + sc : o + len(s)] = s[sc:]
    return ids, mask, labels


def dpo_batch(pairs, b: int, step: int):
    chosen = pairs[step * b : (step + 1) * b]
    rejected = [pairs[(step * b + i + 7) % len(pairs)][1] for i in range(b)]
    seqs = [torch.cat([p, a]) for p, a in chosen] + [
        torch.cat([p, r]) for (p, _), r in zip(chosen, rejected)
    ]
    scored = [len(p) for p, _ in chosen] * 2
    return _rows(seqs, scored)


def grpo_batch(pairs, b: int, step: int):
    batch = pairs[step * b : (step + 1) * b]
    p_len = max(len(p) for p, _ in batch)
    seqs = [torch.cat([p, a]) for p, a in batch]
    left = [p_len - len(p) for p, _ in batch]
    ids, mask, labels = _rows(seqs, [len(p) for p, _ in batch], left)
    return ids, mask, labels


def _model(args, attn: str, dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_varlen.training.builtin import PRESETS

    if args.tiny:
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    else:
        cfg = LlamaConfig(vocab_size=args.vocab, **PRESETS["llama-1b"][1])
    cfg.use_cache = False
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_text_task(args, task: str, mode: str, pairs, device, dtype) -> list[dict]:
    from hf_varlen.integrations.trainers.preference import PackedLogProbs

    attn = "sdpa" if mode == "padded_sdpa" else "varlen_packed"
    model = _model(args, attn, dtype, device)
    caller = PackedLogProbs(model) if mode == "packed" else model
    make = dpo_batch if task == "dpo" else grpo_batch
    records = []
    for b in args.batch_sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, sums, tokens = [], [], 0
        for step in range(args.warmup + args.steps):
            ids, mask, labels = (t.to(device) for t in make(pairs, b, step))
            _sync(device)
            t0 = time.perf_counter()
            out = caller(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            out.log_probs.sum().backward()
            if task == "dpo":  # the reference pass (the trained model stands in for it)
                with torch.no_grad():
                    caller(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            _sync(device)
            model.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens = int(mask.sum())
            sums.append(float(out.log_probs.detach().double().sum()))
        records.append(_record(task, mode, b, times, tokens, sums, device))
    return records


def _record(task, mode, b, times, tokens, sums, device) -> dict:
    med = statistics.median(times)
    return dict(
        task=task, mode=mode, batch=b, step_ms=med * 1e3, tokens_per_s=tokens / med,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        logp_sums=sums,
    )  # fmt: skip


def run_vlm(args, mode: str, pairs, device, dtype) -> list[dict]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from hf_varlen.multimodal import MultimodalPackingCollator

    img, vs, ve = args.vocab - 3, args.vocab - 2, args.vocab - 1
    if args.tiny:
        text = dict(
            vocab_size=args.vocab,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
        )
        vision = dict(
            depth=2,
            hidden_size=16,
            out_hidden_size=32,
            intermediate_size=24,
            num_heads=2,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=1,
            window_size=8,
            fullatt_block_indexes=[1],
        )
    else:  # Qwen2.5-VL-3B's text shape and vision tower, the text cut to --vlm-layers layers
        text = dict(
            vocab_size=args.vocab,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=args.vlm_layers,
            num_attention_heads=16,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [16, 24, 24],
                "rope_theta": 1e6,
            },
        )
        vision = dict(
            depth=32,
            hidden_size=1280,
            out_hidden_size=2048,
            intermediate_size=3420,
            num_heads=16,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        )
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=img,
                           vision_start_token_id=vs, vision_end_token_id=ve, video_token_id=0)  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.set_attn_implementation("sdpa" if mode == "padded_sdpa" else "varlen_packed")
    vc = cfg.vision_config
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    g = torch.Generator().manual_seed(args.seed)
    examples = []
    for i, (p, a) in enumerate(pairs):
        parts, ex = [p], {}
        if i % 2 == 0:
            h, w = (
                2 * int(torch.randint(1, 3 if args.tiny else 9, (2,), generator=g)[k])
                for k in range(2)
            )
            parts += [torch.tensor([vs]), torch.full((h * w // 4,), img), torch.tensor([ve])]
            ex = dict(
                pixel_values=torch.randn(h * w, patch_dim, generator=g),
                image_grid_thw=torch.tensor([[1, h, w]]),
            )
        ids = torch.cat(parts + [a])
        labels = ids.clone()
        labels[: len(ids) - len(a)] = -100
        examples.append(
            dict(input_ids=ids, labels=labels, mm_token_type_ids=(ids == img).long(), **ex)
        )
    collate = MultimodalPackingCollator(rope_index=model.model.get_rope_index)
    records = []
    for b in args.batch_sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, sums, tokens = [], [], 0
        for step in range(args.warmup + args.steps):
            chunk = examples[step * b : (step + 1) * b]
            batch = collate(chunk) if mode == "packed" else _padded_vlm(chunk)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].to(dtype)
            _sync(device)
            t0 = time.perf_counter()
            out = model(**batch, use_cache=False)
            out.loss.backward()
            _sync(device)
            model.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens = sum(len(e["input_ids"]) for e in chunk)
            sums.append(float(out.loss.detach()))
        records.append(_record("vlm", mode, b, times, tokens, sums, device))
    return records


def _padded_vlm(chunk):
    """The padded batch: right padding, the model computes its own multimodal positions."""
    length = max(len(e["input_ids"]) for e in chunk)
    out = {
        k: torch.zeros(len(chunk), length, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "mm_token_type_ids")
    }
    out["labels"] = torch.full((len(chunk), length), -100, dtype=torch.long)
    for i, e in enumerate(chunk):
        n = len(e["input_ids"])
        out["input_ids"][i, :n] = e["input_ids"]
        out["attention_mask"][i, :n] = 1
        out["mm_token_type_ids"][i, :n] = e["mm_token_type_ids"]
        out["labels"][i, :n] = e["labels"]
    pix = [e["pixel_values"] for e in chunk if "pixel_values" in e]
    if pix:
        out["pixel_values"] = torch.cat(pix)
        out["image_grid_thw"] = torch.cat(
            [e["image_grid_thw"] for e in chunk if "image_grid_thw" in e]
        )
    return out


def agreement(records: list[dict]) -> None:
    """Per task and batch: the max relative gap of each mode's per-step values to padded_sdpa's."""
    base = {(r["task"], r["batch"]): r["logp_sums"] for r in records if r["mode"] == "padded_sdpa"}
    for r in records:
        ref = base.get((r["task"], r["batch"]))
        if ref is None:
            r["max_rel_gap"] = None
            continue
        r["max_rel_gap"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["logp_sums"], ref))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--vlm-layers", type=int, default=4)
    p.add_argument("--tokenizer")
    p.add_argument("--alpaca")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny", action="store_true", help="tiny random models and data (CPU smoke run)"
    )
    p.add_argument("--out", default="out/beyond_sft")
    args = p.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.modes = args.modes.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for name, given, known in (("--tasks", args.tasks, TASKS), ("--modes", args.modes, MODES)):
        bad = [x for x in given if x not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; known: {list(known)}")
    if not args.tiny and not (args.tokenizer and args.alpaca):
        p.error("--tokenizer and --alpaca are needed unless --tiny")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = None
    args.vocab = 64
    if not args.tiny:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        args.vocab = len(tokenizer) + 3
    n = max(args.batch_sizes) * (args.steps + args.warmup) + 8
    pairs = _alpaca(
        None if args.tiny else args.alpaca, tokenizer, n, args.max_length, args.vocab - 3, args.seed
    )
    header = run_header(
        precision=str(dtype).removeprefix("torch."), steps=args.steps, warmup=args.warmup
    )
    print(json.dumps(header))
    records = []
    for task in args.tasks:
        for mode in args.modes:
            try:
                if task == "vlm":
                    recs = run_vlm(args, mode, pairs, device, dtype)
                else:
                    recs = run_text_task(args, task, mode, pairs, device, dtype)
            except torch.OutOfMemoryError:
                recs = [
                    dict(task=task, mode=mode, batch=b, oom=True, logp_sums=[])
                    for b in args.batch_sizes
                ]
                torch.cuda.empty_cache()
            records += recs
            for r in recs:
                if r.get("oom"):
                    print(f"{task} {mode} B{r['batch']}: OOM")
                else:
                    peak = "" if r["peak_gib"] is None else f", {r['peak_gib']:.1f} GiB"
                    print(
                        f"{task} {mode} B{r['batch']}: {r['tokens_per_s'] / 1e3:.2f}K tok/s, {r['step_ms']:.1f} ms{peak}"
                    )
    agreement(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(header=header, records=records), indent=1))
    for r in records:
        if r.get("max_rel_gap") is not None and r["max_rel_gap"] > 0.05:
            print(
                f"FLAG {r['task']} {r['mode']} B{r['batch']}: log-prob sums {r['max_rel_gap']:.3f} off padded_sdpa"
            )
    return records


if __name__ == "__main__":
    main()
