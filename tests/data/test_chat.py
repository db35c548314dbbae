"""Assistant-only labels: the generation-marker mask, the rendered-prefix fallback, and their path to the packed batch."""
import copy
import json

import numpy as np
import pytest

from sparsebalance_ft.data.chat import has_generation_markers, marker_mask, prefix_mask, tokenize_chat
from sparsebalance_ft.data.corpus import load_corpus
from sparsebalance_ft.data.packing import IGNORE_INDEX, pack_documents
from sparsebalance_ft.data.sources import DataError
from sparsebalance_ft.recipe import DataConfig

# ChatML-like, with the assistant's output (after the generation prompt) wrapped in generation markers
MARKED_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ m['content'] }}{{ eos_token }}\n{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, on the Seine."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def marked_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


def _masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_prefix_fallback_equals_the_generation_marker_mask(marked_tokenizer):
    assert has_generation_markers(marked_tokenizer)
    marked_ids, marked = marker_mask(CHAT, marked_tokenizer, "t")
    prefix_ids, prefixed = prefix_mask(CHAT, marked_tokenizer, "t")
    assert prefix_ids == marked_ids
    assert prefixed == marked and 0 < sum(marked) < len(marked)
    # and the mask is what the markers wrap: each assistant reply with its end-of-turn token
    assert _masked_text(marked_tokenizer, marked_ids, marked) == "Paris, on the Seine.<|eos|>\nRome.<|eos|>\n"


def test_template_without_markers_uses_rendered_prefixes(tiny_tokenizer):
    assert not has_generation_markers(tiny_tokenizer)
    ids, mask = tokenize_chat(CHAT, tiny_tokenizer, "t")
    assert ids == tiny_tokenizer(tiny_tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert _masked_text(tiny_tokenizer, ids, mask) == "Paris, on the Seine.<|eos|>\nRome.<|eos|>\n"


def test_a_template_that_is_not_prefix_stable_is_one_line(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    # numbers turns from the end: an earlier render is not a prefix of the whole
    tokenizer.chat_template = "{% for m in messages %}{{ messages|length - loop.index }}:{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DataError, match=r"^t: the chat template does not render .* generation %\} markers or data.train_on: all$"):
        tokenize_chat(CHAT, tokenizer, "t")


def _chat_file(tmp_path, conversations):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def test_assistant_labels_reach_the_packed_batch(tmp_path, marked_tokenizer):
    second = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    path = _chat_file(tmp_path, [CHAT, second])
    cfg = dict(path=str(path), messages_field="messages", cache_dir=str(tmp_path / "c"), min_seq_len=2)
    corpus = load_corpus(DataConfig(**cfg, train_on="assistant"), marked_tokenizer)
    plain = load_corpus(DataConfig(**cfg), marked_tokenizer)
    assert corpus.summary()["fingerprint"] != plain.summary()["fingerprint"]  # masks are cached apart
    assert corpus.summary()["assistant_mask"] == "generation markers"
    for i, conversation in enumerate([CHAT, second]):
        assert corpus[i].tolist() == plain[i].tolist()  # same tokens, only the labels differ
        ids, mask = marker_mask(conversation, marked_tokenizer, "t")
        labels = corpus.example(i)["labels"]
        expected = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)] + [IGNORE_INDEX]  # the document's EOS
        assert labels.tolist() == expected
        assert corpus.target_tokens[i] == sum(mask[1:])
    assert "labels" not in plain.example(0) and plain.target_tokens.tolist() == (plain.lengths - 1).tolist()

    batch = pack_documents(corpus, [1, 0])
    first, second_labels = corpus.example(1)["labels"], corpus.example(0)["labels"]
    expected = np.concatenate([[IGNORE_INDEX], first[1:], [IGNORE_INDEX], second_labels[1:]])
    assert batch["labels"][0].tolist() == expected.tolist()
    assert int((batch["labels"][0, 1:] != IGNORE_INDEX).sum()) == int(corpus.target_tokens.sum())

    again = load_corpus(DataConfig(**cfg, train_on="assistant"), marked_tokenizer)  # from the cache
    assert again.summary()["cache_hit"] and again.example(0)["labels"].tolist() == corpus.example(0)["labels"].tolist()


def test_train_on_assistant_needs_chat_data():
    with pytest.raises(ValueError, match="train_on: assistant needs chat data"):
        DataConfig(path="x.jsonl", train_on="assistant")
