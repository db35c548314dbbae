"""Chat conversations as token ids plus the mask of assistant tokens (`data.train_on: assistant`).

    ids, mask = tokenize_chat(messages, tokenizer, where)   # mask[i]: token i belongs to an assistant turn

Two ways to find the assistant tokens, both over the same token ids as the plain rendering
(the chat template's text tokenized without added special tokens):

- generation markers: a template that wraps assistant output in `{% generation %}` ...
  `{% endgeneration %}` says exactly what to train on; transformers' `apply_chat_template(...,
  return_assistant_tokens_mask=True)` returns that mask.
- rendered prefixes (templates without markers, e.g. SmolLM2's): assistant message k spans the
  text between the render of messages[:k] with the generation prompt and the render of
  messages[:k+1]. So it covers everything the template writes for the turn after the prompt,
  its closing tokens included (what the model must learn to emit to end a turn). This needs
  the template to render a conversation's beginning as a prefix of the whole; when it does
  not, one line says so.

A token is an assistant token when it overlaps an assistant span (transformers' rule too), so
on a template whose markers wrap exactly the text after the generation prompt both ways agree
(a test checks it).
"""
from __future__ import annotations

import re
from typing import Any

from .sources import DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(tokenizer: Any) -> bool:
    return bool(_GENERATION_TAG.search(getattr(tokenizer, "chat_template", None) or ""))


def assistant_mask_method(tokenizer: Any) -> str:
    """How `tokenize_chat` finds assistant tokens with this tokenizer, for the data summary."""
    return "generation markers" if has_generation_markers(tokenizer) else "rendered prefixes"


def tokenize_chat(messages: list[dict], tokenizer: Any, where: str = "chat") -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it belongs to an assistant turn."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if has_generation_markers(tokenizer):
        return marker_mask(messages, tokenizer, where)
    return prefix_mask(messages, tokenizer, where)


def _render(tokenizer: Any, messages: list[dict], where: str, **kwargs) -> Any:
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as error:  # a template may reject a role order with its own exception type
        raise DataError(f"{where}: the chat template rejected these messages: {str(error).splitlines()[0]}") from None


def marker_mask(messages: list[dict], tokenizer: Any, where: str) -> tuple[list[int], list[bool]]:
    """The mask the template's `{% generation %}` markers define (transformers computes it)."""
    out = _render(tokenizer, messages, where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def prefix_mask(messages: list[dict], tokenizer: Any, where: str) -> tuple[list[int], list[bool]]:
    """The mask found by rendering each assistant turn's prefix (for templates without markers)."""
    text = _render(tokenizer, messages, where, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], where, tokenize=False, add_generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1], where, tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError(
                f"{where}: the chat template does not render a conversation's beginning as a prefix of it, so the"
                " assistant turns cannot be found; use a template with {% generation %} markers or data.train_on: all"
            )
        spans.append((len(before), len(through)))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(start < end_span and end > start_span for start_span, end_span in spans)
            for start, end in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask
