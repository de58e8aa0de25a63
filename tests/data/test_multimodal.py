"""Packed vision-language SFT (hf_varlen.multimodal): text and image samples mixed in one row.

A tiny Qwen2-VL / Qwen2.5-VL (a 2-layer vision tower, images of different grids) packed with
MultimodalPackingCollator through ``varlen_packed`` in fp32 must equal each sample alone through
``sdpa`` in fp64 and fp32 (numerics rule): logits, the summed token loss and every gradient,
vision tower included. (``eager`` is no fp64 reference: its softmax runs in fp32.) The same batch
packed without per-document multimodal positions must fail that check, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

import hf_varlen  # noqa: F401  (registers varlen_packed)
from hf_varlen.integrations.transformers import check_model
from hf_varlen.multimodal import MultimodalPackingCollator
from hf_varlen.testing import assert_numerics

IMG, VS, VE, VID = 60, 61, 62, 63
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # a large init scale, so that wrong positions show above rounding
    initializer_range=0.3,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
)
TOKENS = dict(
    image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=VID
)


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(
        depth=2, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
        temporal_patch_size=1, in_channels=3, initializer_range=0.3,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration, Qwen2VLConfig(
        text_config=TEXT, vision_config=vision, **TOKENS
    )


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        depth=2, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2,
        patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3,
        window_size=8, fullatt_block_indexes=[1], initializer_range=0.3,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
        text_config=TEXT, vision_config=vision, **TOKENS
    )


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(TEXT, head_dim=8)
    text["rope_parameters"] = dict(TEXT["rope_parameters"], mrope_interleaved=True)
    vision = dict(
        depth=2, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2,
        patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3,
        num_position_embeddings=16, deepstack_visual_indexes=[0], initializer_range=0.3,
    )  # fmt: skip
    return Qwen3VLForConditionalGeneration, Qwen3VLConfig(
        text_config=text, vision_config=vision, **TOKENS
    )


FAMILIES = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}


def _samples(g: torch.Generator) -> list[dict]:
    """Three samples: text + image (two grids), text only, text + image; labels on text only."""

    def sample(before: int, grid, after: int) -> dict:
        parts = [torch.randint(0, 50, (before,), generator=g)]
        example = {}
        if grid is not None:
            t, h, w = grid
            parts += [torch.tensor([VS]), torch.full((t * h * w // 4,), IMG), torch.tensor([VE])]
            example["pixel_values"] = torch.randn(t * h * w, 12, generator=g, dtype=torch.float64)
            example["image_grid_thw"] = torch.tensor([grid])
        parts.append(torch.randint(0, 50, (after,), generator=g))
        ids = torch.cat(parts)
        types = (ids == IMG).long()
        labels = ids.masked_fill((ids == IMG) | (ids == VS) | (ids == VE), -100)
        return dict(input_ids=ids, labels=labels, mm_token_type_ids=types, **example)

    return [sample(3, (1, 4, 4), 5), sample(9, None, 0), sample(2, (1, 4, 2), 7)]


def _model(family: str, attn: str, dtype, state=None):
    cls, config = FAMILIES[family]()
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    model.set_attn_implementation(attn)
    return model


def _cast(batch: dict, dtype) -> dict:
    return {k: v.to(dtype) if k.startswith("pixel_values") else v for k, v in batch.items()}


def _run(model, batch, dtype):
    """(logits [T, V], summed token NLL, gradients) of one forward + backward."""
    model.zero_grad()
    out = model(**_cast(batch, dtype), use_cache=False)
    labels = batch["labels"][0]
    logits = out.logits[0]
    nll = torch.nn.functional.cross_entropy(
        logits[:-1], labels[1:], ignore_index=-100, reduction="sum"
    )
    nll.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), nll.detach(), grads


def _alone(model, samples, dtype):
    """Each sample alone, its logits concatenated, NLL and gradients summed."""
    logits, nll, grads = [], 0.0, {}
    for s in samples:
        batch = {
            k: v[None] if k in ("input_ids", "labels", "mm_token_type_ids") else v
            for k, v in s.items()
        }
        lg, n, g = _run(model, batch, dtype)
        logits.append(lg)
        nll = nll + n
        for k, v in g.items():
            grads[k] = grads.get(k, 0) + v
    return torch.cat(logits), nll, grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_images_equal_each_sample_alone(family):
    samples = _samples(torch.Generator().manual_seed(0))
    packed_model = _model(family, "varlen_packed", torch.float32)
    state = {k: v.detach().clone() for k, v in packed_model.state_dict().items()}
    collator = MultimodalPackingCollator(rope_index=packed_model.model.get_rope_index)
    batch = collator(samples)
    assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
    assert batch["pixel_values"].shape[0] == sum(
        s["pixel_values"].shape[0] for s in samples if "pixel_values" in s
    )
    x, x_nll, gx = _run(packed_model, batch, torch.float32)
    lo, lo_nll, glo = _alone(_model(family, "sdpa", torch.float32, state), samples, torch.float32)
    hi, hi_nll, ghi = _alone(_model(family, "sdpa", torch.float64, state), samples, torch.float64)
    assert_numerics("logits", x, hi, lo)
    n_labels = int((batch["labels"] != -100).sum())
    assert_numerics("summed nll", x_nll, hi_nll, lo_nll, terms=n_labels)
    assert set(gx) == set(ghi), "packed and alone runs trained different parameters"
    vision = [n for n in gx if ".visual." in n or n.startswith("model.visual")]
    assert vision, "no vision-tower gradient: the images did not reach the model"
    for n in gx:
        assert_numerics(f"grad {n}", gx[n], ghi[n], glo[n], factor=3.0, terms=n_labels)


def test_packing_without_document_positions_is_wrong():
    """The positions matter: in fp64 (where rounding is ~1e-15), the row packed with each
    document's own multimodal index equals each sample alone to rounding, while the same row with
    one index over the whole row (what the model computes when a plain collator gives it no
    positions) is off by orders of magnitude more."""
    samples = _samples(torch.Generator().manual_seed(0))
    model = _model("qwen2_vl", "varlen_packed", torch.float64)
    alone, _, _ = _alone(
        _model("qwen2_vl", "sdpa", torch.float64, model.state_dict()), samples, torch.float64
    )
    right = MultimodalPackingCollator(rope_index=model.model.get_rope_index)(samples)
    wrong = dict(right)
    del wrong["position_ids"]
    err_right = (_run(model, right, torch.float64)[0] - alone).abs().max().item()
    err_wrong = (_run(model, wrong, torch.float64)[0] - alone).abs().max().item()
    assert err_wrong > 1e4 * max(err_right, 1e-300), (err_right, err_wrong)


def test_refusals():
    samples = _samples(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="rope_index"):
        MultimodalPackingCollator()(samples)
    bad = [dict(samples[0])]
    del bad[0]["mm_token_type_ids"]
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        MultimodalPackingCollator(rope_index=lambda *a, **k: None)(bad)
    empty = [
        dict(
            samples[0],
            input_ids=torch.zeros(0, dtype=torch.long),
            labels=torch.zeros(0, dtype=torch.long),
        )
    ]
    with pytest.raises(ValueError, match="without tokens"):
        MultimodalPackingCollator(rope_index=lambda *a, **k: None)(empty + samples[1:])
    # text-only batches need no rope_index and keep PackingCollator's positions
    text = MultimodalPackingCollator()([samples[1]])
    assert text["position_ids"].tolist() == [list(range(9))]


def test_bidirectional_image_attention_is_refused():
    """Gemma 3 attends both ways inside an image; a causal varlen mask cannot: refused loudly."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            image_size=16, patch_size=4,
        ),
        mm_tokens_per_image=4,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(cfg)
    with pytest.raises(ValueError, match="cannot serve"):
        check_model(model)
