"""TRL's DPO and GRPO trainers with packed log-prob passes (hf_varlen.integrations.trainers.preference).

The packed pass must be the padded one: per-token log-probs, entropies and their gradients of
right-padded (DPO's layout) and left+right-padded (GRPO's prompt + completion layout) rows, packed
through ``varlen_packed`` in fp32, against the padded rows through ``sdpa`` in fp64 and fp32
(numerics rule). Then the trainers: DPO's loss and gradients equal ``DPOTrainer``'s on the same
batch, TRL's own ``test_train_padding_free`` with our attention name, and a GRPO run whose
log-prob passes reach the attention as one packed row.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import hf_varlen  # noqa: E402, F401  (registers varlen_packed)
from hf_varlen.integrations.trainers.preference import (  # noqa: E402
    PackedLogProbs,
    VarlenDPOTrainer,
    VarlenGRPOTrainer,
    pack_rows,
)
from hf_varlen.testing import assert_numerics  # noqa: E402

WORDS = [
    "hi",
    "hello",
    "there",
    "no",
    "yes",
    "maybe",
    "say",
    "the",
    "a",
    "cat",
    "dog",
    "sun",
    "moon",
    "red",
    "blue",
    "green",
    "one",
    "two",
    "three",
]
FIELDS = ("log_probs", "entropy")


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few words: a small vocabulary keeps TRL's LM head cheap."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )


def _config(vocab: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=2,
    )


def _model(attn: str, dtype=torch.float32, state=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation=attn).to(dtype)
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model


def _padded_rows(left: bool):
    """Rows of different lengths: right-padded (DPO) or a left-padded prompt then a right-padded
    completion (GRPO). Labels score the completion part only, -100 elsewhere."""
    g = torch.Generator().manual_seed(1)
    prompts, completions = [3, 5, 2, 6], [4, 1, 7, 3]
    p_len, c_len = max(prompts), max(completions)
    length = p_len + c_len if left else max(p + c for p, c in zip(prompts, completions))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        start = p_len - p if left else 0
        ids[r, start : start + p + c] = torch.randint(3, 64, (p + c,), generator=g)
        if left:  # the prompt ends at p_len, the completion follows it there
            ids[r, p_len : p_len + c] = torch.randint(3, 64, (c,), generator=g)
            ids[r, p_len + c :] = 0
            mask[r, start : p_len + c] = 1
            labels[r, p_len : p_len + c] = ids[r, p_len : p_len + c]
        else:
            mask[r, : p + c] = 1
            labels[r, p : p + c] = ids[r, p : p + c]
    return ids, mask, labels


def _fields(model, ids, mask, labels, packed: bool):
    add_fused_lm_head(model, outputs=FIELDS)
    caller = PackedLogProbs(model) if packed else model
    out = caller(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    model.zero_grad()
    out.log_probs.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {f: getattr(out, f).detach() for f in FIELDS}, grads


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_and_right_padded"])
def test_packed_log_probs_equal_padded(left):
    ids, mask, labels = _padded_rows(left)
    packed_model = _model("varlen_packed")
    state = {k: v.detach().clone() for k, v in packed_model.state_dict().items()}
    x, gx = _fields(packed_model, ids, mask, labels, packed=True)
    lo, glo = _fields(_model("sdpa", state=state), ids, mask, labels, packed=False)
    hi, ghi = _fields(_model("sdpa", torch.float64, state), ids, mask, labels, packed=False)
    scored = labels[:, 1:] != -100
    for f in FIELDS:
        assert x[f].shape == lo[f].shape == (ids.shape[0], ids.shape[1] - 1)
        assert torch.all(x[f][~scored] == 0), f"{f}: non-zero where no label is scored"
        assert_numerics(f, x[f], hi[f], lo[f])
    for n in gx:
        assert_numerics(f"grad {n}", gx[n], ghi[n], glo[n], factor=3.0, terms=int(scored.sum()))


def test_pack_rows_layout():
    ids, mask, labels = _padded_rows(left=True)
    packed = pack_rows(ids, labels, mask)
    lengths = mask.sum(1)
    assert packed["cu_seq_lens"].tolist() == [0, *lengths.cumsum(0).tolist()]
    assert packed["max_length"] == int(lengths.max())
    assert packed["input_ids"].tolist() == [ids[mask.bool()].tolist()]
    assert packed["position_ids"].tolist() == [sum((list(range(n)) for n in lengths.tolist()), [])]
    # a document's first label would be predicted from the previous document: never scored
    starts = packed["cu_seq_lens"][:-1].long()
    assert torch.all(packed["labels"][0, starts] == -100)


def test_refusals():
    with pytest.raises(ValueError, match="attn_implementation='varlen_packed'"):
        PackedLogProbs(_model("eager"))
    model = _model("varlen_packed")
    add_fused_lm_head(model)
    ids, mask, labels = _padded_rows(left=False)
    with pytest.raises(NotImplementedError, match="pixel_values"):
        PackedLogProbs(model)(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            fused_lm_head=True,
            pixel_values=torch.zeros(1, 3, 4, 4),
        )
    mask[1] = 0
    with pytest.raises(ValueError, match="at least one real token"):
        PackedLogProbs(model)(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def _preference_data(n: int = 6) -> Dataset:
    rows = []
    for i in range(n):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 4))
        chosen = " " + " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(1 + (i * 5) % 6))
        rejected = " " + " ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(1 + (i * 3) % 5))
        rows.append(dict(prompt=prompt, chosen=chosen, rejected=rejected))
    return Dataset.from_list(rows)


def _dpo(cls, attn, tmp_path, dtype=torch.float32, state=None, **config):
    model = _model(attn, dtype, state)
    args = DPOConfig(
        output_dir=str(tmp_path / cls.__name__),
        report_to="none",
        per_device_train_batch_size=3,
        bf16=False,
        use_cpu=True,
        **config,
    )
    return cls(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=_preference_data(),
        processing_class=_tokenizer(),
    )


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_dpo_loss_and_grads_equal_padded(tmp_path):
    """One DPO loss on the same batch: packed (fp32) against TRL's padded DPOTrainer on sdpa
    attention (fp64 and fp32). The reference model is perturbed so that the loss is not log 2."""
    packed = _dpo(VarlenDPOTrainer, "varlen_packed", tmp_path)
    state = {k: v.detach().clone() for k, v in packed.model.state_dict().items()}
    with torch.no_grad():
        for p in packed.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref_state = {k: v.detach().clone() for k, v in packed.ref_model.state_dict().items()}
    lo = _dpo(DPOTrainer, "sdpa", tmp_path, state=state)
    hi = _dpo(DPOTrainer, "sdpa", tmp_path, torch.float64, state)
    for t, dtype in ((lo, torch.float32), (hi, torch.float64)):
        t.ref_model.load_state_dict({k: v.to(dtype) for k, v in ref_state.items()})
    batch = packed.data_collator([packed.train_dataset[i] for i in range(4)])
    x, gx = _loss_and_grads(packed, batch)
    l_lo, g_lo = _loss_and_grads(lo, batch)
    l_hi, g_hi = _loss_and_grads(hi, batch)
    assert abs(float(l_hi) - 0.6931) > 1e-3, (
        "the perturbed reference should move the loss off log 2"
    )
    assert_numerics("dpo loss", x, l_hi, l_lo, terms=int(batch["completion_mask"].sum()))
    for n in gx:
        assert_numerics(f"grad {n}", gx[n], g_hi[n], g_lo[n], factor=3.0)


class _Spy:
    """Records the cu_seq_lens of every attention call that reached varlen_packed."""

    def __init__(self, monkeypatch):
        self.calls = []
        fn = ALL_ATTENTION_FUNCTIONS["varlen_packed"]

        def spy(module, q, k, v, mask, **kw):
            self.calls.append(kw.get("cu_seq_lens_q"))
            return fn(module, q, k, v, mask, **kw)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "varlen_packed", spy)


def test_trl_dpo_padding_free_test_with_varlen_packed(tmp_path, monkeypatch):
    """TRL's own ``test_train_padding_free`` (tests/test_dpo_trainer.py) with our attention name
    instead of the flash-attn kernel and a local tiny model instead of the Hub one; bf16 as there.
    Plus: the attention saw packed rows (one row, one document per sequence)."""
    spy = _Spy(monkeypatch)
    trainer = _dpo(
        VarlenDPOTrainer,
        "varlen_packed",
        tmp_path,
        learning_rate=0.1,
        padding_free=True,
        max_steps=3,
    )
    trainer.args.bf16 = True
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, p in previous.items():
        assert not torch.allclose(p, trainer.model.get_parameter(n)), (
            f"Parameter {n} has not changed"
        )
    packed = [cu for cu in spy.calls if cu is not None]
    assert packed, "no attention call received packed offsets"
    # 3 pairs per batch: 6 sequences, so 7 offsets
    assert all(cu.numel() == 7 for cu in packed), sorted({cu.numel() for cu in packed})


def test_grpo_log_probs_packed(tmp_path, monkeypatch):
    """Two GRPO steps (TRL's generation, a length reward): every log-prob pass reaches the
    attention as one packed row; the packed pass equals TRL's padded one on the same batch."""

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    # from a local folder, as a user's model id: TRL loads the reference model from it (beta > 0)
    path = tmp_path / "tiny"
    _model("varlen_packed").save_pretrained(path)
    args = GRPOConfig(
        model_init_kwargs={"attn_implementation": "varlen_packed", "dtype": torch.float32},
        output_dir=str(tmp_path / "grpo"),
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        bf16=False,
        use_cpu=True,
        beta=0.1,
        logging_steps=1,
    )
    prompts = Dataset.from_list([{"prompt": " ".join(WORDS[i : i + 2 + i % 3])} for i in range(8)])
    trainer = VarlenGRPOTrainer(
        model=str(path),
        reward_funcs=reward_len,
        args=args,
        train_dataset=prompts,
        processing_class=_tokenizer(),
    )
    spy = _Spy(monkeypatch)
    trainer.train()
    packed = [cu for cu in spy.calls if cu is not None]
    assert packed, "no log-prob pass reached varlen_packed packed"
    # 4 rows (2 prompts x 2 generations) per pass: one document each
    assert any(cu.numel() == 5 for cu in packed), sorted({cu.numel() for cu in packed})
    assert all(
        torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h
    )

    # the same padded batch through TRL's padded pass (fp32, and fp64 as the high reference)
    # and through ours
    ids, mask, _ = _padded_rows(left=True)
    keep = 6
    padded = super(VarlenGRPOTrainer, trainer)._get_per_token_logps_and_entropies
    with torch.no_grad():
        lo, _, _ = padded(trainer.model, ids, mask, keep)
        hi, _, _ = padded(copy.deepcopy(trainer.model).double(), ids, mask, keep)
        x, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    assert x.shape == lo.shape == (ids.shape[0], keep)
    assert_numerics("grpo log-probs", x, hi, lo)
