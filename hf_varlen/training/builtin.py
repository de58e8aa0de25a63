"""What `hf-varlen train` needs when given nothing: a tokenizer, data and model shapes, no downloads.

- ``byte_tokenizer()``: a byte-level tokenizer (256 byte tokens + 4 specials, vocab 260) built in
  code with ``tokenizers``; every UTF-8 string round-trips. It has a ChatML-style chat template, so
  the chat format works too.
- ``builtin_records(n, seed)``: ``n`` deterministic Alpaca-style records (instruction / input /
  output) from small rule-based tasks over word lists (repeat, upper-case, sort, reverse, count,
  spell numbers, templated stories). Responses are (mostly) a function of the prompt, so a tiny
  model's loss falls fast. Lengths are long-tailed like real instruction data (median ~150 bytes,
  a tenth over ~400, a few near 1024), so padding each batch to its longest example would waste
  most of its tokens: the padding that packing avoids shows in the run's summary.
- ``PRESETS``: random-init model shapes by name (``tiny-*`` for CPU runs and tests; ``llama-1b`` and
  ``qwen3-8b`` for the GPU benchmarks: Llama-3.2-1B's and Qwen3-8B's shapes with the tokenizer's
  vocabulary). ``tiny_shape`` keeps a tiny preset tiny under a large external tokenizer.
"""

from __future__ import annotations

import math
import random
from typing import Any

SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A preset's transformers config keys, the shape of a Llama-family decoder, in ``_decoder``'s
# argument order.
_DECODER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def _decoder(*values: Any, **extra: Any) -> dict[str, Any]:
    """The config of one preset: ``values`` for ``_DECODER_KEYS``, then ``extra`` (rope_theta,
    head_dim, sliding_window, ...)."""
    return {**dict(zip(_DECODER_KEYS, values, strict=True)), **extra}


# Shapes shared by all tiny presets: 4 layers, hidden 128, GQA 4/2 heads (head dim 32).
_TINY = _decoder(128, 352, 4, 4, 2, 2048, 1e-6, True)
# A large vocabulary would make the tied embedding most of a "tiny" model (151,680 x 128 = 19.4M
# parameters, and 96% of its FLOPs in the LM head): tiny presets halve the hidden size (128 -> 64 ->
# 32) until vocabulary x hidden fits this many parameters; heads stay 4/2 x 32 (head_dim set).
TINY_EMBEDDING_PARAMS = 1 << 22


def tiny_shape(shape: dict[str, Any], vocab: int) -> dict[str, Any]:
    """``shape`` (a ``_TINY``-based preset) with the hidden size for a ``vocab``-token embedding."""
    hidden = shape["hidden_size"]
    while hidden > 32 and vocab * hidden > TINY_EMBEDDING_PARAMS:
        hidden //= 2
    if hidden == shape["hidden_size"]:
        return shape
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    ratio = shape["intermediate_size"] / shape["hidden_size"]
    return {
        **shape,
        "hidden_size": hidden,
        "intermediate_size": round(hidden * ratio),
        "head_dim": head_dim,
    }


PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(_TINY)),
    "tiny-qwen2": ("qwen2", dict(_TINY)),
    "tiny-qwen3": ("qwen3", dict(_TINY, head_dim=32)),
    "tiny-mistral": ("mistral", dict(_TINY, sliding_window=256)),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, MLP 8192, tied embeddings, rope theta 5e5.
    "llama-1b": ("llama", _decoder(2048, 8192, 16, 32, 8, 131072, 1e-5, True, rope_theta=500000.0)),
    # Qwen3-8B: hidden 4096, 36 layers, 32/8 heads x 128 (q/k RMSNorm), MLP 12288, untied head.
    # Benchmarks usually cut the layers (--config-overrides num_hidden_layers=N) to fit their time.
    "qwen3-8b": (
        "qwen3",
        _decoder(4096, 12288, 36, 32, 8, 40960, 1e-6, False, head_dim=128, rope_theta=1000000.0),
    ),
}


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` over raw UTF-8 bytes (ids 0-255) plus ``SPECIAL_TOKENS``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps each byte to one printable symbol; a BPE with no merges keeps one token each.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    tok.padding_side = "right"
    return tok


def _words(text: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(text.split(sep))


_WORDS = _words(
    "apple river stone cloud maple garden silver window planet forest candle harbor meadow "
    "rocket pencil castle mirror valley thunder lantern orange violet copper falcon basket "
    "island marble summer winter shadow"
)
_ANIMALS = _words("cat dog fox owl bear horse rabbit tiger whale eagle otter wolf")
_ADJ = _words("quick lazy bright quiet brave small happy gentle clever curious")
_VERBS = _words("runs jumps sleeps sings waits reads swims hides dances plays")
_PLACES = _words(
    "in the garden|by the river|under the bridge|near the castle|on the hill|in the forest|"
    "at the harbor|behind the barn",
    "|",
)
_ONES = _words("zero one two three four five six seven eight nine")
_TEENS = _words("ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen")
_TENS = _words("_ _ twenty thirty forty fifty sixty seventy eighty ninety")


def _spell(n: int) -> str:
    """0 <= n < 1000 in English words."""
    if n < 10:
        return _ONES[n]
    if n < 20:
        return _TEENS[n - 10]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + _spell(rest))


# How many items (words, numbers, sentences) a request asks for. Real instruction data is
# long-tailed: most requests are short and a few are long (Alpaca's lengths span two orders of
# magnitude around a median of a few hundred bytes), which is where padding to the longest example of
# a batch wastes most. A log-normal count (median 5, sigma 1: a tenth of the requests over 18 items,
# one in a hundred over 50) gives the demo data that shape: a median example of ~150 bytes (tokens,
# with the byte tokenizer), a few near --max-length 1024. Every task draws from the same count, so
# lengths overlap across tasks and a token-budget pack mixes tasks instead of grouping one task per
# pack (which would make the loss jump between packs).
_MEDIAN_ITEMS = 5
_SIGMA_ITEMS = 1.0


def _count(rng: random.Random, cap: int) -> int:
    """A long-tailed item count in [1, cap] (see above)."""
    return max(1, min(cap, round(math.exp(rng.gauss(math.log(_MEDIAN_ITEMS), _SIGMA_ITEMS)))))


def _story(rng: random.Random) -> tuple[str, str]:
    animal = rng.choice(_ANIMALS)
    n = _count(rng, 24)  # ~40 bytes a sentence: at most ~1000 bytes
    lines = [
        f"The {rng.choice(_ADJ)} {animal} {rng.choice(_VERBS)} {rng.choice(_PLACES)}."
        for _ in range(n)
    ]
    return f"Write {_spell(n)} sentences about a {animal}.", " ".join(lines)


_TASKS = (
    ("Repeat the words.", lambda w: " ".join(w)),
    ("Write the words in upper case.", lambda w: " ".join(x.upper() for x in w)),
    ("Sort the words alphabetically.", lambda w: " ".join(sorted(w))),
    ("Reverse the order of the words.", lambda w: " ".join(reversed(w))),
    ("Write one word per line.", lambda w: "\n".join(w)),
    ("How many words are in the list?", lambda w: f"There are {_spell(len(w))} words."),
)


def _task(rng: random.Random) -> dict[str, str]:
    kind = rng.randrange(len(_TASKS) + 2)
    if kind == len(_TASKS):
        numbers = [rng.randint(0, 999) for _ in range(_count(rng, 30))]  # ~30 bytes a number
        return {
            "instruction": "Spell out the numbers in words.",
            "input": ", ".join(map(str, numbers)),
            "output": ", ".join(_spell(n) for n in numbers),
        }
    if kind == len(_TASKS) + 1:
        instruction, output = _story(rng)
        return {"instruction": instruction, "input": "", "output": output}
    instruction, answer = _TASKS[kind]
    # ~14 bytes a word (input and output): at most ~900 bytes
    words = [rng.choice(_WORDS) for _ in range(_count(rng, 64))]
    return {"instruction": instruction, "input": " ".join(words), "output": answer(words)}


def builtin_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` deterministic instruction records (same ``n`` and ``seed`` -> same records)."""
    rng = random.Random(f"hf-varlen-builtin-{seed}")
    return [_task(rng) for _ in range(n)]
