"""``hf-varlen train --compile``: torch.compile of the training model, counted and never silent.

What ``--compile`` does:

- ``model.compile(backend=--compile-backend, fullgraph=True)`` in place (``nn.Module.compile``, so
  parameter names, checkpoints and the exported model are those of the eager model), after the
  eager one-token trial forward. Default mode; ``fullgraph=True`` because the packed path is
  graph-break free (issue 13): a break would be a host round trip every step, so it is an error
  that names its source instead of a silent slowdown.
- Every micro-batch is marked dynamic before the forward (``hf_varlen.metadata.mark_dynamic_pack``:
  the token dimension and the document count; for padded batches the sequence dimension of the
  attention mask too), and the collator's ``max_length_q/k`` ints are traced symbolic from the
  start, as is the loss's ``num_items_in_batch`` (``hf_varlen.metadata.symbolic_batch_ints``:
  ``torch.compiler.config.dynamic_sources``), so changing packs do not recompile: one graph for
  training (padded batches: rows and length marked dynamic; a one-row batch is a graph of its
  own). Eval (``model.eval()`` under ``no_grad``) is a graph of its own. With ``--static-shapes``
  the batches take only the ladder's token counts and one ``cu_seq_lens`` length; they are still
  marked dynamic, because one graph per bucket would exceed Dynamo's recompile limit (the static
  shapes are for CUDA graphs, captured per bucket: ``--cuda-graphs``, ``training/graphs.py``).
- Dynamo's recompile limit raises instead of falling back to eager
  (``fail_on_recompile_limit_hit``), and every compile failure is re-raised as ``CompileError``
  with the reason and a way out: nothing silently runs eager.
- The summary reports the number of compilations, the steps that compiled, the first step's time
  against the later steps' mean, and the estimated compile time (the compiling steps' excess).

``--compile-backend`` (advanced, default ``inductor``): any ``torch._dynamo.list_backends()`` name;
``aot_eager`` traces forward and backward without generating code (CPU tests, telling Inductor
failures apart from tracing ones).

Inductor is also told not to specialise on the token count where its own heuristics would
(``token_count_patches``), because packs on both sides of such a size compile once more per size:

- shape padding (``shape_padding``): deciding whether to pad a matmul's dims to an alignment, it
  compares the row count M (the tokens) with the matmul's K and N and guards on the answer. This is
  the recompile measured on the H200 (torch 2.11): a tiny model's graphs guarded
  ``T < 97`` and ``T < 64`` (its vocabulary and hidden size), and packs of 64+ tokens compiled a
  third graph; at the 1B shape the same guard sits at T = 2048, inside the range of batch-32 packs.
  Padding a dynamic M is never done anyway, and real models' K / N are already aligned.
- mix-order reduction (``triton.mix_order_reduction_non_strict_mode``): this fusion compares the
  row count of a reduction with fixed sizes (2 x the columns, 4096 rows, 5M elements); its
  non-strict mode skips those checks, "helpful to avoid recompilations" in Inductor's own words.

``--compile-mode`` (Inductor only, default ``default``): the ``torch.compile(mode=...)`` presets
(``torch._inductor.list_mode_options()``), handed to Inductor as its config patches, as
``torch.compile`` itself does. ``reduce-overhead`` turns on CUDA graphs (cudagraph trees; one graph
per batch shape, so pair it with ``--static-shapes``; each micro-step is marked a new step, and
CPU tensors skip graphs as Inductor decides). Not yet measured on the GPU against the default mode.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ..metadata import symbolic_batch_ints
from .run_options import CompileOptions

DEFAULT_BACKEND = "inductor"
DEFAULT_MODE = "default"


def _mode_options(mode: str | None = None):
    """Inductor's config patches of a torch.compile mode; without one, all modes by name."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode) if mode else list_mode_options()


def token_count_patches() -> dict[str, Any]:
    """Inductor config patches that keep it from guarding on the token count of a pack (see the
    module doc); empty where this torch's Inductor has no such heuristic."""
    from torch._inductor import config

    patches: dict[str, Any] = {}
    if hasattr(config, "shape_padding"):
        patches["shape_padding"] = False
    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        patches["triton.mix_order_reduction_non_strict_mode"] = True
    return patches


class CompileError(RuntimeError):
    """``--compile`` was requested but torch.compile could not honour it (the reason inside)."""


def check_compile(cfg: CompileOptions) -> None:
    """Refuse a ``--compile`` this torch cannot honour, before anything is loaded."""
    if not cfg.compile:
        for flag, value, default in (
            ("--compile-backend", cfg.compile_backend, DEFAULT_BACKEND),
            ("--compile-mode", cfg.compile_mode, DEFAULT_MODE),
        ):
            if value != default:
                raise ValueError(
                    f"{flag} {value!r} applies only with --compile; pass --compile or drop {flag}"
                )
        return
    if cfg.compile_mode != DEFAULT_MODE:
        modes = list(_mode_options())
        if cfg.compile_mode not in modes:
            raise ValueError(f"--compile-mode {cfg.compile_mode!r}: expected one of {modes}")
        if cfg.compile_backend != "inductor":
            raise ValueError(
                f"--compile-mode {cfg.compile_mode!r} is an Inductor mode, but --compile-backend "
                f"is {cfg.compile_backend!r}; drop one of them"
            )
    import torch._dynamo
    from torch._dynamo import eval_frame

    try:
        eval_frame.check_if_dynamo_supported()
        if cfg.compile_backend == "inductor":
            eval_frame.check_if_inductor_supported()
    except RuntimeError as exc:
        raise CompileError(
            f"--compile: torch.compile is not supported here: {exc}. Hint: drop --compile"
        ) from exc
    try:
        torch._dynamo.lookup_backend(cfg.compile_backend)
    except Exception as exc:  # InvalidBackend (torch._dynamo.exc): an unknown name
        raise ValueError(
            f"--compile-backend {cfg.compile_backend!r}: not a torch.compile backend here; "
            f"known: {torch._dynamo.list_backends()} (default {DEFAULT_BACKEND!r})"
        ) from exc


class ModelCompiler:
    """Compiles the model in place and counts its compilations (a wrapper backend)."""

    def __init__(self, cfg: CompileOptions):
        self.enabled = cfg.compile
        self.backend = cfg.compile_backend
        self.mode = cfg.compile_mode
        self.mode_options: dict[str, Any] = {}  # Inductor config patches of --compile-mode
        if self.enabled and self.mode != DEFAULT_MODE:
            self.mode_options = dict(_mode_options(self.mode))
        self.cudagraphs = bool(self.mode_options.get("triton.cudagraphs"))
        self.inductor_patches: dict[str, Any] = {}  # what compile_fx gets (Inductor only)
        if self.enabled and self.backend == "inductor":
            self.inductor_patches = {**self.mode_options, **token_count_patches()}
        self.dynamo_patches: dict[str, Any] = {}  # set by compile() from the model
        self.compilations = 0
        self.backend_seconds = 0.0  # inside the backend (code generation), not dynamo's tracing

    def __call__(self, gm, example_inputs):
        """The torch.compile backend: count, then hand the graph to the real backend."""
        self.compilations += 1
        t0 = time.perf_counter()
        try:
            if self.inductor_patches:  # --compile-mode's presets, as torch.compile(mode=...)
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches=self.inductor_patches)
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        finally:
            self.backend_seconds += time.perf_counter() - t0

    def compile(self, model) -> None:
        if self.enabled:
            from ..metadata import checkpointed_side_effects

            self.dynamo_patches = checkpointed_side_effects(model)
            model.compile(backend=self, fullgraph=True)

    def mark(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Mark a device batch dynamic (after ``.to(device)``, which drops marks)."""
        if self.enabled:
            from ..metadata import mark_dynamic_pack

            mark_dynamic_pack(inputs)
            mask = inputs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() >= 1:  # padded [B, L] batches
                torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)
                if mask.dim() == 2:  # the number of rows changes too (B = 1 stays its own graph)
                    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
                        t = inputs.get(key)
                        if isinstance(t, torch.Tensor) and t.dim() == 2:
                            torch._dynamo.maybe_mark_dynamic(t, 0)
        return inputs

    def guard(self):
        """Context for every compiled call: no silent eager fallback, failures with a reason.
        With CUDA graphs, each call is a new step for the cudagraph trees (its outputs of the
        previous call have been consumed by then: the loop detaches and sums the loss at once)."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self._guard()

    @contextlib.contextmanager
    def _guard(self):
        import torch._dynamo
        from torch._dynamo.exc import TorchDynamoException

        try:
            with (
                torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **self.dynamo_patches),
                symbolic_batch_ints(),
            ):
                yield
        except TorchDynamoException as exc:
            reason = " ".join(str(exc).split("\n\n")[0].split())[:1500]
            raise CompileError(
                f"--compile: torch.compile(backend={self.backend!r}, mode={self.mode!r}, "
                "fullgraph=True) of the model "
                f"failed after {self.compilations} compilation(s): {type(exc).__name__}: {reason}. "
                "Hint: drop --compile to train eagerly, or --compile-backend aot_eager to tell an "
                "Inductor failure from a tracing one (TORCH_LOGS=graph_breaks,recompiles shows "
                "where)"
            ) from exc

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Compile numbers for the run summary (None without --compile)."""
        if not self.enabled:
            return None
        compiled = [r for r in records if r.get("compilations")]
        steady = [r["step_time"] for r in records if not r.get("compilations")]
        later = sum(steady) / len(steady) if steady else None
        excess = sum(r["step_time"] - (later or 0.0) for r in compiled)
        first = records[0]["step_time"] if records else None
        out = {
            "backend": self.backend,
            "mode": self.mode,
            "fullgraph": True,
            "dynamic": "token dimension and document count marked dynamic",
            "compilations": self.compilations,
            "compiled_steps": [r["step"] for r in compiled],
            "first_step_s": first,
            "later_step_s": later,
            "compile_s": excess if later is not None else None,
            "backend_s": self.backend_seconds,
        }
        steps = ", ".join(str(s) for s in out["compiled_steps"]) or "none (eval only)"
        timing = (
            f"first step {first:.2f} s vs {later:.3f} s per later step; ~{excess:.1f} s compiling"
            if later is not None and first is not None
            else "no step without a compilation to compare with"
        )
        out["text"] = (
            f"torch.compile backend {self.backend}, mode {self.mode}, fullgraph; {self.compilations} "
            f"compilation(s) (steps {steps}); {timing}"
        )
        return out
