"""The stock Hugging Face ``Trainer`` on packed, padding-free batches via ``hf_varlen.PackingCollator``.

Each batch of ``per_device_train_batch_size`` examples becomes one ``[1, T]`` row with
``cu_seq_lens_q/k`` and ``max_length_q/k``; ``attn_implementation="varlen_packed"`` keeps every
example's attention inside the example, so the loss equals the padded batch's, without the padding.
The Trainer normalises the loss by the label-token count of the whole step (all accumulation
micro-batches and ranks: ``average_tokens_across_devices``), and the collator masks every
example's first label, so no token is trained to predict across an example boundary. The loss is
hf_varlen's fused linear cross-entropy where ``hf-varlen train`` would use it (``--fused-loss``).

Needs: the base install only. By default it runs offline: a tiny random-init Llama, the built-in
byte tokenizer and the built-in demo instructions (no downloads; about a minute on 2 CPU cores).
Your own data is a local alpaca / chat / text .json, .jsonl or .parquet file; a Hub model or
dataset id needs the network once (and a Hub dataset the ``datasets`` package:
``pip install 'hf_varlen[trl]'`` brings it).

    python examples/hf_trainer.py                                  # offline: tiny model, demo data
    python examples/hf_trainer.py --dataset my_alpaca.json --tokenizer ./my-tokenizer \\
        --batch-size 8 --max-steps 20                              # your own files
    python examples/hf_trainer.py --model Qwen/Qwen2.5-0.5B --dataset tatsu-lab/alpaca  # network

(``hf-varlen train`` does the same with token-budget batches balanced across ranks.)
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hf_varlen
from hf_varlen import PackingCollator
from hf_varlen.training import TrainConfig
from hf_varlen.training.builtin import byte_tokenizer
from hf_varlen.training.data import detect_format, load_records, tokenize
from hf_varlen.training.model import build_model
from hf_varlen.training.model_kernels import fused_loss_choice


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="hub id, local dir, or a preset")
    p.add_argument("--tokenizer", default=None, help="default: the model's (bytes for presets)")
    p.add_argument("--dataset", default="builtin", help="builtin, .json/.jsonl/.parquet, hub id")
    p.add_argument("--examples", type=int, default=1024)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16, help="examples packed into one row")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 for presets, else 2e-5")
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument(
        "--fused-loss",
        choices=("auto", "on", "off"),
        default="auto",
        help="hf_varlen's fused linear cross-entropy (no [tokens, vocab] logits); auto: as "
        "`hf-varlen train` (on with CUDA or on the CPU)",
    )
    args = p.parse_args(argv)

    # Data: alpaca/chat/text records -> input_ids + labels (prompt tokens masked with -100).
    cfg = TrainConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dataset=args.dataset,
        max_examples=args.examples,
        max_length=args.max_length,
        tokens_per_batch=args.max_length,
    )
    if args.tokenizer in (None, "bytes") and args.model.startswith(("tiny-", "llama-1b")):
        tokenizer = byte_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    records = load_records(args.dataset, cfg)
    examples = tokenize(records, detect_format(records, cfg, args.dataset), tokenizer, cfg)
    train_dataset = [
        {"input_ids": ids.tolist(), "labels": lab.tolist()}
        for ids, lab in zip(examples.input_ids, examples.labels, strict=True)
    ]

    # Model: the one argument that matters is attn_implementation.
    if args.model.startswith(("tiny-", "llama-1b")):
        model = build_model(cfg, tokenizer, "fp32")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model,
            attn_implementation=hf_varlen.ATTN_IMPLEMENTATION,
            dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
        )
    model.config.use_cache = False
    # The Trainer passes num_items_in_batch, so the fused loss gives the same per-token mean.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fused, why = fused_loss_choice(
        TrainConfig(fused_loss=args.fused_loss), device, model.config.vocab_size
    )
    if fused:
        hf_varlen.install_fused_cross_entropy(model)
    print(f"loss: {'hf_varlen fused linear cross-entropy' if fused else 'transformers'} ({why})")

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.max_steps,
            learning_rate=args.lr or (1e-3 if args.model.startswith("tiny-") else 2e-5),
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 20),
            logging_steps=min(5, args.max_steps),  # at least one logged loss
            save_strategy="no",
            report_to="none",
            remove_unused_columns=False,  # keep labels; the collator reads only what it needs
            use_cpu=not torch.cuda.is_available(),
            bf16=torch.cuda.is_available(),
        ),
        train_dataset=train_dataset,
        data_collator=PackingCollator(pad_token_id=pad),
    )
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        f"HF Trainer + PackingCollator ({model.config._attn_implementation}): "
        f"{result.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"{result.metrics['train_runtime']:.1f} s"
    )
    assert all(math.isfinite(x) for x in losses)
    return {"losses": losses, **result.metrics}


if __name__ == "__main__":
    main()
