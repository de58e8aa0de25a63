"""A transformers ``TrainerCallback`` that reads hf_varlen's deferred offset checks in time.

    from hf_varlen import OffsetsCheckCallback

    trainer = Trainer(model, args, data_collator=PackingCollator(), callbacks=[OffsetsCheckCallback()])

After the first CUDA batch, ``varlen_packed`` reads its check that the collator's ``cu_seq_lens_q/k``
cover the batch back without a host sync (``hf_varlen.coverage``): a bad batch is reported at the
next forward, i.e. after the optimizer step that used it. This callback reads the pending checks
right before every optimizer step (``on_pre_optimizer_step``) instead, so a bad batch stops the run
before it updates the weights — at the cost of one host sync per optimizer step (free where the
step already reads something back, e.g. when the loss or grad norm is logged every step).
``hf-varlen train`` does the same in its own loop; ``VarlenSFTTrainer`` adds this callback itself
(TRL's ``num_tokens`` metric reads back every step anyway).
"""

from __future__ import annotations

from transformers import TrainerCallback

from ...coverage import check_pending_offsets

__all__ = ["OffsetsCheckCallback"]


class OffsetsCheckCallback(TrainerCallback):
    """Raise ValueError before the optimizer step when a batch's ``cu_seq_lens`` did not cover it."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        check_pending_offsets()
        return control
