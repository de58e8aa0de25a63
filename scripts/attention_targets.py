"""Issue 16's targets for scripts/bench_attention.py: triton against FA4 per target case, the share
of the HBM floor, and the cases where triton is slower than torch's varlen_attn, judged from the
benchmark's rows (dicts with case, heads, provider, fb_ms, floor_fb_ms)."""

from __future__ import annotations

# Issue 16's targets (H200, bf16, 32/8/128 causal, forward+backward, one run with FA4): case ->
# the least triton speedup over FA4 (FA4's f+b time / triton's).
FA4_TARGETS = {"32k+alpaca32k": 1.0, "128k": 0.9, "lima64k": 1.3, "alpaca64k": 3.0}
TARGET_HEADS = "32/8/128"
FLOOR_TARGETS = {"alpaca64k": 0.40}  # least share of the HBM floor (f+b)


def targets(rows) -> list[str]:
    """One line per target: measured against wanted, and whether it is met ("n/a" when a needed
    provider did not run). Last: the cases where triton is slower than torch's varlen_attn."""
    fb = {
        (r["case"], r["provider"]): r for r in rows if r["heads"] == TARGET_HEADS and "fb_ms" in r
    }
    lines = []
    for case, want in FA4_TARGETS.items():
        tri, fa4 = fb.get((case, "triton")), fb.get((case, "fa4"))
        if tri is None or fa4 is None:
            lines.append(f"{case}: triton >= {want}x FA4: n/a (needs triton and fa4 rows)")
            continue
        got = fa4["fb_ms"] / tri["fb_ms"]
        lines.append(f"{case}: triton {got:.2f}x FA4 (target >= {want}x): {_met(got >= want)}")
    for case, want in FLOOR_TARGETS.items():
        if (tri := fb.get((case, "triton"))) is not None:
            got = tri["floor_fb_ms"] / tri["fb_ms"]
            lines.append(
                f"{case}: triton at {got:.0%} of its HBM floor (target >= {want:.0%}): "
                f"{_met(got >= want)}"
            )
    slower = [
        f"{case} ({fb[case, 'torch']['fb_ms'] / tri['fb_ms']:.2f}x)"
        for (case, prov), tri in fb.items()
        if prov == "triton" and (case, "torch") in fb and tri["fb_ms"] > fb[case, "torch"]["fb_ms"]
    ]
    ran = sum(1 for case, prov in fb if prov == "triton" and (case, "torch") in fb)
    lines.append(
        f"slower than torch varlen_attn: {', '.join(slower) or 'none'} (of {ran} cases with both)"
    )
    return [f"{TARGET_HEADS} {line}" for line in lines]


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"
