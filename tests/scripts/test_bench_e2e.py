"""scripts/bench_e2e.py on CPU: the machinery of the end-to-end benchmark, and the loss-equality
claim it reports (padded and packed runs over the same examples in the same order give the same
per-step losses; in fp32 on CPU, equal within fp32 rounding). The GPU numbers come from running
the script on the GPU machine (docs/BENCHMARKS.md); this only checks that it measures correctly."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_common  # noqa: E402
import bench_e2e  # noqa: E402
import e2e_host_profile  # noqa: E402
import e2e_measure  # noqa: E402
import e2e_modes  # noqa: E402

COMMON = ["--models", "tiny-llama", "--data", "builtin", "--tokenizer", "bytes"]
COMMON += ["--max-lengths", "256", "--steps", "4", "--warmup", "1"]


def _by_mode(results, batch_size):
    return {
        r["run"]["mode"]: r
        for r in results
        if r["run"]["batch_size"] == batch_size and not r["run"].get("profile")
    }


@pytest.mark.slow
def test_modes_train_identical_examples_with_equal_losses(tmp_path):
    pytest.importorskip("matplotlib")
    modes = "padded_sdpa,packed_sdpa,hf_varlen,hf_varlen-loss,minimal_varlen"
    results = bench_e2e.main(
        COMMON
        + ["--batch-sizes", "1,8", "--modes", modes, "--out", str(tmp_path), "--no-isolate"]
        + ["--profile", "--profile-batch", "4"]
    )
    for b in (1, 8):
        runs = _by_mode(results, b)
        assert runs["minimal_varlen"]["status"].startswith("skipped: torch varlen_attn needs CUDA")
        base = runs["padded_sdpa"]
        assert base["status"] == "ok" and len(base["losses"]) == 4
        if b == 1:  # one example per batch: nothing to pad
            assert base["padding_efficiency"] == 1.0
        for mode in ("packed_sdpa", "hf_varlen", "hf_varlen-loss"):
            r = runs[mode]
            assert r["status"] == "ok", (mode, r["status"])
            assert r["padding_efficiency"] == 1.0 and r["tokens_per_s"] > 0
            torch.testing.assert_close(
                torch.tensor(r["losses"]), torch.tensor(base["losses"]), rtol=2e-6, atol=0
            )
        assert runs["hf_varlen"]["tokens_per_step"] == pytest.approx(
            runs["padded_sdpa"]["tokens_per_step"]
        )
    assert _by_mode(results, 8)["padded_sdpa"]["padding_efficiency"] < 1.0
    # On CPU the fused kernels are off ("auto"); the loss alone is fused in hf_varlen.
    assert "cross_entropy" in _by_mode(results, 8)["hf_varlen"]["kernels"]
    assert "off" in _by_mode(results, 8)["hf_varlen-loss"]["kernels"]

    (profiled,) = [r for r in results if r["run"].get("profile")]
    assert profiled["status"] == "ok" and profiled["by_category_ms"]["matmul"] > 0
    assert profiled["host_ms"] > 0 and profiled["host_top"][0][1] >= 1
    assert profiled["python_step_ms"] > 0 and profiled["python_calls"] > 100
    top = profiled["python_top"]
    assert len(top) == 30 and all(ms >= 0 and calls > 0 for ms, calls, _ in top)
    assert top[0][0] >= top[-1][0]  # by own time, largest first
    # py-spy's samples of ~3 s of more steps, or why there are none (not installed, cannot attach)
    assert profiled.get("sampled_step_ms", 0) > 0 or profiled["sampled"].startswith("not run")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["results"]) == len(results) and saved["header"]["torch"] == torch.__version__
    assert {p["batch_size"]: p["padded_efficiency"] for p in saved["padding"]}[1] == 1.0
    tables = (tmp_path / "e2e_tables.md").read_text()
    assert "| 8 | " in tables and "Padding efficiency by batch size" in tables
    assert "Where one step goes" in tables and "top host ops" in tables
    assert "top Python functions (own time)" in tables
    assert (
        "Host wall time of the step's thread (py-spy" in tables or "Host samples (py-spy)" in tables
    )
    assert "hf_varlen: layer kernels off" in tables  # the CPU run says what it did not fuse
    for name in ("e2e_tokens_per_s", "e2e_loss_vs_step", "e2e_loss_vs_time"):
        assert (tmp_path / f"{name}_tiny-llama_builtin_L256.png").stat().st_size > 0
    assert (tmp_path / "e2e_padding_efficiency.png").stat().st_size > 0


@pytest.mark.slow
def test_isolated_runs_report_status(tmp_path):
    """The default: every configuration in its own process; results come back as JSON."""
    results = bench_e2e.main(
        COMMON
        + ["--batch-sizes", "2", "--modes", "packed_sdpa", "--out", str(tmp_path), "--steps", "2"]
    )
    (r,) = results
    assert r["status"] == "ok" and len(r["losses"]) == 2
    assert json.loads(Path(r["run"]["run_dir"], "result.json").read_text())["status"] == "ok"


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--modes", "no-such-mode"])
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--steps", "3", "--warmup", "3"])


def test_every_mode_maps_to_a_valid_train_config():
    run = dict(
        model="tiny-llama", tokenizer="bytes", dataset="builtin", max_length=64, batch_size=2,
        steps=2, lr=1e-3, precision="fp32", seed=0, run_dir="unused", peak_tflops=None,
    )  # fmt: skip
    from hf_varlen.training import TrainConfig

    four_bit = "load_in_4bit" in TrainConfig.__dataclass_fields__
    for mode in bench_e2e.MODES:
        if bench_e2e.MODES[mode].get("peer"):
            continue  # a peer is no hf-varlen train run (tests/scripts/test_bench_peers.py)
        if bench_e2e.MODES[mode].get("load_in_4bit") and not four_bit:
            assert bench_e2e.mode_unavailable(mode, "cuda").startswith("hf-varlen train has no")
            continue
        if bench_e2e.MODES[mode].get("load_in_4bit") and not importlib.util.find_spec(
            "bitsandbytes"
        ):  # validation refuses a 4-bit run without it; the bench skips the mode, naming why
            assert (
                bench_e2e.mode_unavailable(mode, "cuda")
                == "bitsandbytes not installed (QLoRA modes)"
            )
            with pytest.raises(ImportError, match="bitsandbytes"):
                bench_e2e.train_config({**run, "mode": mode}, "cuda").validate()
            continue
        for device in ("cpu", "cuda"):
            bench_e2e.train_config({**run, "mode": mode}, device).validate()


@pytest.mark.parametrize("gqa_flag", [True, False])
def test_minimal_varlen_adapter_matches_padded(monkeypatch, request, gqa_flag):
    """The floor mode's adapter (CUDA-only in real runs) over a stand-in ``varlen_attn`` with the
    torch 2.13 (enable_gqa) or 2.11 (no flag: KV expanded) signature: same loss as padded sdpa."""
    import torch.nn.attention.varlen as varlen_mod
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_varlen
    from hf_varlen.reference.attention import attention_reference

    calls = []

    def causal_window(window_size):
        assert tuple(window_size) == (-1, 0)  # torch varlen_attn's causal spelling
        calls.append(window_size)

    if gqa_flag:

        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):  # fmt: skip
            causal_window(window_size)
            assert enable_gqa
            return attention_reference(q, k, v, cu_q, cu_k, softmax_scale=scale)
    else:

        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            causal_window(window_size)
            assert q.shape[1] == k.shape[1]  # KV heads were expanded
            return attention_reference(q, k, v, cu_q, cu_k, softmax_scale=scale)

    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    # the adapter asks varlen_attn's signature once per process; this test swaps varlen_attn
    bench_e2e._varlen_attn_has_gqa.cache_clear()
    request.addfinalizer(bench_e2e._varlen_attn_has_gqa.cache_clear)
    bench_e2e.register_minimal_attention()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    docs = [torch.randint(0, 64, (n,)) for n in (5, 9, 3)]
    packed = hf_varlen.PackingCollator()([{"input_ids": d.tolist()} for d in docs])
    model.set_attn_implementation(bench_e2e.MINIMAL_ATTN)
    loss_packed = model(**packed).loss
    assert len(calls) == config.num_hidden_layers
    model.set_attn_implementation("sdpa")
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)], labels[i, : len(d)] = d, 1, d
    loss_padded = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss_packed, loss_padded)


def test_compile_modes_configuration():
    """hf_varlen-compile is hf_varlen under --compile (backend from --compile-backend);
    minimal_varlen-compile is minimal_varlen with no trainer compile (the bench applies plain
    torch.compile itself) and needs CUDA like minimal_varlen."""
    run = dict(
        model="tiny-llama", tokenizer="bytes", dataset="builtin", max_length=64, batch_size=2,
        steps=2, lr=1e-3, precision="fp32", seed=0, run_dir="unused", peak_tflops=None,
    )  # fmt: skip
    cfg = bench_e2e.train_config({**run, "mode": "hf_varlen-compile"}, "cuda")
    eager = bench_e2e.train_config({**run, "mode": "hf_varlen"}, "cuda")
    assert cfg.compile and cfg.compile_backend == "inductor" and not eager.compile
    assert {k: v for k, v in vars(cfg).items() if not k.startswith("compile")} == {
        k: v for k, v in vars(eager).items() if not k.startswith("compile")
    }
    cpu = bench_e2e.train_config(
        {**run, "mode": "hf_varlen-compile", "compile_backend": "aot_eager"}, "cpu"
    )
    assert cpu.compile_backend == "aot_eager"
    minimal = bench_e2e.train_config({**run, "mode": "minimal_varlen-compile"}, "cuda")
    assert not minimal.compile and minimal.attn_implementation == bench_e2e.MINIMAL_ATTN
    assert bench_e2e.MODES["minimal_varlen-compile"]["plain_compile"]
    assert bench_e2e.mode_unavailable("minimal_varlen-compile", "cpu") == (
        "torch varlen_attn needs CUDA"
    )
    args = bench_e2e.parse_args(["--modes", e2e_modes.COMPILE_MODES])
    assert args.modes == e2e_modes.COMPILE_MODES.split(",") and args.compile_backend == "inductor"
    graphs = bench_e2e.train_config({**run, "mode": "hf_varlen-graphs"}, "cuda")
    assert graphs.cuda_graphs == "on" and graphs.static_shapes and not graphs.compile
    assert bench_e2e.train_config({**run, "mode": "hf_varlen-graphs"}, "cpu").cuda_graphs == "auto"
    both = bench_e2e.train_config({**run, "mode": "hf_varlen-compile-graphs"}, "cuda")
    assert both.cuda_graphs == "on" and both.compile and both.compile_mode == "default"
    trees = bench_e2e.train_config({**run, "mode": "hf_varlen-reduce-overhead"}, "cuda")
    assert trees.compile and trees.compile_mode == "reduce-overhead" and trees.static_shapes
    assert trees.cuda_graphs == "off"
    assert cfg.compile_mode == "default" and not cfg.static_shapes and cfg.cuda_graphs == "off"


def test_plain_compile_counts_recompiles_into_the_trainer():
    """The integration's plain torch.compile counts each (re)compilation where the trainer's
    step records read it, so a timed step that recompiled is not taken for a steady one."""
    from types import SimpleNamespace

    class Tiny(torch.nn.Module):  # defined here: Dynamo skips the frames of torch.nn's own modules
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x).relu()

    model = Tiny()
    trainer = SimpleNamespace(
        acc=SimpleNamespace(unwrap_model=lambda m: m), model=model,
        compiler=SimpleNamespace(compilations=0),
    )  # fmt: skip
    torch._dynamo.reset()
    bench_e2e.plain_compile(trainer, backend="aot_eager")
    model(torch.randn(2, 4))
    assert trainer.compiler.compilations == 1
    model(torch.randn(2, 4))
    assert trainer.compiler.compilations == 1
    model(torch.randn(3, 4))  # a new size: Dynamo recompiles (dynamic from now on)
    assert trainer.compiler.compilations == 2


def test_plain_compiled_steps_that_compile_are_left_out_of_the_steady_state(tmp_path):
    """End to end on the CPU: the step records of a plain-compiled trainer carry its compilations,
    so bench_e2e's steady state leaves the compiling steps out."""
    from hf_varlen.training import PackedTrainer

    run = dict(
        model="tiny-llama", tokenizer="bytes", dataset="builtin", max_length=256, batch_size=2,
        steps=3, lr=1e-3, precision="fp32", seed=0, run_dir=str(tmp_path), peak_tflops=None,
        mode="hf_varlen",
    )  # fmt: skip
    torch._dynamo.reset()
    trainer = PackedTrainer(bench_e2e.train_config(run, "cpu"))
    bench_e2e.plain_compile(trainer, backend="aot_eager")
    trainer.run()
    records = e2e_measure.trainer_records(str(tmp_path))
    assert len(records) == 3 and records[0]["compilations"] >= 1
    assert bench_e2e._unsteady(records[0])
    assert sum(r.get("compilations", 0) for r in records) == trainer.compiler.compilations


@pytest.mark.slow
def test_hf_varlen_compile_mode_runs_on_cpu(tmp_path):
    """CPU smoke: hf_varlen-compile under aot_eager trains the same losses as hf_varlen and
    reports its compile numbers per cell (minimal_varlen-compile needs CUDA: reported skipped)."""
    modes = "hf_varlen,hf_varlen-compile,minimal_varlen-compile"
    results = bench_e2e.main(
        COMMON
        + ["--batch-sizes", "4", "--modes", modes, "--out", str(tmp_path), "--no-isolate"]
        + ["--compile-backend", "aot_eager"]
    )
    runs = _by_mode(results, 4)
    eager, compiled = runs["hf_varlen"], runs["hf_varlen-compile"]
    assert compiled["status"] == "ok", compiled["status"]
    assert runs["minimal_varlen-compile"]["status"] == "skipped: torch varlen_attn needs CUDA"
    assert 1 <= compiled["compilations"] <= 2 and compiled["graph_breaks"] == 0, compiled
    assert compiled["compile_s"] >= 0 and compiled["first_step_s"] > 0
    assert "compilations" not in eager
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert "compile" in (tmp_path / "e2e_tables.md").read_text()


def test_lora_mode_trains_only_adapters_on_cpu(tmp_path):
    """hf_varlen-lora (peft, r=16 on every linear layer) trains on CPU and its loss moves like a
    LoRA run's: the same first loss as the full fine-tune (zero-initialised B), then other steps."""
    pytest.importorskip("peft")
    results = bench_e2e.main(
        COMMON
        + ["--batch-sizes", "4", "--modes", "hf_varlen,hf_varlen-lora,minimal_varlen-lora"]
        + ["--out", str(tmp_path), "--no-isolate"]
    )
    runs = _by_mode(results, 4)
    full, lora = runs["hf_varlen"], runs["hf_varlen-lora"]
    assert lora["status"] == "ok", lora["status"]
    assert runs["minimal_varlen-lora"]["status"] == "skipped: torch varlen_attn needs CUDA"
    assert lora["losses"][0] == pytest.approx(full["losses"][0], rel=1e-6)
    assert lora["losses"][1:] != pytest.approx(full["losses"][1:], rel=1e-6)


def test_report_writes_the_gpu_busy_table(tmp_path):
    """Cells measured on a GPU carry gpu_busy (e2e_measure.gpu_busy); the report tables it per mode
    and batch size, with '-' where a cell has none (a CPU run, an OOM)."""
    import e2e_report

    def cell(mode, b, busy=None):
        run = dict(model="llama-1b", data="alpaca", max_length=1024, batch_size=b, mode=mode)
        r = dict(run=run, status="ok", tokens_per_s=1e4, peak_gib=1.0, mfu=0.3, losses=[1.0])
        r["kernels"] = "on"
        return {**r, "gpu_busy": busy} if busy is not None else r

    results = [cell("hf_varlen", 8, 0.42), cell("hf_varlen", 32, 0.857), cell("minimal_varlen", 8)]
    out = tmp_path / "tables.md"
    e2e_report.write_tables(results, [], {"gpu": "test"}, out)
    text = out.read_text()
    assert "GPU busy (device kernel time / wall time" in text
    assert "| 8 | 42% | - |" in text and "| 32 | 86% | - |" in text


def test_capture_syncs_counts_each_place_with_its_frames():
    import warnings

    def step():
        for _ in range(3):
            warnings.warn(e2e_host_profile.SYNC_WARNING, stacklevel=1)  # as torch's sync debug mode
        warnings.warn(e2e_host_profile.SYNC_WARNING, stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)

    syncs = e2e_host_profile.capture_syncs(step)
    assert [n for n, _ in syncs] == [3, 1]
    assert all("test_bench_e2e.py" in where and "(step)" in where for _, where in syncs)
    if not torch.cuda.is_available():
        assert e2e_host_profile.sync_points(None, None) == {}  # nothing to watch without CUDA


def test_repeats_interleave_the_modes_and_report_the_median(tmp_path):
    """--repeats R: every batch size runs R rounds of all its modes in alternating order (A B, B A,
    A B), profiles once; the report shows each cell's run of median tokens/s with the range of the
    finished repeats."""
    import e2e_report

    args = bench_e2e.parse_args(
        ["--modes", "minimal_varlen-compile,hf_varlen-compile", "--batch-sizes", "8,32"]
        + ["--repeats", "3", "--profile", "--profile-batch", "8"]
        + ["--profile-modes", "hf_varlen-compile"]
    )
    runs = bench_e2e.run_grid(args)
    order = [(r["batch_size"], r.get("repeat"), r["mode"][:3]) for r in runs]
    rounds = [("min", "hf_"), ("hf_", "min"), ("min", "hf_")]
    assert order[:6] == [(8, i, m) for i in range(3) for m in rounds[i]]
    assert order[6:12] == [(32, i, m) for i in range(3) for m in rounds[i]]
    assert order[12:] == [(8, None, "hf_")] and runs[12]["profile"]
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--repeats", "0"])

    def cell(mode, repeat, tokens_per_s, status="ok"):
        run = dict(model="llama-1b", data="alpaca", max_length=1024, batch_size=8, mode=mode)
        r = dict(run={**run, "repeat": repeat}, status=status, peak_gib=1.0, mfu=0.3, losses=[1.0])
        return {**r, "kernels": "on", "tokens_per_s": tokens_per_s} if status == "ok" else r

    results = [
        cell("a", 0, 15e3), cell("b", 0, 16e3), cell("a", 1, 17e3), cell("b", 1, 9e3),
        cell("a", 2, 12e3), cell("b", 2, None, status="OOM"), cell("c", 0, 5e3),
    ]  # fmt: skip
    merged = e2e_report.median_of_repeats(results)
    assert [r["run"]["mode"] for r in merged] == ["a", "b", "c"]
    a, b, c = merged
    assert a["tokens_per_s"] == 15e3 and a["repeat_tokens_per_s"] == [15e3, 17e3, 12e3]
    assert b["tokens_per_s"] == 9e3 and b["repeats"] == 3  # lower median of the two that ran
    assert "repeats" not in c  # a single run stays as it is
    out = tmp_path / "tables.md"
    e2e_report.write_tables(results, [], {"gpu": "test"}, out)
    text = out.read_text()
    assert (
        "| 8 | 15.0K (median of 3: 12.0-17.0K), 1.0 GiB | 9.0K (median of 2/3: 9.0-16.0K)" in text
    )
    assert text.count("| 8 |") == 2  # one row per batch size (tokens, MFU), not one per repeat


# ---- e2e_host_sampler: the py-spy host profile of a profiled cell ------------------------------

RAW = """\
thread (11): MainThread;<module> (scripts/bench_e2e.py:9);train_step (hf_varlen/training/loop.py:420);call (/tmp/torchinductor_root/ab/cabc.py:77);run (torch/_inductor/runtime/triton_heuristics.py:1300);cuLaunchKernel (libcuda.so.1) 30
thread (11): MainThread;<module> (scripts/bench_e2e.py:9);train_step (hf_varlen/training/loop.py:420);_read_loss_and_norm (hf_varlen/training/loop.py:104);at::native::_local_scalar_dense (libtorch_cuda.so);cudaStreamSynchronize (libcudart.so) 20
thread (11): MainThread;<module> (scripts/bench_e2e.py:9);train_step (hf_varlen/training/loop.py:420);backward (torch/autograd/__init__.py:300);_engine_run_backward (torch/autograd/graph.py:869);pthread_cond_wait (libc.so.6) 40
thread (11): MainThread;<module> (scripts/bench_e2e.py:9);train_step (hf_varlen/training/loop.py:420);step (torch/optim/adamw.py:200);gc_collect_main (libpython3.12.so) 5
thread (11): MainThread;<module> (scripts/bench_e2e.py:9);profile_step (scripts/bench_e2e.py:400) 99
thread (12): pt_autograd_0;backward (torch/_functorch/_aot_autograd/runtime_wrappers.py:2000);call (/tmp/torchinductor_root/cd/ccd.py:10);cuLaunchKernel (libcuda.so.1) 25
thread (12): pt_autograd_0;0x7f00 (libc.so.6);pthread_cond_wait (libc.so.6) 500
thread (13): compile_worker;pthread_cond_wait (libc.so.6) 900
"""


def test_sampler_files_each_step_sample_under_what_the_thread_was_doing():
    import e2e_host_sampler as s

    threads = s.parse_raw(RAW)
    assert set(threads) == {"11 MainThread", "12 pt_autograd_0", "13 compile_worker"}
    got = s.summarize(threads, steps=2, rate=100.0)  # one sample = 10 ms / 2 steps = 5 ms a step
    cats = dict(got["sampled_by_category_ms"])
    assert cats == {
        "backward: waiting for the autograd thread": 200.0,
        "Triton launch (Python)": 150.0,
        "waiting for the GPU (sync)": 100.0,
        "garbage collection": 25.0,
    }  # the 99 samples outside train_step are not the step's
    assert got["sampled_step_ms"] == 475.0
    assert got["sampled_top"][1] == (
        "run (runtime/triton_heuristics.py:1300) > cuLaunchKernel",
        150.0,
    )
    # the autograd thread counts its busy samples only; the idle compile worker is left out
    assert got["sampled_threads"] == {
        "12 pt_autograd_0": {
            "busy_ms": 125.0,
            "by_category_ms": [("Inductor graph code (launch calls, allocations)", 125.0)],
            "top": [("call (cd/ccd.py:10) > cuLaunchKernel", 125.0)],
        }
    }
    assert (
        "no sample inside train_step"
        in s.summarize({"1 x": [(["f (a.py:1)"], 3)]}, 1, 1.0)["sampled"]
    )
    import e2e_report

    cell = {**got, "sampled_steps": 2, "sampled_wall_step_ms": 480.0, "sampled_rate": 100}
    text = "\n".join(e2e_report._sampled_lines(cell))
    assert "100 Hz over 2 steps" in text and "| waiting for the GPU (sync) | 100.00 |" in text
    assert "Thread 12 pt_autograd_0: busy 125.0 ms per step" in text
    not_run = e2e_report._sampled_lines({"sampled": "not run: x"})
    assert not_run == ["", "Host samples (py-spy): not run: x"]


def test_sampled_profile_reports_why_without_py_spy(monkeypatch):
    import e2e_host_sampler as s

    monkeypatch.setattr(s.shutil, "which", lambda name: None)
    assert s.sampled_profile(None, [], 0) == {
        "sampled": "not run: py-spy is not installed (pip install py-spy)"
    }


def test_sampled_profile_samples_real_steps():
    """Against this process, where py-spy is installed and may attach (skipped otherwise)."""
    import e2e_host_sampler as s

    if s.shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed")

    class Trainer:
        def train_step(self, group):
            t = __import__("time").perf_counter()
            while __import__("time").perf_counter() - t < 0.05:
                sum(range(1000))

    got = s.sampled_profile(Trainer(), [[0]], 0)
    if "could not attach" in got.get("sampled", ""):
        pytest.skip(got["sampled"])
    wall = got["sampled_wall_step_ms"]  # ~50 ms; py-spy may miss samples on a loaded machine
    assert wall / 4 <= got["sampled_step_ms"] <= 2 * wall, got
    assert dict(got["sampled_by_category_ms"])["other: test_bench_e2e.py"] >= wall / 4, got


def test_sampler_waits_past_py_spy_warnings_and_reports_its_error():
    import subprocess

    import e2e_host_sampler as s

    def spy(script):
        return subprocess.Popen(
            ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    warned = spy("echo 'py-spy> warning: x'; echo 'py-spy> Sampling process 100 times'; sleep 5")
    attached, said = s._wait_attached(warned, timeout=10.0)
    warned.kill()
    warned.wait()
    assert attached and said.startswith("py-spy> warning: x")
    refused = spy("echo 'Error: Permission Denied'; exit 1")
    assert s._wait_attached(refused, timeout=10.0) == (False, "Error: Permission Denied\n")
    refused.wait()


def test_device_time_leaves_out_user_annotations():
    """GPU busy and the step profile sum device kernels only: a record_function range that the
    profiler puts on the device timeline (the optimizer's step annotation) is not a kernel."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(device_type=cuda, is_user_annotation=False)
    annotation = SimpleNamespace(device_type=cuda, is_user_annotation=True)
    older = SimpleNamespace(device_type=cuda)  # a torch without the attribute
    host = SimpleNamespace(device_type=cpu, is_user_annotation=False)
    assert [bench_common.is_device_kernel(e) for e in (kernel, annotation, older, host)] == [
        True,
        False,
        True,
        False,
    ]


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", e2e_measure.PEAK_TFLOPS_H200),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("Tesla T4", None),
    ],
)
def test_mfu_peak_follows_the_gpu(monkeypatch, name, peak):
    """The measured H200 peak only on an H200; elsewhere the GPU's spec peak, or no MFU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert e2e_measure.default_peak_tflops(cuda=True) == peak
    assert e2e_measure.default_peak_tflops(cuda=False) is None
