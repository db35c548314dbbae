"""A tiny decoder and a locally trained tokenizer, for work without any download.

`init_tiny(out_dir)` writes a small Llama (or Qwen2 / Mistral) checkpoint with random weights
and a byte-level BPE tokenizer trained on real local text (by default the Python standard
library sources of the running interpreter), both through `save_pretrained`, so that
`AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
load them like any Hugging Face checkpoint. Everything is deterministic for a given seed,
text source and library versions.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from ..errors import UserError

FAMILIES = ("llama", "qwen2", "mistral")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2 in that order

# Role markers are plain text; generation stops at EOS, which ends every turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Default size of the training text for the tokenizer: enough for a sensible 4K-8K vocabulary
# while keeping training to a few seconds on one core.
_TOKENIZER_TEXT_BYTES = 2_000_000


class TinyModelError(UserError):
    """A bad `init-tiny` argument (unknown family, inconsistent sizes, missing text)."""


def default_text_files() -> list[Path]:
    """Real local text: the top-level Python sources of the running interpreter's stdlib, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _text_files(text_source: str | os.PathLike | list | None) -> list[Path]:
    if text_source is None:
        files = default_text_files()
    elif isinstance(text_source, (list, tuple)):
        files = [Path(p) for p in text_source]
    else:
        source = Path(text_source)
        if source.is_dir():
            files = sorted(p for p in source.rglob("*") if p.is_file())
        else:
            files = [source]
    missing = [p for p in files if not p.is_file()]
    if missing:
        raise TinyModelError(f"{missing[0]}: tokenizer text file not found")
    if not files:
        raise TinyModelError(f"{text_source}: no text files to train the tokenizer on")
    return files


def _iter_text(files: list[Path], budget: int = _TOKENIZER_TEXT_BYTES) -> Iterator[str]:
    used = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            continue
        text = text[: max(budget - used, 0)]
        used += len(text)
        yield text
        if used >= budget:
            return


def _pretokenize_regex() -> str:
    from transformers.models.qwen2 import tokenization_qwen2

    return tokenization_qwen2.PRETOKENIZE_REGEX


def build_tokenizer(vocab_size: int = 4096, text_source: str | os.PathLike | list | None = None):
    """Train a byte-level BPE tokenizer on local text and wrap it as a `PreTrainedTokenizerFast`.

    Special tokens: `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2. The tokenizer adds no special tokens by
    itself (the data pipeline appends EOS per document); a simple chat template is attached.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise TinyModelError(f"vocab_size {vocab_size}: a byte-level tokenizer needs at least 300 entries")
    files = _text_files(text_source)

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer that transformers' Qwen2 tokenizer rebuilds on load,
    # so that every family's AutoTokenizer (Qwen2's included) tokenizes identically.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_pretokenize_regex()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_text(files), trainer=trainer)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,  # byte-level BPE never produces it; set so that no loader adds its own
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def tiny_config(
    family: str = "llama",
    *,
    vocab_size: int = 4096,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 65536,
    rope_theta: float = 500_000.0,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
):
    """The model config of a tiny decoder of the given family (no weights)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    family = family.lower()
    if family not in FAMILIES:
        raise TinyModelError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    if hidden_size % heads:
        raise TinyModelError(f"hidden_size {hidden_size} is not a multiple of heads {heads}")
    if heads % kv_heads:
        raise TinyModelError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    if family == "llama":
        return LlamaConfig(head_dim=hidden_size // heads, **common)
    if family == "mistral":
        return MistralConfig(head_dim=hidden_size // heads, sliding_window=None, **common)
    return Qwen2Config(use_sliding_window=False, sliding_window=None, max_window_layers=layers, **common)


def init_tiny(
    out_dir: str | os.PathLike,
    *,
    family: str = "llama",
    vocab_size: int = 4096,
    seed: int = 0,
    text_source: str | os.PathLike | list | None = None,
    **shape: Any,
) -> Path:
    """Write a tiny randomly initialised causal LM and a locally trained tokenizer to `out_dir`.

    Defaults: Llama, hidden 128, 4 layers, 4 query heads and 2 KV heads (GQA, head_dim 32),
    4096-token byte-level BPE vocabulary, rope theta 5e5 and 65536 positions; `shape` takes
    `tiny_config`'s size keywords (hidden_size, layers, heads, kv_heads, ...). `text_source`
    is a file, a folder (all files, recursively) or a list of files; default: the stdlib sources.
    Returns the output directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tiny_config(family, **shape)  # validate before the slow part
    tokenizer = build_tokenizer(vocab_size=vocab_size, text_source=text_source)
    config = tiny_config(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "sbft_tiny.json").write_text(
        json.dumps(
            {
                "family": family,
                "seed": seed,
                "text_source": "stdlib" if text_source is None else str(text_source),
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            indent=2,
        )
    )
    return out
