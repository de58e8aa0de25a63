"""Tables and plots of the end-to-end benchmark (scripts/bench_e2e.py's results.json).

``write_tables`` renders the markdown for docs/BENCHMARKS.md (tokens/s and peak memory by batch
size per mode, MFU and the loss gap to the padded baseline, the data-only padding table, the step
profiles); ``write_plots`` the PNGs (tokens/s vs batch size, padding efficiency vs batch size, loss
vs step and vs wall-clock). A result is ``{"status": ..., "run": {...}, metrics...}`` as
``bench_e2e.run_one`` returns it.

    python scripts/e2e_report.py runs/bench_e2e/results.json --plots-dir docs
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def loss_gap(result: dict, baseline: dict | None) -> float | None:
    """Largest |loss - baseline loss| / baseline loss over the common steps."""
    if not baseline or baseline.get("status") != "ok" or result.get("status") != "ok":
        return None
    pairs = list(zip(result["losses"], baseline["losses"], strict=False))
    return max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None


# Unit roundoff of the precision a run trained in: a loss value itself carries this much.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp32": 2.0**-24}
REFERENCE_MODES = ("hf_varlen", "hf_varlen-lora", "hf_varlen-qlora")


def _family(mode: str) -> str:
    return "qlora" if "qlora" in mode else "lora" if "lora" in mode else "full"


def check_losses(results: list[dict], rtol: float | None = None) -> list[dict]:
    """Whether every mode's per-step losses agree with the reference mode's on the same examples
    (same model, data, length, batch size; full fine-tuning, LoRA and QLoRA apart), in the spirit
    of the numerics rule (hf_varlen.testing): the tolerance is 2 x the spread among our own modes
    (the reference against each other of ours: eager, compiled, captured, the minimal
    integration: the same math in other kernels) + 2 x the unit roundoff of the loss in the
    run's precision + 2 x the fp32 reduction floor over the step's tokens; ``rtol`` replaces it. Each finished cell gets ``loss_check`` = {reference,
    gap, tol, agree}; returns those rows. A mode that disagrees is flagged in the tables and left
    out of the tokens/s plot, not compared as faster."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        run = r["run"]
        if r.get("status") != "ok" or run.get("profile") or not r.get("losses"):
            continue
        key = (
            run["model"],
            run["data"],
            run["max_length"],
            run["batch_size"],
            run.get("repeat", 0),
        )
        groups.setdefault((*key, _family(run["mode"])), []).append(r)
    rows = []
    for key, rs in groups.items():
        own = [r for r in rs if not r["run"].get("peer")]
        ref = next((r for r in own if r["run"]["mode"] in REFERENCE_MODES), (own or rs)[0])
        spread = max((loss_gap(r, ref) or 0.0 for r in own if r is not ref), default=0.0)
        unit = UNIT_ROUNDOFF.get(ref["run"].get("precision"), UNIT_ROUNDOFF["bf16"])
        # the loss is an fp32 mean over up to batch x max_length tokens, summed in another order
        # by each system: the rule's reduction floor, u_fp32 * (1 + ceil(log2(terms)))
        terms = max(2, int(key[3]) * int(key[2]))
        reduction = UNIT_ROUNDOFF["fp32"] * (1 + math.ceil(math.log2(terms)))
        tol = rtol if rtol is not None else 2 * spread + 2 * unit + 2 * reduction
        for r in rs:
            gap = loss_gap(r, ref) or 0.0
            check = dict(reference=ref["run"]["mode"], gap=gap, tol=tol, agree=gap <= tol)
            r["loss_check"] = check
            rows.append(dict(zip(("model", "data", "max_length", "batch_size"), key[:4],
                                 strict=True), family=key[5], mode=r["run"]["mode"], **check))  # fmt: skip
    return rows


def diverged(r: dict) -> bool:
    return r.get("loss_check", {}).get("agree") is False


def median_of_repeats(results: list[dict]) -> list[dict]:
    """One result per configuration: ``--repeats`` runs of a cell (the same model, data, length,
    batch size and mode; profiles are kept as they are) are replaced by the run of median tokens/s,
    with ``repeat_tokens_per_s`` (every finished repeat, in run order) and ``repeats`` (how many
    ran) added. Host-bound cells swing from run to run, so one run per cell can rank two modes
    either way; interleaved repeats and their median make the ratio a measurement."""
    cells: dict[tuple, list[dict]] = {}  # insertion order: each cell where its first run was
    for i, r in enumerate(results):
        run = r["run"]
        key = (
            ("profile", i)
            if run.get("profile")
            else (run["model"], run["data"], run["max_length"], run["batch_size"], run["mode"])
        )
        cells.setdefault(key, []).append(r)
    return [_median_run(rs) for rs in cells.values()]


def _median_run(rs: list[dict]) -> dict:
    """The run of median tokens/s among the repeats ``rs`` that finished (the lower median: a run
    that happened), annotated; a single run, or one with no finished repeat, as it is."""
    if len(rs) == 1:  # also every profile (it has no tokens/s)
        return rs[0]
    done = [r for r in rs if r.get("status") == "ok"]  # in run order
    if not done:
        return rs[0]
    ok = sorted(done, key=lambda r: r["tokens_per_s"])
    finished = [r["tokens_per_s"] for r in done]
    return {**ok[(len(ok) - 1) // 2], "repeats": len(rs), "repeat_tokens_per_s": finished}


def fmt_cell(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "?").split(":")[0]
    if diverged(r):  # not tabled as faster: its loss left the others'
        c = r["loss_check"]
        return f"DIVERGED: loss gap {c['gap']:.1e} > {c['tol']:.1e} to {c['reference']}"
    if "tokens_per_s" not in r:  # a profiled step
        return f"profiled step {r['step_ms']:.1f} ms"
    text = f"{r['tokens_per_s'] / 1e3:.1f}K, {r['peak_gib']:.1f} GiB"
    if r.get("repeats", 1) > 1:  # median_of_repeats: the median and the range it came from
        runs = r["repeat_tokens_per_s"]
        text = (
            f"{r['tokens_per_s'] / 1e3:.1f}K (median of {len(runs)}"
            + (f"/{r['repeats']}" if len(runs) < r["repeats"] else "")
            + f": {min(runs) / 1e3:.1f}-{max(runs) / 1e3:.1f}K), {r['peak_gib']:.1f} GiB"
        )
    if "compile_s" in r:  # compile modes (bench_e2e.compile_stats)
        breaks = f", {r['graph_breaks']} breaks" if r.get("graph_breaks") else ""
        text += f", compile {r['compile_s']:.0f} s ({r['compilations']} graphs{breaks})"
        if r.get("worker_cell"):  # e2e_workers: this mode's earlier cells compiled the rest
            text += " after earlier cells"
    elif "warmup_s" in r:  # a peer: its warm-up steps (its compile included) and start-up
        start = sum(r.get(k, 0.0) for k in ("import_s", "load_s"))
        text += f", warm-up {r['warmup_s']:.0f} s, start-up {start:.0f} s"
    if r.get("excluded_steps"):  # timed steps that compiled or captured, left out of tokens/s
        text += f", {r['excluded_steps']} capture/compile steps excluded"
    return text


def _mode_table(title: str, modes: list[str], sizes: list[int], cell: dict, value) -> list[str]:
    """Markdown lines: ``title``, then one row per batch size and one column per mode, each cell
    ``value(cell, mode, batch_size)`` (``cell``: results keyed by (mode, batch size))."""
    lines = ["", title, "", "| per-device batch | " + " | ".join(modes) + " |"]
    lines.append("|---" * (len(modes) + 1) + "|")
    for b in sizes:
        lines.append(f"| {b} | " + " | ".join(value(cell, m, b) for m in modes) + " |")
    return lines


def _tokens_cell(cell: dict, mode: str, b: int) -> str:
    return fmt_cell(cell.get((mode, b), {"status": "-"}))


def _mfu_gap_cell(cell: dict, mode: str, b: int) -> str:
    r = cell.get((mode, b), {})
    if r.get("status") != "ok":
        return "-"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
    gap = loss_gap(r, cell.get(("padded_sdpa", b)))
    return mfu + (f" / {gap:.1e}" if gap is not None else "")


def _busy_cell(cell: dict, mode: str, b: int) -> str:
    r = cell.get((mode, b), {})
    if "gpu_busy" in r:
        return f"{r['gpu_busy']:.0%}"
    return "error (gpu_busy_error in results.json)" if "gpu_busy_error" in r else "-"


def write_tables(results: list[dict], padding: list[dict], header: dict, path: Path) -> None:
    lines = ["## End-to-end training (scripts/bench_e2e.py)", "", "```", json.dumps(header), "```"]
    results = median_of_repeats(results)
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if not r["run"].get("profile"):
            key = (r["run"]["model"], r["run"]["data"], r["run"]["max_length"])
            groups.setdefault(key, []).append(r)
    for (model, data, max_length), rs in groups.items():
        modes = list(dict.fromkeys(r["run"]["mode"] for r in rs))
        sizes = sorted({r["run"]["batch_size"] for r in rs})
        cell = {(r["run"]["mode"], r["run"]["batch_size"]): r for r in rs}
        layers = rs[0]["run"].get("layers")
        title = f"### {model}{f' ({layers} layers)' if layers else ''}, {data}, max_length "
        lines += _mode_table(f"{title}{max_length}: real tokens/s, peak memory", modes, sizes,
                             cell, _tokens_cell)  # fmt: skip
        lines += _mode_table("MFU / max relative loss gap to padded_sdpa over the run:", modes,
                             sizes, cell, _mfu_gap_cell)  # fmt: skip
        if any("gpu_busy" in r or "gpu_busy_error" in r for r in rs):
            lines += _mode_table(
                "GPU busy (device kernel time / wall time of one extra step after the timed ones):",
                modes, sizes, cell, _busy_cell,
            )  # fmt: skip
        # What each mode really ran with (on a CPU the layer kernels are off, for instance).
        ran = {r["run"]["mode"]: r["kernels"] for r in rs if r.get("status") == "ok"}
        lines += ["", "Kernels per mode: " + "; ".join(f"{m}: {k}" for m, k in ran.items())]
        # Why a cell did not run, in full (the tables show its first word).
        why = {
            (r["run"]["mode"], r["status"])
            for r in rs
            if str(r.get("status")).startswith("skipped")
        }
        if why:
            lines += [
                "",
                "Not run: " + "; ".join(f"{m}: {s[len('skipped: ') :]}" for m, s in sorted(why)),
            ]
        lines += _attention_lines(rs)
        lines += _loss_check_lines(rs)
    if padding:
        lines += [
            "",
            "### Padding efficiency by batch size (data only: real tokens / tokens of the padded "
            "batch)",
            "",
            "| data | max_length | per-device batch | padded to longest in batch | padded to "
            "max_length | real tokens per batch |",
            "|---|---|---|---|---|---|",
        ]
        for p in padding:
            lines.append(
                f"| {p['data']} | {p['max_length']} | {p['batch_size']} | "
                f"{p['padded_efficiency']:.1%} | {p['static_efficiency']:.1%} | "
                f"{p['tokens_per_batch']:.0f} |"
            )
    profiles = [r for r in results if r["run"].get("profile") and r.get("status") == "ok"]
    for r in profiles:
        run = r["run"]
        lines += [
            "",
            f"### Where one step goes: {run['model']}, {run['mode']}, batch {run['batch_size']} "
            f"({r['real_tokens']} tokens, step {r['step_ms']:.1f} ms wall; {r['clock']})",
            "",
            "| category | ms | share |",
            "|---|---|---|",
        ]
        total = sum(r["by_category_ms"].values()) or 1.0
        for cat, ms in r["by_category_ms"].items():
            lines.append(f"| {cat} | {ms:.2f} | {ms / total:.0%} |")
        lines += ["", "| top kernels | ms | category |", "|---|---|---|"]
        for ms, cat, name in r["top"][:12]:
            lines.append(f"| `{name}` | {ms:.2f} | {cat} |")
        if r.get("host_top"):
            lines += [
                "",
                f"Host: {r['host_ms']:.1f} ms of self CPU time in ops (profiler overhead included)",
                "",
                "| top host ops | ms | calls |",
                "|---|---|---|",
            ]
            for ms, calls, name in r["host_top"][:12]:
                lines.append(f"| `{name}` | {ms:.2f} | {calls} |")
        if r.get("python_top"):
            lines += [
                "",
                f"Python (cProfile, {r['python_step_ms']:.1f} ms per step with its overhead): "
                f"{r['python_ms']:.1f} ms in Python functions' own time, "
                f"{r['python_calls']:.0f} calls per step",
                "",
                "| top Python functions (own time) | ms per step | calls per step |",
                "|---|---|---|",
            ]
            for ms, calls, where in r["python_top"][:15]:
                lines.append(f"| `{where}` | {ms:.2f} | {calls:.0f} |")
        if r.get("sync_points") is not None:
            total = sum(n for n, _ in r["sync_points"])
            lines += ["", f"Host-device syncs in one step (sync debug mode): {total}", ""]
            lines += [f"- {n} x `{where}`" for n, where in r["sync_points"][:10]]
        lines += _sampled_lines(r)
    path.write_text("\n".join(lines) + "\n")


def _attention_lines(rs: list[dict]) -> list[str]:
    """Per mode: the attention kernels its profiled step ran (most time first), what a peer says
    it ran (Unsloth's counters), its precision policy and library versions where it has its
    own environment."""
    lines = []
    for mode in dict.fromkeys(r["run"]["mode"] for r in rs):
        cells = [r for r in rs if r["run"]["mode"] == mode and r.get("status") == "ok"]
        if not cells:
            continue
        r = max(cells, key=lambda c: c["run"]["batch_size"])
        parts = []
        if r.get("attention_kernels"):
            parts.append(
                "kernels " + ", ".join(f"`{n}` x{c}" for n, c, _ in r["attention_kernels"][:3])
            )
        if r.get("attention"):
            parts.append(str(r["attention"]))
        if r.get("precision_policy"):
            parts.append(r["precision_policy"])
        if r.get("versions"):
            parts.append(", ".join(f"{k} {v}" for k, v in r["versions"].items()))
        if parts:
            lines.append(f"- {mode} (batch {r['run']['batch_size']}): " + "; ".join(parts))
    return ["", "Attention each mode ran, precision, environment:", "", *lines] if lines else []


def _loss_check_lines(rs: list[dict]) -> list[str]:
    """The loss agreement per batch size and mode (check_losses), the largest gap first."""
    checked = [r for r in rs if "loss_check" in r]
    if not checked:
        return []
    lines = [
        "",
        "Loss agreement (max relative gap of the per-step losses to the reference mode on the "
        "same examples; tolerance: 2 x the spread among our own modes + 2 x the unit roundoff):",
        "",
        "| batch | mode | reference | max rel. gap | tolerance | |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(checked, key=lambda r: (r["run"]["batch_size"], -r["loss_check"]["gap"])):
        c = r["loss_check"]
        verdict = "agrees" if c["agree"] else "**DIVERGED**"
        lines.append(
            f"| {r['run']['batch_size']} | {r['run']['mode']} | {c['reference']} | "
            f"{c['gap']:.2e} | {c['tol']:.2e} | {verdict} |"
        )
    return lines


def _sampled_lines(r: dict) -> list[str]:
    """The py-spy section of a profiled cell (e2e_host_sampler), or why it did not run."""
    if "sampled" in r:
        return ["", f"Host samples (py-spy): {r['sampled']}"]
    if not r.get("sampled_by_category_ms"):
        return []
    lines = [
        "",
        f"Host wall time of the step's thread (py-spy, {r['sampled_rate']} Hz over "
        f"{r['sampled_steps']} steps, native frames, idle samples kept): "
        f"{r['sampled_step_ms']:.1f} ms per sampled step "
        f"({r['sampled_wall_step_ms']:.1f} ms measured while sampling)",
        "",
        "| what the thread was doing | ms per step |",
        "|---|---|",
    ]
    lines += [f"| {c} | {ms:.2f} |" for c, ms in r["sampled_by_category_ms"][:14]]
    lines += ["", "| innermost Python frame > native leaf | ms per step |", "|---|---|"]
    lines += [f"| `{w}` | {ms:.2f} |" for w, ms in r["sampled_top"][:15]]
    for t, info in r.get("sampled_threads", {}).items():
        lines += ["", f"Thread {t}: busy {info['busy_ms']:.1f} ms per step", ""]
        lines += ["| what it was doing | ms per step |", "|---|---|"]
        lines += [f"| {c} | {ms:.2f} |" for c, ms in info["by_category_ms"][:10]]
        lines += ["", "| innermost Python frame > native leaf | ms per step |", "|---|---|"]
        lines += [f"| `{w}` | {ms:.2f} |" for w, ms in info["top"][:10]]
    return lines


def write_plots(results: list[dict], padding: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(str(out_dir / name))

    groups: dict[tuple, list[dict]] = {}
    for r in median_of_repeats(results):
        if r.get("status") == "ok" and not r["run"].get("profile"):
            key = (r["run"]["model"], r["run"]["data"], r["run"]["max_length"])
            groups.setdefault(key, []).append(r)
    for (model, data, max_length), rs in groups.items():
        tag = f"{model}_{data}_L{max_length}"
        by_batch = (  # metric, scale, axis label, file name
            ("tokens_per_s", 1e-3, "real tokens/s (K)", f"e2e_tokens_per_s_{tag}.png"),
            ("peak_gib", 1.0, "peak memory (GiB)", f"e2e_memory_{tag}.png"),
            ("gpu_busy", 100.0, "GPU busy (% of the step)", f"e2e_gpu_busy_{tag}.png"),
        )
        for key, scale, label, name in by_batch:
            if not any(key in r for r in rs):  # no GPU-busy figures off the GPU
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
            for mode in dict.fromkeys(r["run"]["mode"] for r in rs):
                pts = sorted(
                    (r["run"]["batch_size"], r[key])
                    for r in rs  # a diverged cell is not plotted as a speed
                    if r["run"]["mode"] == mode and key in r and not diverged(r)
                )
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], "o-", ms=3, label=mode)
            ax.set_xscale("log", base=2)
            ax.set(xlabel="per-device batch (examples)", ylabel=label)
            ax.set_title(f"{model}, {data}, max_length {max_length}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            save(fig, name)
        # Loss curves: every mode at the largest batch that padded_sdpa ran, else that any ran.
        sizes = sorted({r["run"]["batch_size"] for r in rs if r["run"]["mode"] == "padded_sdpa"})
        sizes = sizes or sorted({r["run"]["batch_size"] for r in rs})
        for x_key, name in (("step", "loss_vs_step"), ("elapsed", "loss_vs_time")):
            if not sizes:
                break
            b = sizes[-1]
            fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
            for r in rs:
                if r["run"]["batch_size"] != b:
                    continue
                xs = r["elapsed"] if x_key == "elapsed" else list(range(1, len(r["losses"]) + 1))
                ax.plot(xs, r["losses"], lw=1.1, label=r["run"]["mode"])
            ax.set(xlabel="wall-clock (s)" if x_key == "elapsed" else "step", ylabel="loss")
            ax.set_title(f"{model}, {data}, L {max_length}, batch {b}: loss per mode")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            save(fig, f"e2e_{name}_{tag}.png")
    if padding:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        for data, max_length in dict.fromkeys((p["data"], p["max_length"]) for p in padding):
            pts = [p for p in padding if (p["data"], p["max_length"]) == (data, max_length)]
            ax.plot(
                [p["batch_size"] for p in pts],
                [100 * p["padded_efficiency"] for p in pts],
                "o-",
                ms=3,
                label=f"{data}, L {max_length}",
            )
        ax.set_xscale("log", base=2)
        ax.set(xlabel="per-device batch (examples)", ylabel="real tokens in padded batch (%)")
        ax.set_title("padding efficiency (packed: 100%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "e2e_padding_efficiency.png")
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Re-render bench_e2e tables and plots")
    p.add_argument(
        "results",
        nargs="+",
        help="results.json files written by bench_e2e.py (several: one per call of a grid that "
        "ran a batch size per call, merged into one table and one chart per model and data)",
    )
    p.add_argument("--plots-dir", default=None, help="default: next to the first results.json")
    p.add_argument("--out", default=None, help="the tables' file (default: next to the first)")
    p.add_argument("--loss-rtol", type=float, default=None, help="as bench_e2e.py --loss-rtol")
    args = p.parse_args(argv)
    first = Path(args.results[0])
    header, padding, results = None, [], []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        header = header or data["header"]
        padding += [row for row in data["padding"] if row not in padding]
        results += data["results"]
    check_losses(results, args.loss_rtol)
    write_tables(results, padding, header, Path(args.out or first.parent / "e2e_tables.md"))
    write_plots(results, padding, Path(args.plots_dir or first.parent))


if __name__ == "__main__":
    main()
