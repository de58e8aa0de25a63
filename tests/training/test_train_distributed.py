"""Two CPU processes (gloo) train exactly like one: `accelerate launch` on the real CLI.

The data is built so that ranks get different token counts (and so different label counts) at
every step, and an odd number of packs leaves rank 1 an empty slot in the last step of each epoch
(a dummy zero-loss micro-batch) and in the eval pass. With shuffling off, two processes with
gradient accumulation 1 see at step s exactly the packs one process sees with accumulation 2 (the
sampler deals consecutive packs of its fixed order to the ranks), so the per-token loss, the
gradient norm, the eval loss and, with SGD, the weights (w_T = w_0 - lr * sum of gradients) must
agree.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_varlen.packing import TokenBudgetBatchSampler

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 512
# Byte tokenizer, text format: a text of n - 1 characters is n tokens (with eos).
TRAIN_LENGTHS = [500, 450, 400, 300, 250, 90, 80, 40]
EVAL_LENGTHS = [480, 300, 250, 100]


def _texts(lengths):
    return [
        {"text": ("the quick brown fox jumps over the lazy dog " * 12)[: n - 1]} for n in lengths
    ]


# A launch of the trainer takes ~10 s. One that hangs (once in CI, in a 2-rank --resume launch)
# turns into a failure that names where each process was: a collective times out after
# DDP_TIMEOUT_S with an error on each rank, and failing that the watchdog (launch_watchdog/)
# dumps every process's stacks and ends it before LAUNCH_TIMEOUT_S.
LAUNCH_TIMEOUT_S = 600
DDP_TIMEOUT_S = 180
WATCHDOG = ROOT / "tests" / "launch_watchdog"


def _run_launch(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{WATCHDOG}{os.pathsep}{ROOT}",
        "OMP_NUM_THREADS": "1",
        "HF_VARLEN_TEST_WATCHDOG_S": str(LAUNCH_TIMEOUT_S - 60),
    }
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, name: str, processes: int, grad_accum: int) -> Path:
    proc = _launch(tmp_path, name, processes, grad_accum)
    # The tail holds a watchdog's stack dumps, when there are any.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-20000:]
    assert f"on {processes} x cpu" in proc.stdout, proc.stdout[-2000:]
    want = "DDP over gloo" if processes > 1 else "one process"
    assert json.loads((tmp_path / name / "summary.json").read_text())["distribution"] == want
    return tmp_path / name


def _launch(
    tmp_path: Path,
    name: str,
    processes: int,
    grad_accum: int,
    *extra: str,
    steps: int = 5,
    shuffle: bool = False,
    accelerate_config: Path | None = None,
) -> subprocess.CompletedProcess:
    out = tmp_path / name
    flags = (
        f"--tokens-per-batch {BUDGET} --max-length {BUDGET} --grad-accum {grad_accum} "
        f"--max-steps {steps} --no-shuffle --optim sgd --lr 0.05 --lr-schedule constant "
        f"--max-grad-norm 0 --eval-every 2 --no-progress --ddp-timeout {DDP_TIMEOUT_S}"
    ).split() + list(extra)
    data = [
        "--dataset",
        str(tmp_path / "train.json"),
        "--eval-dataset",
        str(tmp_path / "eval.json"),
    ]
    if shuffle:  # the default sampler order (shuffled per epoch) instead
        flags.remove("--no-shuffle")
    train = ["train", *flags, *data, "--output-dir", str(out)]
    if processes == 1:
        cmd = [sys.executable, "-m", "hf_varlen.cli", *train]
    else:
        config = accelerate_config or ROOT / "scripts" / "accelerate" / "cpu_2proc.yaml"
        launch = f"--config_file {config} --num_processes {processes} --main_process_port"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *launch.split(),
            str(_free_port()),
            "-m",
            "hf_varlen.cli",
            *train,
        ]
    return _run_launch(cmd)


def _log(run: Path):
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r], [r for r in recs if "eval_loss" in r]


def test_data_is_uneven_across_ranks():
    steps = TokenBudgetBatchSampler(TRAIN_LENGTHS, BUDGET, shuffle=False, num_replicas=2)
    tokens = [
        [sum(TRAIN_LENGTHS[i] for i in steps.batches[b]) if b >= 0 else 0 for b in row]
        for row in steps.step_batches().tolist()
    ]
    assert all(a != b for a, b in tokens), tokens  # unequal tokens per rank at every step
    assert tokens[-1][1] == 0  # rank 1 runs a dummy step
    ev = TokenBudgetBatchSampler(EVAL_LENGTHS, BUDGET, shuffle=False, num_replicas=2)
    assert (ev.step_batches() < 0).any()


def test_two_processes_equal_one(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    (tmp_path / "eval.json").write_text(json.dumps(_texts(EVAL_LENGTHS)))
    one = _run(tmp_path, "one", processes=1, grad_accum=2)
    two = _run(tmp_path, "two", processes=2, grad_accum=1)

    (steps1, evals1), (steps2, evals2) = _log(one), _log(two)
    assert [r["step"] for r in steps1] == [r["step"] for r in steps2] == [1, 2, 3, 4, 5]
    for a, b in zip(steps1, steps2, strict=True):
        assert a["real_tokens"] == b["real_tokens"] and a["label_tokens"] == b["label_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
    assert [r["step"] for r in evals1] == [r["step"] for r in evals2] == [2, 4, 5]
    for a, b in zip(evals1, evals2, strict=True):
        assert a["eval_tokens"] == b["eval_tokens"]
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)

    # The rank balance: per step max / mean of the ranks' real tokens, from the dealt batches.
    sampler = TokenBudgetBatchSampler(TRAIN_LENGTHS, BUDGET, shuffle=False, num_replicas=2)
    table = sampler.rank_tokens()
    per_step = [table[i % len(table)] for i in range(len(steps2))]  # accumulation 1, 5 steps
    for rec, tokens in zip(steps2, per_step, strict=True):
        assert rec["real_tokens"] == tokens.sum()
        assert rec["rank_imbalance"] == pytest.approx(tokens.max() / tokens.mean())
    assert all("rank_imbalance" not in r for r in steps1)
    ranks = json.loads((two / "summary.json").read_text())["ranks"]
    assert sum(ranks["real_tokens"]) == sum(r["real_tokens"] for r in steps2)
    assert ranks["real_tokens"] == [int(sum(t[r] for t in per_step)) for r in range(2)]
    assert len(ranks["peak_mem_gib"]) == 2 and min(ranks["peak_mem_gib"]) > 0
    assert ranks["imbalance_worst"] == max(r["rank_imbalance"] for r in steps2)
    assert json.loads((one / "summary.json").read_text())["ranks"] is None

    w1 = load_file(one / "final" / "model.safetensors")
    w2 = load_file(two / "final" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-7)


def test_two_process_checkpoints_are_atomic_and_validated_per_rank(tmp_path):
    """Every rank's random states are in the manifest; a missing one is named at resume
    unless --resume-without-rng; then --resume latest continues on both ranks."""
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    (tmp_path / "eval.json").write_text(json.dumps(_texts(EVAL_LENGTHS)))
    proc = _launch(tmp_path, "ck", 2, 1, "--save-every", "2", steps=4)
    assert proc.returncode == 0, proc.stderr[-20000:]
    run = tmp_path / "ck"
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    files = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["files"]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)

    (run / "checkpoint-4" / "random_states_1.pkl").unlink()
    proc = _launch(tmp_path, "ck", 2, 1, "--resume", str(run / "checkpoint-4"), steps=6)
    assert proc.returncode != 0, proc.stderr[-3000:]  # each rank exits 2; torchrun reports 1
    assert "exitcode  : 2" in proc.stderr
    assert "random_states_1.pkl is missing" in proc.stderr and "--resume-without-rng" in proc.stderr
    for rank in (0, 1):  # one line per rank (the launcher adds its own traceback)
        assert f"hf-varlen: error (rank {rank}): --resume" in proc.stderr, proc.stderr[-3000:]

    # latest is checkpoint-4 still (it lacks only random states: not skipped for an older one)
    flags = ("--resume", "latest", "--resume-without-rng", "--save-every", "2")
    proc = _launch(tmp_path, "ck", 2, 1, *flags, steps=6)
    assert proc.returncode == 0, proc.stderr[-20000:]
    assert "resumed from" in proc.stderr and "checkpoint-4 at step 4" in proc.stderr
    assert "fresh random states" in proc.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").open() if '"loss"' in x]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_two_process_resume_continues_identically(tmp_path):
    """Checkpoint at step 4 of 2 ranks, resume to step 7: the same per-step losses, gradient norms
    and final weights as the uninterrupted run (shuffled sampler across an epoch boundary, Adam
    state, per-rank random states)."""
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    (tmp_path / "eval.json").write_text(json.dumps(_texts(EVAL_LENGTHS)))
    adam = ("--optim", "adamw", "--lr", "0.01")
    straight = _launch(tmp_path, "straight", 2, 1, *adam, steps=7, shuffle=True)
    assert straight.returncode == 0, straight.stderr[-20000:]
    part = _launch(tmp_path, "resumed", 2, 1, *adam, "--save-every", "4", steps=4, shuffle=True)
    assert part.returncode == 0, part.stderr[-20000:]
    flags = (*adam, "--resume", "latest")
    resumed = _launch(tmp_path, "resumed", 2, 1, *flags, steps=7, shuffle=True)
    assert resumed.returncode == 0, resumed.stderr[-20000:]
    assert "checkpoint-4 at step 4" in resumed.stderr

    (a, _), (b, _) = _log(tmp_path / "straight"), _log(tmp_path / "resumed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 8))
    for x, y in zip(a, b, strict=True):
        assert (x["real_tokens"], x["label_tokens"]) == (y["real_tokens"], y["label_tokens"])
        assert y["loss"] == x["loss"] and y["grad_norm"] == x["grad_norm"], (x, y)
    w1 = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    w2 = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=0)


def test_two_processes_with_a_tracker_export_and_summarise(tmp_path):
    """--report-to with 2 ranks: the trackers stop after the loop, but the process group lives on
    for the final export and the summary's gather (accelerate's end_training destroyed it first)."""
    pytest.importorskip("tensorboard")
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    (tmp_path / "eval.json").write_text(json.dumps(_texts(EVAL_LENGTHS)))
    proc = _launch(tmp_path, "tb", 2, 1, "--report-to", "tensorboard", steps=3)
    assert proc.returncode == 0, proc.stderr[-20000:]
    run = tmp_path / "tb"
    assert (run / "final" / "model.safetensors").is_file()
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    ranks = json.loads((run / "summary.json").read_text())["ranks"]
    assert len(ranks["real_tokens"]) == 2


def test_an_fsdp_launch_accelerate_runs_unsharded_is_refused(tmp_path):
    """On CPU accelerate turns scripts/accelerate/fsdp2.yaml into plain data parallelism (MULTI_CPU)
    without a word; the trainer refuses it on every rank before loading anything."""
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    (tmp_path / "eval.json").write_text(json.dumps(_texts(EVAL_LENGTHS)))
    fsdp2 = ROOT / "scripts" / "accelerate" / "fsdp2.yaml"
    config = tmp_path / "fsdp2_fp32.yaml"  # fp32: bf16 autocast is not what is tested here
    config.write_text(fsdp2.read_text().replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    proc = _launch(tmp_path, "fsdp", 2, 1, accelerate_config=config)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"hf-varlen: error (rank {rank}): the launch asks for FSDP" in proc.stderr
    assert "MULTI_CPU" in proc.stderr and "cpu_2proc.yaml" in proc.stderr
    assert not (tmp_path / "fsdp").exists()  # refused before anything was written


_TWICE = """
import json, os, sys, weakref
from hf_varlen.training import PackedTrainer, TrainConfig

out = []
for i in range(2):
    cfg = TrainConfig(dataset=sys.argv[1], tokens_per_batch=512, max_length=512, max_steps=2,
                      progress=False, save_final=False, output_dir=sys.argv[2] + str(i))
    trainer = PackedTrainer(cfg)
    out.append(trainer.run()["distribution"])
wrapper = weakref.ref(trainer.model)
trainer.close()
# close() frees the DDP wrapper (its Reducer) while it still holds the group (loop.py says why)
out.append([wrapper() is None, type(trainer.model).__name__])
# one write per rank (print's separate writes of "RUNS", " ", ... interleaved between the ranks)
sys.stdout.write(f"RUNS {os.environ['RANK']} {json.dumps(out)}\\n")
sys.stdout.flush()
"""


def test_two_trainers_in_one_launched_script(tmp_path):
    """The Python API under `accelerate launch`: run() leaves the process group to the script
    (a second trainer trains on it), close() ends it and leaves the unwrapped model."""
    (tmp_path / "train.json").write_text(json.dumps(_texts(TRAIN_LENGTHS)))
    script = tmp_path / "twice.py"
    script.write_text(_TWICE)
    config = ROOT / "scripts" / "accelerate" / "cpu_2proc.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd += ["--num_processes", "2", "--main_process_port", str(_free_port()), str(script)]
    cmd += [str(tmp_path / "train.json"), str(tmp_path / "run")]
    proc = _run_launch(cmd)
    assert proc.returncode == 0, proc.stderr[-20000:]
    for rank in (0, 1):
        assert (
            f'RUNS {rank} ["DDP over gloo", "DDP over gloo", [true, "LlamaForCausalLM"]]'
            in proc.stdout
        ), proc.stdout


def test_watchdog_dumps_a_hung_launch_and_ends_it():
    """The launches' watchdog: a process still running after HF_VARLEN_TEST_WATCHDOG_S prints its
    threads' stacks (naming the frame it hangs in) and exits 1, well before the test's timeout."""
    cmd = [sys.executable, "-c", "import time\ndef stuck():\n    time.sleep(60)\nstuck()"]
    env = {**os.environ, "PYTHONPATH": str(WATCHDOG), "HF_VARLEN_TEST_WATCHDOG_S": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert "Timeout" in proc.stderr and "in stuck" in proc.stderr, proc.stderr
