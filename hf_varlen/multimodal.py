"""Packing vision-language examples: images stay with their documents, multimodal positions
restart per document.

    from hf_varlen.multimodal import MultimodalPackingCollator

    model = Qwen2VLForConditionalGeneration.from_pretrained(name, attn_implementation="varlen_packed")
    collator = MultimodalPackingCollator(rope_index=model.model.get_rope_index)
    loss = model(**collator(examples)).loss

Why. Qwen2-VL, Qwen2.5-VL and Qwen3-VL place image and video tokens with multimodal RoPE
(mRoPE): three position rows (temporal, height, width), computed by the model's own
``get_rope_index`` from the token types and the image grids. Given a packed row and no positions,
the model computes that index over the whole row, so the positions of the second document continue
from the first one's and its result changes (a tiny Qwen2-VL in fp64: 1.9e-6 off each sample alone;
with the positions below: 1.8e-15). So this collator asks the model's own ``get_rope_index`` for the
positions of every document alone and concatenates them: the multimodal RoPE sections are left to
transformers, and the text-position row that transformers reads for packed-sequence detection
restarts per document. The attention itself takes the collator's ``cu_seq_lens_q/k``
(``varlen_packed``), so no token, image tokens included, attends across documents; the vision
tower runs each image alone whatever the batch (transformers splits it by ``image_grid_thw``).

Keys. Each example holds ``input_ids`` (and optionally ``labels``), ``mm_token_type_ids`` (0 text,
1 image, 2 video, per token) and, when it has images or videos, ``pixel_values`` /
``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` (and ``second_per_grid_ts``
for Qwen2.5-VL videos) as the processor returns them for that example alone. The batch:

    input_ids, labels      [1, T]          as PackingCollator (T = real tokens + padding)
    mm_token_type_ids      [1, T]          0 on padding
    position_ids           [4, 1, T]       row 0 text positions (restarting per document), rows 1-3
                                           each document's own multimodal index; padding: text
    pixel_values           [sum P_i, D]    the examples' rows in document order (videos likewise)
    image_grid_thw         [sum n_i, 3]    likewise
    cu_seq_lens_q/k, max_length_q/k        as PackingCollator

Refused with a clear error: vision inputs without ``mm_token_type_ids`` or without ``rope_index``,
vision inputs on an empty example. Models whose image tokens attend bidirectionally (Gemma 3 and
the like) are refused by ``varlen_packed`` itself (their ``_supports_flash_attn = False``): a causal
varlen mask cannot express attention inside an image both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .collator import PackingCollator

__all__ = ["MultimodalPackingCollator"]

# Per-example tensors concatenated along dim 0 in document order, and the grids that go with them.
_ROWS = ("pixel_values", "pixel_values_videos")
_GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_VISION = _ROWS + _GRIDS


def _tensor(value: Any, key: str, i: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"features[{i}][{key!r}]: expected a tensor or array, got {type(value).__name__}"
        ) from exc


@dataclass
class MultimodalPackingCollator(PackingCollator):
    """``PackingCollator`` for vision-language examples (module doc).

    Args (besides PackingCollator's):
        rope_index: the model's multimodal RoPE index, ``model.model.get_rope_index``; called once
            per document that has images or videos, with that document's ``input_ids``,
            ``mm_token_type_ids`` and grids, returning ``(3, 1, n)`` positions first.
    """

    rope_index: Callable[..., Any] | None = None

    def __call__(
        self, features: Any, return_tensors: str | None = None, separator_id: int | None = None
    ):
        if not isinstance(features, Sequence) or not all(isinstance(f, Mapping) for f in features):
            raise TypeError("features: MultimodalPackingCollator takes a list of example dicts")
        if return_tensors not in (None, "pt") or self.return_tensors != "pt":
            raise ValueError("return_tensors: multimodal batches are built as torch tensors ('pt')")
        text = [{k: f[k] for k in ("input_ids", "labels") if k in f} for f in features]
        batch = super().__call__(text, return_tensors="pt", separator_id=separator_id)

        docs = []  # (input_ids, mm_token_type_ids, {grid key: tensor}) of each non-empty example
        rows: dict[str, list[torch.Tensor]] = {k: [] for k in _VISION}
        for i, f in enumerate(features):
            ids = _tensor(f["input_ids"], "input_ids", i).reshape(-1)
            vision = {k: _tensor(f[k], k, i) for k in _VISION if f.get(k) is not None}
            if ids.numel() == 0:
                if vision:
                    raise ValueError(
                        f"features[{i}]: an example without tokens carries {sorted(vision)}; its "
                        "images would belong to no document. Drop it or keep its tokens"
                    )
                continue
            types = f.get("mm_token_type_ids")
            if types is None:
                if vision:
                    raise ValueError(
                        f"features[{i}]: {sorted(vision)} without 'mm_token_type_ids': the "
                        "multimodal positions need each token's type (the processor returns it; "
                        "call it with return_mm_token_type_ids=True)"
                    )
                types = torch.zeros_like(ids)
            types = _tensor(types, "mm_token_type_ids", i).reshape(-1)
            if types.numel() != ids.numel():
                raise ValueError(
                    f"features[{i}]: mm_token_type_ids has {types.numel()} entries for "
                    f"{ids.numel()} input_ids"
                )
            for k, v in vision.items():
                rows[k].append(v)
            docs.append((ids, types, {k: v for k, v in vision.items() if k in _GRIDS}))

        total = batch["input_ids"].shape[1]
        real = sum(ids.numel() for ids, _, _ in docs)
        types = torch.zeros(1, total, dtype=torch.long)
        if docs:
            types[0, :real] = torch.cat([t for _, t, _ in docs]).long()
        batch["mm_token_type_ids"] = types
        for k, parts in rows.items():
            if parts:
                batch[k] = torch.cat(parts, dim=0)
        if any(grids for _, _, grids in docs):
            if self.rope_index is None:
                raise ValueError(
                    "rope_index: the batch has images or videos; pass the model's multimodal RoPE "
                    "index, MultimodalPackingCollator(rope_index=model.model.get_rope_index), so "
                    "that their positions restart per document"
                )
            batch["position_ids"] = self._positions(batch["position_ids"], docs)
        return batch

    def _positions(self, text: torch.Tensor, docs) -> torch.Tensor:
        """(4, 1, T): text positions, then each document's own multimodal index (module doc)."""
        positions = text.expand(3, -1).clone()[:, None, :]  # (3, 1, T)
        start = 0
        for ids, types, grids in docs:
            n = ids.numel()
            if grids:
                index = self.rope_index(ids[None], mm_token_type_ids=types[None], **grids)
                index = index[0] if isinstance(index, tuple) else index
                if tuple(index.shape) != (3, 1, n):
                    raise ValueError(
                        f"rope_index: returned positions of shape {tuple(index.shape)} for a "
                        f"document of {n} tokens, expected (3, 1, {n})"
                    )
                positions[:, :, start : start + n] = index.to(positions.dtype)
            start += n
        return torch.cat([text[None], positions], dim=0)
