"""A launched captured step's result on its way to the host.

``GraphedStep.launch`` queues a step and returns its (loss, grad norm, skipped) before the GPU has
computed them; the caller queues the next step and reads this one later. A plain ``.tolist()`` of
the device tensor at read time would enqueue the copy behind everything queued since, the next
step included, so the read would wait for that step too and the GPU would idle from each read to
the next launch, as without a step in flight. The copy is therefore queued at launch, right after
the step's own kernels, into pinned host memory, with an event behind it: the read waits for this
step only.

Shape legend: ``values`` (3,) float32: loss, grad norm, skipped (1.0) of one step.
"""

from __future__ import annotations

import torch


class StepResult:
    """One launched step's (loss, grad norm, skipped): ``tolist`` returns them on the host,
    waiting for the step's own copy only. On the CPU (no streams) a copy made at launch."""

    __slots__ = ("values", "ready")

    def __init__(self, out: torch.Tensor):
        if out.is_cuda:
            self.values = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.values.copy_(out, non_blocking=True)  # in stream order: after this step's kernels
            self.ready: torch.cuda.Event | None = torch.cuda.Event()
            self.ready.record()
        else:
            self.values, self.ready = out.clone(), None  # ``out`` is overwritten by the next step

    def tolist(self) -> list[float]:
        if self.ready is not None:
            # Host wait, intended: the step's one read-back, on its own copy's event
            self.ready.synchronize()
        return self.values.tolist()
