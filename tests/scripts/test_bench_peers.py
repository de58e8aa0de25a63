"""scripts/bench_e2e.py's peer modes on CPU (e2e_peers: Unsloth, TRL, a plain PyTorch loop, each in
a worker process and environment of its own): the environment and command of each peer, the
offline switches, the one saved model folder every mode loads, the batches exported in hf-varlen
train's order, result parsing, the loss-agreement check, and the whole path end to end with the
peers that run on a CPU (the plain loop; TRL where it is installed); Unsloth and Liger skip with
their reason."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_e2e  # noqa: E402
import e2e_modes  # noqa: E402
import e2e_peers  # noqa: E402
import e2e_report  # noqa: E402

UNSLOTH_VAR, TRL_VAR = e2e_peers.PEER_SITES["unsloth"], e2e_peers.PEER_SITES["trl"]


def test_peer_environments_are_offline_with_their_own_site_first(tmp_path):
    parent = {"PYTHONPATH": "/tmp/site:/repo", "PATH": "/bin", UNSLOTH_VAR: "/peers/unsloth"}
    env = e2e_peers.peer_env("unsloth", parent, str(tmp_path / "compiled"))
    for key, value in {**e2e_peers.OFFLINE_ENV, **e2e_peers.UNSLOTH_ENV}.items():
        assert env[key] == value, key
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["UNSLOTH_DISABLE_STATISTICS"] == "1"
    assert env["UNSLOTH_PADDING_CHOICE"] == "padding_free"
    assert env["UNSLOTH_COMPILE_LOCATION"] == str(tmp_path / "compiled")
    # its site first, then the scripts folder; the parent's newer transformers (/tmp/site) gone
    assert env["PYTHONPATH"].split(os.pathsep) == ["/peers/unsloth", str(ROOT / "scripts")]
    assert env["PATH"] == "/bin"
    assert parent["PYTHONPATH"] == "/tmp/site:/repo"  # the parent's mapping is left alone

    lora = e2e_peers.peer_env("unsloth-lora", parent, "x")
    assert lora["PYTHONPATH"] == env["PYTHONPATH"] and lora["UNSLOTH_COMPILE_LOCATION"] == "x"
    trl = e2e_peers.peer_env("trl-liger", {**parent, TRL_VAR: "/peers/trl"}, "x")
    assert trl["PYTHONPATH"].split(os.pathsep)[0] == "/peers/trl"
    assert "UNSLOTH_PADDING_CHOICE" not in trl and trl["HF_HUB_OFFLINE"] == "1"
    # no site named: the parent's environment, still offline
    same = e2e_peers.peer_env("trl-sdpa", parent, "x")
    assert same["PYTHONPATH"] == parent["PYTHONPATH"] and same["TRANSFORMERS_OFFLINE"] == "1"
    plain = e2e_peers.peer_env("torch-sdpa", parent, "x")
    assert plain["PYTHONPATH"] == parent["PYTHONPATH"]


def test_every_peer_runs_its_own_worker_script(tmp_path):
    cmd = e2e_peers.peer_command("/usr/bin/python3")
    assert cmd == ["/usr/bin/python3", str(ROOT / "scripts" / "e2e_peers.py"), "--serve"]
    spawn = bench_e2e.peer_spawn(tmp_path / "unsloth")
    command, env = spawn({"mode": "unsloth"})
    assert command[1:] == cmd[1:] and env["UNSLOTH_COMPILE_LOCATION"] == str(tmp_path / "unsloth")
    assert (tmp_path / "unsloth").is_dir()  # writable, made before the worker starts
    for name in e2e_peers.PEERS:  # each a bench_e2e mode of its own
        assert bench_e2e.MODES[name] == {"peer": name}
    args = bench_e2e.parse_args(["--modes", e2e_modes.PEER_FULL_MODES])
    assert {"unsloth", "trl-sdpa", "trl-liger", "hf_varlen"} <= set(args.modes)
    with pytest.raises(SystemExit):  # peers carry their own GPU-busy / attention, no profile
        bench_e2e.parse_args(["--profile", "--profile-modes", "unsloth"])


def test_unavailable_peers_name_what_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setenv(UNSLOTH_VAR, "/peers/unsloth")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n: None if n in ("unsloth", "bitsandbytes") else real(n)
    )
    assert e2e_peers.unavailable("unsloth", cuda=True) == (
        "unsloth not installed (site /peers/unsloth)"
    )
    assert e2e_peers.unavailable("unsloth-qlora", cuda=True).startswith(
        "unsloth, bitsandbytes not installed"
    )
    monkeypatch.delenv(UNSLOTH_VAR)
    assert e2e_peers.unavailable("unsloth", cuda=True).endswith(f"(no {UNSLOTH_VAR})")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object())  # all installed
    assert e2e_peers.unavailable("unsloth", cuda=False) == "unsloth needs CUDA"
    assert e2e_peers.unavailable("trl-liger", cuda=False) == "trl-liger needs CUDA"
    assert e2e_peers.unavailable("trl-sdpa", cuda=False) is None
    assert e2e_peers.unavailable("torch-sdpa", cuda=False) is None


def _run(tmp_path, **extra):
    run = dict(
        run_dir=str(tmp_path / "cell"), batch_size=4, lr=1e-4, precision="bf16", seed=3,
        max_length=256, warmup=1, steps=3, mode="trl-sdpa",
    )  # fmt: skip
    return {**run, **extra}


def test_sft_settings_pin_every_default_unsloth_changes(tmp_path):
    """Unsloth's SFTConfig swaps defaults (adamw_8bit, batch 4 x accumulation 2, logging every
    step, torch_empty_cache_steps 250, its offloading checkpointing): each one is set here."""
    s = e2e_peers.sft_settings(_run(tmp_path), steps=21, cuda=True)
    assert s["optim"] == "adamw_torch_fused" and "8bit" not in s["optim"]
    assert (s["adam_beta1"], s["adam_beta2"], s["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert s["per_device_train_batch_size"] == 4 and s["gradient_accumulation_steps"] == 1
    assert s["torch_empty_cache_steps"] is None and s["gradient_checkpointing"] is False
    assert s["lr_scheduler_type"] == "constant" and s["warmup_steps"] == 0
    assert s["weight_decay"] == 0.0 and s["max_grad_norm"] == 1.0 and s["learning_rate"] == 1e-4
    assert s["logging_steps"] == 1 and s["max_steps"] == 21 and s["seed"] == 3
    assert s["train_sampling_strategy"] == "sequential" and s["padding_free"] is True
    assert s["bf16"] is True and s["fp16"] is False and s["packing"] is False
    assert e2e_peers.sft_settings(_run(tmp_path), 2, cuda=False)["optim"] == "adamw_torch"
    assert e2e_peers.sft_settings(_run(tmp_path, precision="fp32"), 2, cuda=True)["bf16"] is False
    # the same settings as hf-varlen train's AdamW (hf_varlen.training.loop)
    assert (e2e_peers.BETAS, e2e_peers.EPS) == ((0.9, 0.999), 1e-8)
    from hf_varlen.training import TrainConfig

    ours = TrainConfig()  # the --lora settings bench_e2e's LoRA modes train with (r 16)
    assert e2e_peers.LORA["r"] == e2e_modes.LORA["lora_r"] == 16
    assert e2e_peers.LORA["lora_alpha"] == ours.lora_alpha and ours.lora_target == "all-linear"
    assert e2e_peers.LORA["lora_dropout"] == ours.lora_dropout
    pytest.importorskip("trl")
    from trl import SFTConfig

    missing = set(s) - set(SFTConfig.__dataclass_fields__)
    assert not missing, f"this TRL's SFTConfig lacks {missing}"


def _tiny_spec(tmp_path):
    return dict(model="tiny-llama", layers=2, tokenizer="bytes", precision="fp32", seed=0,
                dir=str(tmp_path / "models" / "tiny"))  # fmt: skip


def test_the_model_is_saved_once_and_loads_offline_from_its_folder(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = _tiny_spec(tmp_path)
    path = Path(bench_e2e.prepare_model_dir(spec))
    weights = next(path.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    assert bench_e2e.prepare_model_dir(spec) == str(path)  # the same spec: reused, not rewritten
    assert weights.stat().st_mtime_ns == stamp
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.num_hidden_layers == 2
    assert getattr(config, "_attn_implementation", None) in (None, "sdpa")  # no hf_varlen name
    a = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    b = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok.pad_token == "<|pad|>"
    other = Path(bench_e2e.prepare_model_dir({**spec, "seed": 1, "dir": str(tmp_path / "o")}))
    c = AutoModelForCausalLM.from_pretrained(other, local_files_only=True)
    assert not torch.equal(c.model.embed_tokens.weight, a.model.embed_tokens.weight)


def test_exported_batches_are_the_ones_hf_varlen_train_trains_on(tmp_path):
    """The peers' batch file holds, in order, the examples PackedTrainer's sampler gives each
    step (same tokens, same labels)."""
    from hf_varlen.training import PackedTrainer, TrainConfig

    run = dict(data="builtin", dataset="builtin", tokenizer="bytes", max_length=128,
               batch_size=4, seed=5, steps=3)  # fmt: skip
    path = bench_e2e.export_batches(run, tmp_path)
    batches = e2e_peers.read_batches(path, 4)
    with pytest.raises(ValueError, match="needs 5"):
        e2e_peers.read_batches(path, 5)
    cfg = TrainConfig(tokenizer="bytes", dataset="builtin", format="alpaca", max_length=128,
                      batch_size=4, seed=5, max_steps=3, output_dir=str(tmp_path / "t"),
                      save_final=False, progress=False, precision="fp32")  # fmt: skip
    trainer = PackedTrainer(cfg)
    trainer.sampler.set_epoch(0)
    slots = list(trainer.sampler)[:4]
    want = [
        [{"input_ids": trainer.train_ex.input_ids[i].tolist(),
          "labels": trainer.train_ex.labels[i].tolist()} for i in slot]
        for slot in slots
    ]  # fmt: skip
    assert batches == want
    assert any(-100 in ex["labels"] for b in batches for ex in b)  # prompt tokens masked


def test_a_peer_cell_is_summarised_from_its_timed_steps(tmp_path):
    batches = [[{"input_ids": [1] * n, "labels": [1] * n}] for n in (10, 20, 30, 40)]
    times = [5.0, 0.5, 1.0, 1.5]  # the first: compile
    r = e2e_peers.summarize(_run(tmp_path, warmup=1), batches, times, [9.0, 8.0, 7.0, 6.0, 5.0], {})
    assert r["status"] == "ok" and r["tokens_per_s"] == pytest.approx(90 / 3.0)
    assert r["step_ms"] == pytest.approx(1000.0) and r["warmup_s"] == 5.0
    assert r["warmup_excess_s"] == pytest.approx(4.0) and r["first_step_s"] == 5.0
    assert r["losses"] == [9.0, 8.0, 7.0, 6.0]  # the profiled step's loss left out
    assert r["elapsed"] == [5.0, 5.5, 6.5, 8.0]
    text = e2e_report.fmt_cell({**r, "peak_gib": 2.0, "import_s": 20.0, "load_s": 4.0})
    assert text == "0.0K, 2.0 GiB, warm-up 5 s, start-up 24 s"
    clock = e2e_peers.StepClock(lambda: None)
    for _ in range(3):
        clock.begin()
    assert len(clock.times()) == 2 and all(t >= 0 for t in clock.times())


def _cell(mode, b, losses, *, peer=False, precision="bf16", status="ok"):
    run = dict(model="llama-1b", data="alpaca", max_length=1024, batch_size=b, mode=mode,
               precision=precision, **({"peer": True} if peer else {}))  # fmt: skip
    return dict(run=run, status=status, losses=losses, tokens_per_s=1e4, peak_gib=1.0, mfu=None,
                kernels="k", elapsed=list(range(len(losses or []))))  # fmt: skip


def _reduction_floor(batch: int, max_length: int) -> float:
    """2 x the fp32 rule's reduction floor over a step's tokens (e2e_report.check_losses)."""
    return 2 * 2.0**-24 * (1 + math.ceil(math.log2(batch * max_length)))


def test_loss_check_flags_a_diverging_peer_and_keeps_it_out_of_the_speed_plot(tmp_path):
    base = [12.0, 11.0, 10.0, 9.0]
    near = [x * (1 + 1e-3) for x in base]  # our compiled mode: other kernels, the same math
    results = [
        _cell("hf_varlen", 8, base),
        _cell("hf_varlen-compile", 8, near),
        _cell("unsloth", 8, [x * (1 + 4e-3) for x in base], peer=True),  # within the noise
        _cell("trl-sdpa", 8, [12.0, 11.0, 10.5, 10.0], peer=True),  # 11% off at step 4
        _cell("hf_varlen-lora", 8, [12.0, 11.9, 11.8, 11.7]),  # another family: own reference
        _cell("unsloth-lora", 8, [12.0, 11.9, 11.8, 11.7], peer=True),
        _cell("trl-liger", 8, None, peer=True, status="skipped: trl-liger needs CUDA"),
    ]
    rows = e2e_report.check_losses(results)
    by = {r["mode"]: r for r in rows}
    tol = 2 * 1e-3 + 2 * 2.0**-8 + _reduction_floor(8, 1024)
    assert by["hf_varlen-compile"]["gap"] == pytest.approx(1e-3)
    assert by["unsloth"]["tol"] == pytest.approx(tol) and by["unsloth"]["agree"]
    assert not by["trl-sdpa"]["agree"] and by["trl-sdpa"]["gap"] == pytest.approx(1 / 9)
    assert by["unsloth-lora"]["reference"] == "hf_varlen-lora" and by["unsloth-lora"]["agree"]
    # one own mode: no spread
    assert by["unsloth-lora"]["tol"] == pytest.approx(2 * 2.0**-8 + _reduction_floor(8, 1024))
    assert "trl-liger" not in by and "loss_check" not in results[-1]
    assert e2e_report.fmt_cell(results[3]).startswith("DIVERGED: loss gap 1.1e-01 > ")
    fp32 = [_cell("hf_varlen", 2, base, precision="fp32"), _cell("x", 2, near, peer=True)]
    assert e2e_report.check_losses(fp32)[1]["tol"] == pytest.approx(
        2 * 2.0**-24 + _reduction_floor(2, 1024)
    )
    assert not e2e_report.check_losses(fp32)[1]["agree"]
    assert e2e_report.check_losses(fp32, rtol=2e-3)[1]["agree"]  # --loss-rtol

    e2e_report.check_losses(results)
    out = tmp_path / "tables.md"
    e2e_report.write_tables(results, [], {"gpu": "test"}, out)
    text = out.read_text()
    assert "| 8 | trl-sdpa | hf_varlen | 1.11e-01 |" in text and "**DIVERGED**" in text
    assert "| 8 | unsloth | hf_varlen | 4.00e-03 |" in text
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    plotted: dict[int, list] = {}  # labels per figure, in drawing order
    real_plot = plt.Axes.plot

    def spy(ax, *a, label=None, **k):
        plotted.setdefault(id(ax), []).append(label)
        return real_plot(ax, *a, label=label, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Axes, "plot", spy)
        paths = e2e_report.write_plots(results, [], tmp_path)
    assert [Path(p).name for p in paths][:3] == [
        "e2e_tokens_per_s_llama-1b_alpaca_L1024.png",  # tokens/s by batch size per mode
        "e2e_memory_llama-1b_alpaca_L1024.png",  # peak memory by batch size per mode
        "e2e_loss_vs_step_llama-1b_alpaca_L1024.png",
    ]
    speed, memory, loss = list(plotted.values())[:3]
    assert "trl-sdpa" not in speed and {"hf_varlen", "unsloth", "unsloth-lora"} <= set(speed)
    assert "trl-sdpa" not in memory
    assert "trl-sdpa" in loss  # its loss curve is what shows the divergence


@pytest.mark.slow
def test_peers_run_the_whole_path_end_to_end_on_cpu(tmp_path):
    """Our mode, the plain-loop peer and TRL's (where installed) in their own worker processes
    on the same saved model and exported examples: the same per-step losses (fp32 on a CPU: the
    check's tolerance is the fp32 one), Unsloth and Liger skipped with their reason."""
    pytest.importorskip("matplotlib")
    modes = "hf_varlen,torch-sdpa,trl-sdpa,unsloth"
    results = bench_e2e.main(
        ["--models", "tiny-llama", "--layers", "2", "--data", "builtin", "--tokenizer", "bytes"]
        + ["--max-lengths", "128", "--steps", "3", "--warmup", "1", "--batch-sizes", "2"]
        + ["--modes", modes, "--out", str(tmp_path), "--no-isolate"]
    )
    runs = {r["run"]["mode"]: r for r in results}
    assert runs["unsloth"]["status"].startswith("skipped: unsloth") or runs["unsloth"][
        "status"
    ] == ("skipped: unsloth needs CUDA")
    have_trl = all(importlib.util.find_spec(m) for m in ("trl", "datasets"))
    peers = ["torch-sdpa"] + (["trl-sdpa"] if have_trl else [])
    if not have_trl:
        assert runs["trl-sdpa"]["status"].startswith("skipped: trl")
    ours = runs["hf_varlen"]
    assert ours["status"] == "ok" and ours["loss_check"]["reference"] == "hf_varlen"
    model_dir = ours["run"]["model_dir"]
    assert Path(model_dir, "bench_e2e_model.json").exists()
    for mode in peers:
        r = runs[mode]
        assert r["status"] == "ok", (mode, r["status"])
        assert r["run"]["model_dir"] == model_dir and r["worker_cell"] == 0
        assert len(r["losses"]) == 3 and r["tokens_per_s"] > 0 and r["warmup_s"] > 0
        assert r["loss_check"]["agree"], (mode, r["loss_check"], r["losses"], ours["losses"])
        assert r["loss_check"]["tol"] == pytest.approx(2 * 2.0**-24 + _reduction_floor(2, 128))
        assert r["precision_policy"] == "fp32" and "sdpa" in r["attention"]
        assert Path(r["run"]["batches_path"]).exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert all("loss_check" in r for r in saved["results"] if r["status"] == "ok")
    logs = {p.name for p in (tmp_path / "workers").iterdir()}
    assert "tiny-llama_torch-sdpa.log" in logs
    text = (tmp_path / "e2e_tables.md").read_text()
    assert "Loss agreement" in text and "| 2 | torch-sdpa | hf_varlen |" in text
    assert "Attention each mode ran" in text
    assert "Not run: unsloth: unsloth" in text  # the reason, in full


def test_the_report_merges_the_calls_of_a_grid(tmp_path):
    """One bench_e2e call per batch size (each within a GPU call): e2e_report.py draws them as one
    grid, the loss check redone on the merged cells."""
    pytest.importorskip("matplotlib")
    base = [12.0, 11.0, 10.0]
    paths = []
    for b in (1, 32):
        cells = [_cell("hf_varlen", b, base), _cell("unsloth", b, base, peer=True)]
        path = tmp_path / f"B{b}" / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"header": {"gpu": "x"}, "padding": [], "results": cells}))
        paths.append(str(path))
    e2e_report.main(
        paths + ["--plots-dir", str(tmp_path / "grid"), "--out", str(tmp_path / "t.md")]
    )
    text = (tmp_path / "t.md").read_text()
    assert "| 1 | unsloth | hf_varlen | 0.00e+00 |" in text
    assert "| 32 | unsloth | hf_varlen | 0.00e+00 |" in text
    assert (tmp_path / "grid" / "e2e_tokens_per_s_llama-1b_alpaca_L1024.png").stat().st_size > 0
    assert (tmp_path / "grid" / "e2e_memory_llama-1b_alpaca_L1024.png").stat().st_size > 0


def test_unsloths_own_counters_say_which_attention_it_ran(monkeypatch):
    """Read from Unsloth's modules as they are after training (stand-ins here): its packed
    attention's counters (full fine-tuning) and its dispatcher's pick for packed rows (LoRA)."""
    import types

    counters = {"fast": 0, "fallback": 0, "mask_checks": 16, "efficient": 0, "compiled": 400}
    packed = types.SimpleNamespace(HF_PACKED_ATTENTION_STATS=counters)
    dispatch = types.SimpleNamespace(
        select_attention_backend=lambda use_varlen=False: "sdpa" if use_varlen else "x",
        _TORCH_VARLEN_ATTN=None,
    )
    utils = types.SimpleNamespace(hf_packed_attention=packed, attention_dispatch=dispatch)
    for name, mod in {
        "unsloth": types.SimpleNamespace(utils=utils),
        "unsloth.utils": utils,
        "unsloth.utils.hf_packed_attention": packed,
        "unsloth.utils.attention_dispatch": dispatch,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    got = e2e_peers._unsloth_attention()
    assert got["attention"].startswith("compiled per-layer blocks")
    assert (
        got["unsloth_packed_attention"] == counters
        and counters is not got["unsloth_packed_attention"]
    )
    assert got["unsloth_dispatch"] == {"packed_backend": "sdpa", "torch_varlen_loaded": False}
    counters.update(fast=24, compiled=0)
    assert e2e_peers._unsloth_attention()["attention"].startswith("varlen (fast path)")
    counters.update(fast=0, fallback=24)
    assert e2e_peers._unsloth_attention()["attention"].startswith("dense SDPA fallback")
    counters.update(fallback=0, mask_checks=0)  # the LoRA path: its own attention forward
    assert "dispatcher" in e2e_peers._unsloth_attention()["attention"]


def test_attention_kernels_are_named_from_the_profiled_step():
    from types import SimpleNamespace

    import bench_common

    cuda = torch.autograd.DeviceType.CUDA

    def ev(key, us, count=1, **kw):
        return SimpleNamespace(key=key, self_device_time_total=us, count=count, device_type=cuda,
                               is_user_annotation=kw.get("note", False))  # fmt: skip

    events = [
        ev("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 300.0, 16),
        ev("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", 900.0, 16),
        ev("ampere_bf16_s16816gemm_bf16_128x128", 5000.0, 64),
        ev("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 10.0, 2),
        ev("attention (record_function range)", 99999.0, 1, note=True),
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    got = bench_common.attention_kernels(prof)
    assert [(n[:28], c) for n, c, _ in got] == [
        ("void pytorch_flash::flash_bw", 16),
        ("void pytorch_flash::flash_fw", 16),
        ("fmha_cutlassF_bf16_aligned_6", 2),
    ]
    assert got[0][2] == pytest.approx(0.9)  # ms
    assert bench_common.device_kernel_seconds(prof) == pytest.approx(6210e-6)
