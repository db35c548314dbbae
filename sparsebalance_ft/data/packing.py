"""Pack a micro-batch's documents into one row, with positions restarting per document.

    batch = pack_micro_batch([corpus[i] for i in plan.micro_batches[rank][m]])
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

`labels` equal `input_ids` except at each document's first token, which is -100: the model's
shifted loss would otherwise train the last token of one document to predict the first token
of the next. `doc_lengths` and `cu_seqlens` describe the boundaries for varlen kernels and the
sparse attention (selection never crosses documents); they are not model arguments, so feed
the model through `model_inputs(batch)`, which also sets `use_cache=False`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100
MODEL_KEYS = ("input_ids", "position_ids", "labels")


def pack_micro_batch(docs: Sequence[np.ndarray | Sequence[int] | torch.Tensor]) -> dict | None:
    """Pack documents (token-id arrays) into one `[1, T]` row.

    Returns `None` for an empty list: a padding micro-batch, which the trainer still steps
    through (a zero-loss forward) so that every rank runs the same number of collectives.
    Otherwise a dict of:
      input_ids, position_ids, labels: LongTensor [1, T]
      doc_lengths: LongTensor [n_docs]
      cu_seqlens: int32 tensor [n_docs + 1], cumulative document starts (0, l0, l0+l1, ..., T)
      num_tokens: int, T
      num_label_tokens: int, tokens the shifted loss actually predicts (T - n_docs)
    Empty documents are an error (a document has at least its EOS).
    """
    if len(docs) == 0:
        return None
    arrays = []
    for i, doc in enumerate(docs):
        if isinstance(doc, torch.Tensor):
            arr = doc.detach().to("cpu", torch.long).reshape(-1).numpy()
        else:
            arr = np.asarray(doc, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise ValueError(f"document {i} of the micro-batch is empty")
        arrays.append(arr)
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    total = int(lengths.sum())
    starts = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])

    input_ids = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    positions = torch.arange(total, dtype=torch.long) - torch.from_numpy(np.repeat(starts, lengths))
    labels = input_ids.clone()
    labels[torch.from_numpy(starts)] = IGNORE_INDEX
    cu = torch.zeros(len(arrays) + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lengths)).to(torch.int32)
    return {
        "input_ids": input_ids.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "doc_lengths": torch.from_numpy(lengths),
        "cu_seqlens": cu,
        "num_tokens": total,
        "num_label_tokens": total - len(arrays),
    }


def model_inputs(batch: dict) -> dict:
    """Keyword arguments for the model's forward: input_ids, position_ids, labels and `use_cache=False`.

    `use_cache=False` is part of the contract, not an optimisation: with a cache (the default of
    most configs, in train mode too) transformers skips the packed-sequence mask and documents
    attend to each other.
    """
    inputs = {key: batch[key] for key in MODEL_KEYS}
    inputs["use_cache"] = False
    return inputs
