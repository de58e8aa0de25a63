"""What the launch set up: CPU or GPU processes, and how the processes share the work.

``cpu_requested()`` decides ``Accelerator(cpu=...)`` and refuses a launch that would run one process
where several were asked for; ``distribution(acc)`` names the data-parallel scheme for the summary
and refuses an FSDP launch that accelerate runs unsharded. Both raise before anything is loaded.
``release_stale_state(mixed)`` lets a second run in one single-process session use another
precision.
"""

from __future__ import annotations

import os

import torch

from ..ops.common import env_flag


def release_stale_state(mixed_precision: str) -> None:
    """Forget accelerate's process-wide state when it holds another mixed precision and this is
    one process outside any launcher: accelerate refuses a second ``Accelerator`` of another
    precision, so a notebook or a sweep that runs bf16-mixed and then fp32 would fail. Under a
    launcher (several processes, a process group) the state is the launcher's and stays."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if not shared or shared.get("_mixed_precision") == mixed_precision:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return
    AcceleratorState._reset_state(reset_partial_state=True)


def distribution(acc) -> str:
    """How the processes share the work ("one process", "DDP", "FSDP2", ...), after refusing a
    launch whose FSDP request accelerate did not honour: on CPU it sets up plain data parallelism
    (MULTI_CPU) for an FSDP config without a word, which would train unsharded."""
    from accelerate.utils import DistributedType

    kind = acc.distributed_type
    if env_flag("ACCELERATE_USE_FSDP") and kind != DistributedType.FSDP:
        raise ValueError(
            f"the launch asks for FSDP (ACCELERATE_USE_FSDP, e.g. scripts/accelerate/fsdp2.yaml) "
            f"but accelerate set up {kind.value} on {acc.device.type}, which does not shard: FSDP "
            "through accelerate needs GPUs. Launch CPU processes with "
            "scripts/accelerate/cpu_2proc.yaml (data parallel), or run on GPUs"
        )
    if acc.num_processes == 1:
        return "one process"
    kind_name = (
        f"FSDP{getattr(acc.state.fsdp_plugin, 'fsdp_version', 1)}"
        if kind == DistributedType.FSDP
        else "DDP"
        if kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
        else str(kind.value)
    )
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    return f"{kind_name} over {backend}" if backend else kind_name


def cpu_requested() -> bool:
    """CPU processes: no CUDA, or ``accelerate launch --cpu``. Refuses the launch that would
    silently run one process instead of several (see the hint)."""
    cpu = env_flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    single = not any(
        os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    )
    if env_flag("ACCELERATE_USE_CPU") and os.environ.get("MASTER_ADDR") and single:
        raise ValueError(
            "`accelerate launch --cpu --num_processes N` (N > 1) starts only ONE process unless "
            "it runs under mpirun, so this would not be a multi-process run. Launch CPU "
            "processes with torchrun instead: `accelerate launch --multi_gpu --num_processes N "
            "...` or `--config_file scripts/accelerate/cpu_2proc.yaml` (hf_varlen uses gloo "
            "when there is no GPU)"
        )
    return cpu
