"""TRL ``SFTTrainer`` on packed, padding-free batches with ``attn_implementation="varlen_packed"``.

Needs: the ``trl`` extra (``pip install 'hf_varlen[trl]'``: TRL and ``datasets``). By default it
runs offline: a tiny random-init Llama, the built-in byte tokenizer and hf_varlen's built-in demo
instructions (no downloads, about a minute on 2 CPU cores). ``--model`` / ``--tokenizer`` /
``--dataset`` take your own local folders and files, or Hub ids (those need the network once).

TRL refuses a custom collator in its padding-free modes, so nothing of hf_varlen's data path is
used here: TRL's own ``DataCollatorForLanguageModeling(padding_free=True)`` flattens each batch to
one ``[1, T]`` row and, from TRL 1.16 on, also passes ``cu_seq_lens_q/k`` + ``max_length_q/k``;
``varlen_packed`` reads them (or, with older TRL, derives the documents from ``position_ids``).
``import hf_varlen`` is all the registration needed.

Modes (``--mode``):
    padding_free   SFTConfig(padding_free=True, max_length=None): each batch of examples flattened
    bfd            SFTConfig(packing=True, packing_strategy="bfd"): examples bin-packed into rows
                   of max_length tokens, then flattened (padding-free too)
    position_ids   padding_free, but the batch keeps only position_ids (what TRL <= 1.15 sends)
    padded         the unpacked reference: padded batches + attention_mask, attention "sdpa"

Mixed precision is TRL's default (``bf16=True``: bf16 autocast over fp32 weights, on CPU too;
``--no-bf16`` for fp32). Hub models are loaded in fp32, as TRL users load them.

``--fused-loss`` trains with ``hf_varlen.integrations.trainers.VarlenSFTTrainer``: the same SFTTrainer,
but the loss is hf_varlen's fused linear cross-entropy instead of TRL's fused LM head (no
``entropy`` / ``mean_token_accuracy`` in the logs; see that module).

    python examples/trl_sft.py                                   # offline: tiny model, demo data
    python examples/trl_sft.py --dataset my_alpaca.json --mode bfd --max-steps 20 --fused-loss
    python examples/trl_sft.py --model Qwen/Qwen2.5-0.5B --dataset tatsu-lab/alpaca \\
        --mode padding_free --batch-size 16 --max-length 1024 --fused-loss   # network, GPU

With a real tokenizer the tiny model has the tokenizer's vocabulary (151,936 entries for Qwen2's),
so its LM head dominates on a CPU: the defaults keep a step small (4 examples, or 4 rows of up to
128 tokens), and ``--fused-loss`` is the faster loss there. With the same examples in one step,
every mode gives the same per-token loss (tests/integrations/test_trl.py), and ``--fused-loss``
the same loss as TRL's head (tests/integrations/test_trl_fused_loss.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os

try:  # first: without the extra this says so at once, in one line rather than a traceback
    from datasets import Dataset, load_dataset
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:
    raise SystemExit(
        f"examples/trl_sft.py needs TRL and datasets ({exc.name} is missing): "
        "pip install 'hf_varlen[trl]'"
    ) from None

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_varlen
from hf_varlen.integrations.trainers import VarlenSFTTrainer
from hf_varlen.training.builtin import builtin_records, byte_tokenizer

MODES = ("padding_free", "bfd", "position_ids", "padded")
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def alpaca_dataset(path_or_id: str, n: int | None = None) -> Dataset:
    """Alpaca records (instruction / input / output) as TRL prompt-completion pairs: "builtin"
    (hf_varlen's demo instructions, offline), a local .json / .jsonl file, or a Hub dataset id."""
    if path_or_id == "builtin":
        records = builtin_records(n or 512)
    elif os.path.exists(path_or_id):
        with open(path_or_id, encoding="utf-8") as fh:
            if path_or_id.endswith(".jsonl"):
                records = [json.loads(line) for line in fh if line.strip()]
            else:
                records = json.load(fh)
    else:
        records = load_dataset(path_or_id, split="train").to_list()
    records = records[:n] if n else records

    def pair(r):
        extra = f"### Input:\n{r['input']}\n\n" if r.get("input") else ""
        prompt = f"### Instruction:\n{r['instruction']}\n\n{extra}### Response:\n"
        return {"prompt": prompt, "completion": r["output"]}

    return Dataset.from_list([pair(r) for r in records])


def tiny_llama(vocab_size: int, attn: str, seed: int = 0):
    """A random-init 2-layer Llama (hidden 64, GQA 4/2) for CPU runs and tests."""
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def load_model(name: str, tokenizer, mode: str, seed: int = 0):
    attn = "sdpa" if mode == "padded" else hf_varlen.ATTN_IMPLEMENTATION
    if name == "tiny-llama":
        return tiny_llama(len(tokenizer), attn, seed)
    # fp32 weights: TRL's bf16=True then autocasts the compute (the master weights stay fp32).
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation=attn, dtype=torch.float32
    )
    model.config.use_cache = False
    return model


class _PositionIdsOnly:
    """Wraps TRL's collator and drops the packed-sequence kwargs: the TRL <= 1.15 input style."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        for key in PACKED_KEYS:
            batch.pop(key, None)
        return batch


def make_trainer(
    model,
    tokenizer,
    dataset: Dataset,
    mode: str,
    output_dir: str,
    fused_loss: bool = False,
    max_length: int = 1024,
    fused_cross_entropy_kwargs: dict | None = None,
    **config,
) -> SFTTrainer:
    """An SFTTrainer in ``mode`` (see the module docstring); ``config`` overrides SFTConfig fields.

    ``fused_loss``: a ``VarlenSFTTrainer`` (hf_varlen's fused cross-entropy as the loss), with
    ``fused_cross_entropy_kwargs`` (``install_fused_cross_entropy`` options) when given.
    ``max_length``: bfd row length and padded truncation (padding-free modes never truncate).
    Mixed precision is SFTConfig's default (bf16=True) unless ``config`` sets ``bf16``."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    args = dict(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=not torch.cuda.is_available(),
        padding_free=mode in ("padding_free", "position_ids"),
        packing=mode == "bfd",
        packing_strategy="bfd",
        # TRL refuses padding_free without packing when max_length is set (it would truncate).
        max_length=None if mode in ("padding_free", "position_ids") else max_length,
    )
    args.update(config)
    if fused_cross_entropy_kwargs is not None and not fused_loss:
        raise ValueError("fused_cross_entropy_kwargs: only used with fused_loss=True")
    extra = {}
    if fused_loss:
        trainer_cls = VarlenSFTTrainer
        extra["fused_cross_entropy_kwargs"] = fused_cross_entropy_kwargs
    else:
        trainer_cls = SFTTrainer
    trainer = trainer_cls(
        model=model,
        args=SFTConfig(**args),
        train_dataset=dataset,
        processing_class=tokenizer,
        **extra,
    )
    if mode == "position_ids":
        # Set after construction: TRL checks only the constructor's data_collator argument.
        trainer.data_collator = _PositionIdsOnly(trainer.data_collator)
    return trainer


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="hub id, local dir, or tiny-llama")
    p.add_argument(
        "--tokenizer", default=None, help="default: the model's (the byte tokenizer for tiny-llama)"
    )
    p.add_argument(
        "--dataset",
        default="builtin",
        help="builtin (offline demo data), an alpaca-style .json/.jsonl file, or a Hub id",
    )
    p.add_argument("--examples", type=int, default=512, help="use the first N examples")
    p.add_argument("--mode", choices=MODES, default="padding_free")
    p.add_argument("--batch-size", type=int, default=4, help="examples (bfd: packed rows) per step")
    p.add_argument(
        "--max-length",
        type=int,
        default=128,
        help="bfd row length and padded truncation (padding-free modes keep whole examples)",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's default mixed precision (bf16 autocast over fp32 weights); --no-bf16: fp32",
    )
    p.add_argument(
        "--fused-loss",
        action="store_true",
        help="hf_varlen's fused linear cross-entropy as the loss (VarlenSFTTrainer)",
    )
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 tiny-llama, else 2e-5")
    p.add_argument("--output-dir", default="runs/trl_sft")
    args = p.parse_args(argv)

    if args.tokenizer is None and args.model == "tiny-llama":
        tokenizer = byte_tokenizer()  # offline: no tokenizer download for the tiny model
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    model = load_model(args.model, tokenizer, args.mode)
    lr = args.lr or (1e-3 if args.model == "tiny-llama" else 2e-5)
    trainer = make_trainer(
        model,
        tokenizer,
        alpaca_dataset(args.dataset, args.examples),
        args.mode,
        args.output_dir,
        fused_loss=args.fused_loss,
        max_length=args.max_length,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=lr,
        bf16=args.bf16,
    )
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    loss_name = "hf_varlen fused CE" if args.fused_loss else "TRL fused LM head"
    print(
        f"{args.mode}: attn {model.config._attn_implementation}, loss {loss_name}, "
        f"bf16 {args.bf16}, {len(losses)} steps, loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f}, {result.metrics['train_runtime']:.1f} s"
    )
    assert all(math.isfinite(x) for x in losses)
    return result.metrics


if __name__ == "__main__":
    main()
