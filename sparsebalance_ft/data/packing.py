"""Pack a micro-batch's documents into one row, with positions restarting per document.

    batch = pack_documents(corpus, plan.micro_batches[rank][m])
    if batch is not None:                      # None: a padding micro-batch (no documents)
        out = model(**model_inputs(batch))      # input_ids, position_ids, labels, use_cache=False

The row is `[1, T]` with `T = sum(len(doc))`. `position_ids` restart at 0 at each document
start; with no `attention_mask` and no cache, transformers (5.x, `masking_utils`
`find_packed_sequence_indices`) reads the restarts as document boundaries and builds a
block-diagonal causal mask for `sdpa`, `eager` and `flex_attention`, so no token attends to
another document. Two conditions make that hold, and the caller must keep both:

- pass no `attention_mask` (a 2D mask of ones disables the packed detection), and
- pass `use_cache=False` (a model in eval mode otherwise creates a cache, and with a cache the
  packed detection is skipped, so documents attend to each other).

`labels` are each document's labels (its tokens, or -100 outside assistant turns under
`data.train_on: assistant`) with -100 at its first token: the model's shifted loss would
otherwise train the last token of one document to predict the first token of the next.
`cu_seq_lens_q/k` and `max_length_q/k` describe the boundaries for varlen kernels and the
sparse attention (selection never crosses documents); they are not needed by the model's
mask, so feed the model through `model_inputs(batch)`, which also sets `use_cache=False`.

The result is exactly what transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
returns (a test pins it), built with numpy instead of per-token Python lists: the library
call is 61x slower at 32k tokens (23 ms against 0.38 ms, `make bench-packing`), on every
step's critical path.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import numpy as np
import torch

IGNORE_INDEX = -100
MODEL_KEYS = ("input_ids", "position_ids", "labels")

TokenIds = Union[np.ndarray, Sequence[int], torch.Tensor]
Document = Union[TokenIds, Mapping[str, TokenIds]]


def _ids(values: TokenIds) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.long).reshape(-1).numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def pack_micro_batch(docs: Sequence[Document]) -> dict | None:
    """Pack documents into one `[1, T]` row.

    A document is its token ids, or a mapping with `input_ids` and optionally `labels` (same
    length; -100 marks tokens not trained on). Returns `None` for an empty list: a padding
    micro-batch, which the trainer still steps through (a zero-loss forward) so that every
    rank runs the same number of collectives. Otherwise a dict of:
      input_ids, position_ids, labels: LongTensor [1, T]
      cu_seq_lens_q, cu_seq_lens_k: int32 tensor [n_docs + 1], (0, l0, l0+l1, ..., T)
      max_length_q, max_length_k: int, the longest document
    Empty documents are an error (a document has at least its EOS).
    """
    if len(docs) == 0:
        return None
    tokens, labels = [], []
    for i, doc in enumerate(docs):
        ids = _ids(doc["input_ids"] if isinstance(doc, Mapping) else doc)
        if ids.size == 0:
            raise ValueError(f"document {i} of the micro-batch is empty")
        doc_labels = _ids(doc["labels"]) if isinstance(doc, Mapping) and "labels" in doc else ids
        if doc_labels.size != ids.size:
            raise ValueError(f"document {i} of the micro-batch has {doc_labels.size} labels for {ids.size} tokens")
        tokens.append(ids)
        labels.append(doc_labels)
    lengths = np.array([a.size for a in tokens], dtype=np.int64)
    starts = np.zeros(len(tokens), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])

    label_row = np.concatenate(labels)  # a new array: the documents' own labels stay untouched
    label_row[starts] = IGNORE_INDEX
    positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
    cu = np.zeros(len(tokens) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    longest = int(lengths.max())
    return {
        "input_ids": torch.from_numpy(np.concatenate(tokens)).unsqueeze(0),
        "labels": torch.from_numpy(label_row).unsqueeze(0),
        "position_ids": torch.from_numpy(positions).unsqueeze(0),
        "cu_seq_lens_q": torch.from_numpy(cu),
        "cu_seq_lens_k": torch.from_numpy(cu.copy()),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def pack_documents(corpus, indices: Sequence[int]) -> dict | None:
    """`pack_micro_batch` over corpus documents, with their assistant-only labels where the corpus has them."""
    return pack_micro_batch([corpus.example(i) for i in indices])


def model_inputs(batch: dict) -> dict:
    """Keyword arguments for the model's forward: input_ids, position_ids, labels and `use_cache=False`.

    `use_cache=False` is part of the contract, not an optimisation: with a cache (the default of
    most configs, in train mode too) transformers skips the packed-sequence mask and documents
    attend to each other.
    """
    inputs = {key: batch[key] for key in MODEL_KEYS}
    inputs["use_cache"] = False
    return inputs
