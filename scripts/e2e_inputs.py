"""bench_e2e's inputs, shared by every mode and peer: the training data file of a ``--data``
name, the saved random-init model of a preset (one folder, so every mode and peer starts from the
same weights), the exact batches ``hf-varlen train`` trains on, exported for the peers, and the
data-only padding table (``--padding-only``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path


def prepare_dataset(name: str, args, out: Path) -> str:
    """Path of the training data: alpaca as is, or alpaca + lima shuffled into one file (mix)."""
    if name == "alpaca":
        return str(args.alpaca)
    if name == "mix":
        import random

        records = json.loads(Path(args.alpaca).read_text()) + json.loads(
            Path(args.lima).read_text()
        )
        records = [{k: r.get(k, "") for k in ("instruction", "input", "output")} for r in records]
        random.Random(0).shuffle(records)
        path = out / "alpaca_lima_mix.json"
        path.write_text(json.dumps(records))
        return str(path)
    return name  # any local file or hub dataset the trainer accepts


def prepare_model_dir(spec: dict) -> str:
    """Save the random-init model of ``spec`` (preset, layers, tokenizer, precision, seed) once to
    ``spec["dir"]`` with its tokenizer, for every mode and peer to load with
    ``local_files_only``: Unsloth has no ``from_config``, and one folder makes the initial
    weights identical everywhere (a preset's init on the GPU draws other numbers than on the
    host). A folder written for the same spec is reused."""
    import shutil

    import torch

    from hf_varlen.training import TrainConfig
    from hf_varlen.training.model import build_model, load_tokenizer

    out = Path(spec["dir"])
    marker = out / "bench_e2e_model.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return str(out)
    shutil.rmtree(out, ignore_errors=True)
    overrides = f"num_hidden_layers={spec['layers']}" if spec.get("layers") else None
    cfg = TrainConfig(
        model=spec["model"], tokenizer=spec["tokenizer"], config_overrides=overrides,
        attn_implementation="sdpa",  # saved in config.json: one every peer's transformers knows
    )  # fmt: skip
    tokenizer = load_tokenizer(cfg)
    torch.manual_seed(spec["seed"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(cfg, tokenizer, spec["precision"], device)
    model.save_pretrained(out)
    source = Path(spec["tokenizer"])
    if source.is_dir():  # the tokenizer's own files, readable by an older transformers too
        for f in source.iterdir():
            if f.is_file():
                shutil.copy(f, out / f.name)
    else:
        tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return str(out)


@functools.cache
def _examples(dataset: str, tokenizer: str, max_length: int, seed: int):
    from hf_varlen.training import TrainConfig
    from hf_varlen.training.data import detect_format, load_records, split_eval, tokenize
    from hf_varlen.training.model import load_tokenizer

    cfg = TrainConfig(  # the fields of train_config that shape the examples (builtin: the seed)
        tokenizer=tokenizer, dataset=dataset, format="alpaca", max_length=max_length, seed=seed
    )
    records = load_records(dataset, cfg)
    examples = tokenize(records, detect_format(records, cfg, dataset), load_tokenizer(cfg), cfg)
    return split_eval(examples, 0.0, seed)[0]


def trainer_batches(run: dict, n: int) -> list[list[dict]]:
    """The first ``n`` batches ``hf-varlen train`` trains on in ``run`` (its sampler: one
    process, shuffled with the seed, epoch 0): per batch its examples' input_ids and labels."""
    from hf_varlen.packing import ExampleCountBatchSampler

    ex = _examples(run["dataset"], run["tokenizer"], run["max_length"], run["seed"])
    sampler = ExampleCountBatchSampler(
        ex.lengths, run["batch_size"], shuffle=True, seed=run["seed"], num_replicas=1, rank=0
    )
    sampler.set_epoch(0)
    slots = list(sampler)
    if len(slots) < n:
        raise ValueError(f"{run['dataset']}: {len(slots)} batches of {run['batch_size']}, need {n}")
    return [
        [{"input_ids": ex.input_ids[i].tolist(), "labels": ex.labels[i].tolist()} for i in slot]
        for slot in slots[:n]
    ]


def export_batches(run: dict, cache: Path) -> str:
    """The batches file a peer trains on (e2e_peers.read_batches): the timed steps + the profiled
    one, one JSON list of examples per line. Written once per data, length, batch and seed."""
    n = run["steps"] + 1
    tok = Path(run["tokenizer"]).name
    name = f"{run['data']}_{tok}_L{run['max_length']}_B{run['batch_size']}_seed{run['seed']}_n{n}"
    path = cache / "batches" / f"{name}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(b) + "\n" for b in trainer_batches(run, n)))
        tmp.replace(path)
    return str(path)


def padding_rows(args, datasets: dict[str, str]) -> list[dict]:
    """Share of real tokens when B examples are padded to their longest one (data only)."""
    from hf_varlen.packing import ExampleCountBatchSampler
    from hf_varlen.training import TrainConfig
    from hf_varlen.training.data import detect_format, load_records, tokenize
    from hf_varlen.training.model import load_tokenizer

    rows = []
    for data, path in datasets.items():
        for max_length in args.max_lengths:
            cfg = TrainConfig(tokenizer=args.tokenizer, dataset=path, max_length=max_length)
            tok = load_tokenizer(cfg)
            records = load_records(path, cfg)
            examples = tokenize(records, detect_format(records, cfg, path), tok, cfg)
            for b in args.batch_sizes:
                stats = ExampleCountBatchSampler(examples.lengths, b, seed=args.seed).stats
                rows.append(
                    dict(
                        data=data,
                        max_length=max_length,
                        batch_size=b,
                        padded_efficiency=stats.padded_efficiency,
                        static_efficiency=stats.real_tokens / (len(examples) * max_length),
                        tokens_per_batch=stats.real_tokens / stats.num_batches,
                    )
                )
    return rows
