"""What each of bench_e2e's modes is: the ``hf-varlen train`` options it sets (hf_varlen in full,
the 15-line ``varlen_attn`` integration, LoRA / QLoRA, the captured and compiled steps), the
peers (e2e_peers, each in its own worker and environment), the lists the evidence script runs,
and why a mode cannot run on this machine. No torch import: the launcher reads it cheaply."""

from __future__ import annotations

from e2e_peers import PEERS  # no torch, no hf_varlen: cheap

MINIMAL_ATTN = "bench_minimal_varlen"

# The two configurations the modes vary: hf_varlen in full, and the 15-line integration.
FULL = dict(attn_backend="auto", fused_kernels="on", fused_loss="on")
MINIMAL = dict(attn_implementation=MINIMAL_ATTN, fused_kernels="off", fused_loss="off")

LORA = dict(lora=True, lora_r=16)
QLORA = dict(LORA, load_in_4bit=True)
GRAPHS = dict(static_shapes=True, cuda_graphs="on")

MODES: dict[str, dict] = {
    "padded_sdpa": dict(padded=True, fused_kernels="off", fused_loss="off"),
    "packed_sdpa": {**MINIMAL, "attn_implementation": "sdpa"},
    "packed_flex": {**MINIMAL, "attn_implementation": "flex_attention"},
    "minimal_varlen": dict(MINIMAL),
    "hf_varlen": dict(FULL),
    "hf_varlen-attn": {**FULL, "attn_backend": "torch"},
    "hf_varlen-kernels": {**FULL, "fused_kernels": "off"},
    "hf_varlen-loss": {**FULL, "fused_loss": "off"},
    "liger_packed": {**MINIMAL, "liger": True},
    "hf_varlen-compile": {**FULL, "compile": True},
    # Compiled with one of our pieces switched off, where Inductor generates its own code instead
    # (its fusions of RoPE / RMSNorm / SwiGLU; its cross-entropy over materialised logits).
    "hf_varlen-compile-kernels": {**FULL, "fused_kernels": "off", "compile": True},
    "hf_varlen-compile-loss": {**FULL, "fused_loss": "off", "compile": True},
    # LoRA (r=16 on every linear layer, peft): the base weights frozen, so the step is mostly
    # forward + activation gradients, where a user's small fine-tune lives (issue 14 item 5).
    "hf_varlen-lora": {**FULL, "lora": True, "lora_r": 16},
    "minimal_varlen-lora": {**MINIMAL, "lora": True, "lora_r": 16},
    "minimal_varlen-compile": {**MINIMAL, "plain_compile": True},
    # The captured step (hf-varlen train --cuda-graphs on): forward + backward per batch shape
    # and the fused AdamW update replayed from CUDA graphs; eager kernels, or compiled ones.
    "hf_varlen-graphs": {**FULL, "static_shapes": True, "cuda_graphs": "on"},
    "hf_varlen-compile-graphs": {
        **FULL,
        "static_shapes": True,
        "cuda_graphs": "on",
        "compile": True,
    },
    # No speed flags: `hf-varlen train`'s own auto rule picks the step (captured_step/auto_mode.py).
    "hf_varlen-auto": {**FULL, "cuda_graphs": "auto", "static_shapes": None},
    # The other mechanism: Inductor's cudagraph trees (forward + backward; the update eager).
    "hf_varlen-reduce-overhead": {
        **FULL,
        "compile": True,
        "compile_mode": "reduce-overhead",
        "static_shapes": True,
    },
    # LoRA on the fast paths, and QLoRA: the same adapters over a 4-bit NF4 base (bitsandbytes,
    # compute in bf16; hf-varlen train --load-in-4bit).
    "hf_varlen-lora-compile": {**FULL, **LORA, "compile": True},
    "hf_varlen-lora-graphs": {**FULL, **LORA, **GRAPHS},
    "hf_varlen-lora-compile-graphs": {**FULL, **LORA, **GRAPHS, "compile": True},
    "minimal_varlen-lora-compile": {**MINIMAL, **LORA, "plain_compile": True},
    "hf_varlen-qlora": {**FULL, **QLORA},
    "hf_varlen-qlora-compile": {**FULL, **QLORA, "compile": True},
    "hf_varlen-qlora-graphs": {**FULL, **QLORA, **GRAPHS},
    "minimal_varlen-qlora": {**MINIMAL, **QLORA},
    # The peers, each in its own worker process and environment (e2e_peers).
    **{name: {"peer": name} for name in PEERS},
}
DEFAULT_MODES = "padded_sdpa,packed_sdpa,packed_flex,minimal_varlen,hf_varlen,hf_varlen-attn,hf_varlen-kernels,hf_varlen-loss,liger_packed"
COMPILE_MODES = "minimal_varlen,minimal_varlen-compile,hf_varlen,hf_varlen-compile"
BENCH_ONLY = ("liger", "plain_compile", "peer")  # mode keys that are not TrainConfig fields
# The seed's grid: our default, best and eager modes beside the peers and the 15-line integration,
# eager and compiled, one invocation per batch size (gpu_evidence.sh peers). On the 1B shape the
# first seven took 380 s at batch 8 and 310 s at batch 32 on an H100 (two compiles of 75-125 s
# each; the eager cells ~15 s), so a batch size fits one 10-minute call; the default first, so a
# cut run keeps its cell.
PEER_FULL_MODES = (
    "hf_varlen-auto,unsloth,minimal_varlen-compile,hf_varlen-compile-graphs,trl-liger,trl-sdpa,"
    "minimal_varlen,hf_varlen"
)
PEER_LORA_MODES = "hf_varlen-lora,hf_varlen-lora-graphs,minimal_varlen-lora,unsloth-lora"
PEER_QLORA_MODES = "hf_varlen-qlora,hf_varlen-qlora-graphs,minimal_varlen-qlora,unsloth-qlora"


def mode_unavailable(mode: str, device: str) -> str | None:
    """Why ``mode`` cannot run here, or None."""
    import importlib.util

    spec = MODES[mode]
    if spec.get("load_in_4bit"):
        from hf_varlen.training import TrainConfig

        if "load_in_4bit" not in TrainConfig.__dataclass_fields__:
            return "hf-varlen train has no --load-in-4bit in this tree (QLoRA)"
        if device != "cuda":
            return "4-bit (bitsandbytes NF4) bases need CUDA"
        if importlib.util.find_spec("bitsandbytes") is None:
            return "bitsandbytes not installed (QLoRA modes)"
    if spec.get("liger") and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed"
    if spec.get("lora") and importlib.util.find_spec("peft") is None:
        return "peft not installed (LoRA modes)"
    if spec.get("attn_implementation") == MINIMAL_ATTN and device != "cuda":
        return "torch varlen_attn needs CUDA"
    if spec.get("attn_implementation") == "flex_attention" and device != "cuda":
        return "flex_attention backward needs CUDA"
    return None
