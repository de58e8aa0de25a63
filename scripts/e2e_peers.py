"""The systems a user would pick instead of hf_varlen, run by bench_e2e beside its own modes.

Each peer mode runs in a worker process of its own (``python scripts/e2e_peers.py --serve``,
served by e2e_workers) in an environment of its own: the site directory named by the peer's
variable (``HF_VARLEN_PEER_SITE_UNSLOTH`` / ``HF_VARLEN_PEER_SITE_TRL``, a ``pip install
--target`` folder) comes first on ``PYTHONPATH``, followed only by this folder; without the
variable the worker keeps the parent's environment. Unsloth pins transformers <= 5.17 and
trl <= 1.15, so it cannot share a process, or a site directory, with hf_varlen's newer ones.
Nothing here imports hf_varlen.

Every peer trains the model that bench_e2e saved once (random init, ``save_pretrained``) from
that folder with ``local_files_only=True``, on the batches bench_e2e exported (the examples
hf_varlen's sampler gives each step, already tokenised, prompt labels -100), in the same order
(the trainer's sampler is sequential), with the same optimizer (AdamW, betas 0.9/0.999, eps 1e-8,
no weight decay, fused on CUDA, no 8-bit), the same constant learning rate without warm-up,
clipping at 1.0, no gradient accumulation and no gradient checkpointing, at the same max length.

    unsloth        Unsloth full fine-tuning, padding-free (FastLanguageModel, full_finetuning)
    unsloth-lora   Unsloth LoRA r=16, alpha 32, dropout 0 on every linear layer (as --lora)
    unsloth-qlora  the same over a 4-bit NF4 base (load_in_4bit; needs bitsandbytes)
    trl-sdpa       TRL SFTTrainer(padding_free=True) on transformers' sdpa (the attention this
                   machine has without flash-attn; packed rows get a block-diagonal mask)
    trl-liger      trl-sdpa with use_liger_kernel=True (Liger's RoPE / SwiGLU / RMSNorm; TRL
                   keeps its own loss head)
    torch-sdpa     a plain PyTorch loop, no trainer, over the same padding-free rows on sdpa:
                   the reference a user could write by hand, and the CPU check of this whole
                   path (it needs neither CUDA nor a peer package)

Per cell (the same keys as bench_e2e's own cells): real tokens/s over the steps after the
warm-up (the warm-up, the compile included, is left out and reported as ``warmup_s``; the
import and model load as ``import_s`` / ``load_s``), peak memory, the per-step losses, and from
one profiled step after the timed ones the GPU-busy share and the attention kernels that really
ran; Unsloth adds its packed-attention counters and the backend its dispatcher picks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent

# The variables naming each peer system's site directory (a `pip install --target` folder).
PEER_SITES = {"unsloth": "HF_VARLEN_PEER_SITE_UNSLOTH", "trl": "HF_VARLEN_PEER_SITE_TRL"}
PEERS: dict[str, dict] = {
    "unsloth": dict(system="unsloth"),
    "unsloth-lora": dict(system="unsloth", lora=True),
    "unsloth-qlora": dict(system="unsloth", lora=True, load_in_4bit=True),
    "trl-sdpa": dict(system="trl"),
    "trl-liger": dict(system="trl", liger=True),
    "torch-sdpa": dict(system="torch"),
}
# No network on the GPU machine: every library reads local files only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
UNSLOTH_ENV = {
    "UNSLOTH_DISABLE_STATISTICS": "1",  # no usage report (no network)
    "UNSLOTH_PADDING_CHOICE": "padding_free",  # never its padded + per-block-compile choice
    "UNSLOTH_FLASH_ATTENTION_IMPL": "off",  # torch's bundled kernels, as our minimal floor
    "UNSLOTH_ENABLE_LOGGING": "1",  # its choices in the worker log
}
# As hf-varlen train --lora: r 16, alpha 32, dropout 0, every linear layer but the LM head.
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, bias="none")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETAS, EPS = (0.9, 0.999), 1e-8  # hf_varlen.training.builders' AdamW


def peer_env(mode: str, environ: dict[str, str], compile_dir: str) -> dict[str, str]:
    """The worker's environment for ``mode``: the offline switches, the peer's own switches, and
    ``PYTHONPATH`` = its site directory + this folder when the peer's variable names one (the
    parent's PYTHONPATH, which holds hf_varlen's newer transformers, is left out then)."""
    system = PEERS[mode]["system"]
    env = {**environ, **OFFLINE_ENV}
    site = environ.get(PEER_SITES.get(system, ""), "")
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, str(SCRIPTS)])
    if system == "unsloth":
        env.update(UNSLOTH_ENV)
        env["UNSLOTH_COMPILE_LOCATION"] = compile_dir  # its generated code: a writable folder
    return env


def peer_command(python: str = sys.executable) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--serve"]


def unavailable(mode: str, cuda: bool) -> str | None:
    """Why ``mode`` cannot run in this process's environment, or None."""
    spec = PEERS[mode]
    system = spec["system"]
    var = PEER_SITES.get(system)
    site = os.environ.get(var, "") if var else ""
    where = f" (site {site})" if site else (f" (no {var})" if var else "")
    needs = {"unsloth": ["unsloth", "trl", "datasets"], "trl": ["trl", "datasets"]}.get(system, [])
    needs += ["liger_kernel"] if spec.get("liger") else []
    needs += ["peft"] if spec.get("lora") else []
    needs += ["bitsandbytes"] if spec.get("load_in_4bit") else []
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not installed{where}"
    if not cuda and (system == "unsloth" or spec.get("liger")):
        return f"{mode} needs CUDA"
    return None


def read_batches(path: str, n: int) -> list[list[dict]]:
    """The first ``n`` batches of the file bench_e2e exported: one JSON list of examples
    ({"input_ids": [...], "labels": [...]}) per line, in training order."""
    batches = []
    with open(path) as f:
        for line in f:
            if len(batches) == n:
                break
            batches.append(json.loads(line))
    if len(batches) < n:
        raise ValueError(f"{path}: {len(batches)} batches, the run needs {n}")
    return batches


# --------------------------------------------------------------------------------------------- #
# Timing and the profiled step (shared by every peer).


class StepClock:
    """Begin-to-begin step times (the device synchronised at each begin), so a step's time holds
    all the host work between two optimizer steps (a trainer's logging and loss read included,
    as hf_varlen's step time holds its own loss read). ``begin(i)`` before step i, ``end()``
    after the last one."""

    def __init__(self, sync):
        self.sync = sync
        self.starts: list[float] = []

    def begin(self) -> None:
        self.sync()
        self.starts.append(time.perf_counter())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def profiled(fn, cuda: bool) -> dict:
    """Run ``fn`` (one training step), on CUDA under bench_common's ``busy_share``: the GPU-busy
    share and the attention kernels that ran."""
    if not cuda:
        fn()
        return {}
    from bench_common import busy_share

    return busy_share(fn)


def summarize(run: dict, batches, times: list[float], losses: list[float], extra: dict) -> dict:
    """A cell's result from the timed steps (the ones after ``run["warmup"]``)."""
    tokens = [sum(len(ex["input_ids"]) for ex in b) for b in batches]
    w = run["warmup"]
    steady_s = sum(times[w:])
    step = steady_s / len(times[w:])
    return {
        "status": "ok",
        "tokens_per_s": sum(tokens[w : len(times)]) / steady_s,
        "tokens_per_step": sum(tokens[w : len(times)]) / len(times[w:]),
        "step_ms": 1e3 * step,
        "first_step_s": times[0],
        "warmup_s": sum(times[:w]),
        "warmup_excess_s": sum(max(0.0, t - step) for t in times[:w]),  # compile, mostly
        "excluded_steps": 0,
        "padding_efficiency": 1.0,  # padding-free rows
        "losses": losses[: len(times)],
        "elapsed": [sum(times[: i + 1]) for i in range(len(times))],
        "mfu": None,
        **extra,
    }


# --------------------------------------------------------------------------------------------- #
# The peers.


def _versions(*dists: str) -> dict:
    import importlib.metadata

    out = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = "not installed"
    return out


def _dtype(run: dict, cuda: bool):
    import torch

    return torch.bfloat16 if cuda and run["precision"] == "bf16" else torch.float32


def sft_settings(run: dict, steps: int, cuda: bool, **extra) -> dict:
    """SFTConfig arguments that pin every setting the benchmark compares on, Unsloth's changed
    defaults (adamw_8bit, batch 4 x accumulation 2, torch_empty_cache_steps 250, its offloading
    gradient checkpointing) included."""
    return dict(
        output_dir=str(Path(run["run_dir"]) / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=run["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=run["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        max_grad_norm=1.0,
        bf16=cuda and run["precision"] == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        torch_empty_cache_steps=None,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        seed=run["seed"],
        data_seed=run["seed"],
        dataloader_num_workers=0,
        dataloader_drop_last=False,
        train_sampling_strategy="sequential",  # the exported order, unshuffled
        # The exported examples are already cut to run["max_length"] (hf_varlen's tokenizer);
        # TRL refuses a max_length it would not enforce under padding_free without packing.
        max_length=None,
        padding_free=True,
        packing=False,
        disable_tqdm=True,
        **extra,
    )


def _trainer_run(trainer_cls, config_cls, model, tokenizer, run, batches, cuda, **extra) -> dict:
    """Train with a (TRL or Unsloth) SFTTrainer over ``batches`` in order; the last batch is the
    profiled step, after the timed ones."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = StepClock(sync)
    losses: list[float] = []
    prof: dict = {}
    last = len(batches) - 1

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin()
            if state.global_step == last and cuda:
                prof["profiler"] = _start_profiler()

        def on_step_end(self, args, state, control, **kw):
            if "profiler" in prof:
                prof.update(_stop_profiler(prof.pop("profiler"), clock.starts[-1]))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    settings = sft_settings(run, len(batches), cuda, **extra)
    known = set(getattr(config_cls, "__dataclass_fields__", settings))
    missing = sorted(set(settings) - known)
    if missing:  # an older TRL: the comparison would not hold (e.g. a shuffled order)
        raise ValueError(f"{config_cls.__name__} lacks {missing}: cannot pin these settings")
    rows = [ex for b in batches for ex in b]
    if any(len(b) != run["batch_size"] for b in batches):
        raise ValueError("an exported batch is not --batch-size examples: no sequential match")
    trainer = trainer_cls(
        model=model,
        args=config_cls(**settings),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Watch()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    clock.begin()  # closes the last step
    times = clock.times()[:last]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return summarize(run, batches[:last], times, losses, {"peak_gib": peak, **prof})


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    p = profile(activities=[ProfilerActivity.CUDA])
    p.__enter__()
    return p


def _stop_profiler(p, t0: float) -> dict:
    import torch
    from bench_common import attention_kernels, device_kernel_seconds

    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    p.__exit__(None, None, None)
    return {
        "gpu_busy": device_kernel_seconds(p) / wall,
        "busy_step_ms": 1e3 * wall,
        "attention_kernels": attention_kernels(p),
    }


def run_unsloth(run: dict, batches, cuda: bool) -> dict:
    spec = PEERS[run["mode"]]
    t0 = time.perf_counter()
    import unsloth  # first: it patches transformers / TRL as it imports
    from unsloth import FastLanguageModel

    import_s = time.perf_counter() - t0
    from trl import SFTConfig, SFTTrainer

    t0 = time.perf_counter()
    four_bit = bool(spec.get("load_in_4bit"))
    # Unsloth's load_in_4bit defaults to True: every precision flag is spelled out (16-bit LoRA
    # needs its explicit load_in_16bit).
    extra = {"load_in_16bit": True} if spec.get("lora") and not four_bit else {}
    model, tokenizer = FastLanguageModel.from_pretrained(
        run["model_dir"],
        max_seq_length=run["max_length"],
        dtype=_dtype(run, cuda),
        load_in_4bit=four_bit,
        **extra,
        full_finetuning=not spec.get("lora"),
        use_gradient_checkpointing=False,
        local_files_only=True,
    )
    if spec.get("lora"):
        model = FastLanguageModel.get_peft_model(
            model,
            target_modules=LORA_TARGETS,
            use_gradient_checkpointing=False,
            random_state=run["seed"],
            **LORA,
        )
    load_s = time.perf_counter() - t0
    result = _trainer_run(SFTTrainer, SFTConfig, model, tokenizer, run, batches, cuda)
    stats = _unsloth_attention()
    return {
        **result,
        "import_s": import_s,
        "load_s": load_s,
        **stats,
        "kernels": f"unsloth {getattr(unsloth, '__version__', '?')}: {stats['attention']}",
        "versions": _versions("unsloth", "unsloth_zoo", "trl", "transformers", "torch", "peft"),
        "precision_policy": _policy(run, cuda, spec),
        "params": _params(model),
    }


def _unsloth_attention() -> dict:
    """Unsloth's own record of its attention: the packed-attention counters of its HF path
    (full fine-tuning: ``fast`` = varlen calls, ``compiled`` = its compiled per-layer blocks,
    ``fallback`` = dense SDPA) and the backend its dispatcher picks for packed rows (LoRA path)."""
    out: dict = {}
    try:
        from unsloth.utils.hf_packed_attention import HF_PACKED_ATTENTION_STATS

        out["unsloth_packed_attention"] = dict(HF_PACKED_ATTENTION_STATS)
    except ImportError as exc:
        out["unsloth_packed_attention"] = f"not readable: {exc}"
    try:
        from unsloth.utils import attention_dispatch as d

        out["unsloth_dispatch"] = {
            "packed_backend": d.select_attention_backend(use_varlen=True),
            "torch_varlen_loaded": getattr(d, "_TORCH_VARLEN_ATTN", None) is not None,
        }
    except (ImportError, AttributeError) as exc:
        out["unsloth_dispatch"] = f"not readable: {exc}"
    counts = out["unsloth_packed_attention"]
    if isinstance(counts, dict) and any(counts.values()):
        out["attention"] = (
            "varlen (fast path)"
            if counts.get("fast")
            else "compiled per-layer blocks"
            if counts.get("compiled")
            else "dense SDPA fallback"
        ) + f" {counts}"
    else:
        out["attention"] = f"its own forward, dispatcher: {out['unsloth_dispatch']}"
    return out


def run_trl(run: dict, batches, cuda: bool) -> dict:
    spec = PEERS[run["mode"]]
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        run["model_dir"], dtype=_dtype(run, cuda), attn_implementation="sdpa",
        local_files_only=True,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(run["model_dir"], local_files_only=True)
    if cuda:
        model = model.cuda()
    load_s = time.perf_counter() - t0
    extra = {"use_liger_kernel": True} if spec.get("liger") else {}
    result = _trainer_run(SFTTrainer, SFTConfig, model, tokenizer, run, batches, cuda, **extra)
    attn = "sdpa (transformers' block-diagonal mask from position_ids)"
    return {
        **result,
        "import_s": import_s,
        "load_s": load_s,
        "attention": attn,
        "kernels": attn + (" + Liger rope/swiglu/rmsnorm" if spec.get("liger") else ""),
        "versions": _versions("trl", "transformers", "torch", "liger-kernel", "datasets"),
        "precision_policy": _policy(run, cuda, spec),
        "params": _params(model),
    }


def run_torch(run: dict, batches, cuda: bool) -> dict:
    """The plain loop: each batch as one padding-free row (position_ids restart per example, the
    first label of each example -100), HF sdpa, torch AdamW, clipping, the same settings."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        run["model_dir"], dtype=_dtype(run, cuda), attn_implementation="sdpa",
        local_files_only=True,
    )  # fmt: skip
    device = "cuda" if cuda else "cpu"
    model.to(device).train()
    load_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=run["lr"], betas=BETAS, eps=EPS, weight_decay=0.0,
                            fused=cuda)  # fmt: skip
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = StepClock(sync)
    losses: list[float] = []

    def step(batch) -> None:
        ids = torch.tensor([i for ex in batch for i in ex["input_ids"]], device=device)[None]
        pos = torch.cat([torch.arange(len(ex["input_ids"])) for ex in batch]).to(device)[None]
        labels = torch.tensor([t for ex in batch for t in ex["labels"]], device=device)[None]
        labels = labels.masked_fill(pos == 0, -100)  # no target across examples
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for b in batches[:-1]:
        clock.begin()
        step(b)
    clock.begin()
    prof = profiled(lambda: step(batches[-1]), cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    attn = "sdpa (transformers' block-diagonal mask from position_ids)"
    return {
        **summarize(run, batches[:-1], clock.times(), losses, {"peak_gib": peak, **prof}),
        "load_s": load_s,
        "attention": attn,
        "kernels": attn,
        "versions": _versions("transformers", "torch"),
        "precision_policy": _policy(run, cuda, PEERS[run["mode"]]),
        "params": _params(model),
    }


def _policy(run: dict, cuda: bool, spec: dict) -> str:
    weights = "bf16 weights and math" if cuda and run["precision"] == "bf16" else "fp32"
    if spec.get("load_in_4bit"):
        weights = "NF4 base, bf16 compute"
    return weights + ("; LoRA adapters as peft creates them" if spec.get("lora") else "")


def _params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    return {
        "total": total,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


RUNNERS = {"unsloth": run_unsloth, "trl": run_trl, "torch": run_torch}


def run_one(run: dict, fresh_dynamo: bool = True) -> dict:
    """One peer cell in this (the peer's own) process: ``status`` "ok", "OOM" or "skipped: why"."""
    import torch

    cuda = torch.cuda.is_available()
    if why := unavailable(run["mode"], cuda):
        return {"status": f"skipped: {why}"}
    batches = read_batches(run["batches_path"], run["steps"] + 1)  # + the profiled step
    try:
        return RUNNERS[PEERS[run["mode"]]["system"]](run, batches, cuda)
    except torch.OutOfMemoryError:
        return {"status": "OOM"}


def main(argv: list[str]) -> None:
    if argv[:1] != ["--serve"]:
        raise SystemExit("usage: e2e_peers.py --serve  (a worker of bench_e2e)")
    sys.path.insert(0, str(SCRIPTS))
    from e2e_workers import serve

    serve(run_one)


if __name__ == "__main__":
    main(sys.argv[1:])
