"""Bin packing helpers: documents into micro-batches under a token cap, and onto ranks by tokens."""
from __future__ import annotations

import numpy as np


def first_fit_decreasing(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Pack positions of `lengths` into bins holding at most `cap` tokens, longest first.

    Every length must be <= cap (the sampler checks this when it is built). Ties keep input order.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lens, kind="stable").tolist():
        li = int(lens[i])
        for b, r in enumerate(room):
            if li <= r:
                bins[b].append(i)
                room[b] = r - li
                break
        else:
            bins.append([i])
            room.append(cap - li)
    return bins


def next_fit(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Pack positions in their given order; a new bin starts when the next one does not fit."""
    bins: list[list[int]] = []
    room = -1
    for i, li in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if not bins or li > room:
            bins.append([i])
            room = cap - li
        else:
            bins[-1].append(i)
            room -= li
    return bins


def first_fit_ranks(tokens: np.ndarray, k: int) -> list[np.ndarray]:
    """Token balancing as sample-packing tools do it: first-fit decreasing onto `k` rank bins.

    Capacity is the even share `ceil(total / k)`; a document that fits in no rank (one longer
    than the share, or a leftover) goes to the rank with the fewest tokens. Returns `k` position
    arrays.
    """
    t = np.asarray(tokens, dtype=np.int64)
    n = t.shape[0]
    owner = np.empty(n, dtype=np.int64)
    if n == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(k)]
    capacity = -(-int(t.sum()) // k)
    room = np.full(k, capacity, dtype=np.int64)
    for i in np.argsort(-t, kind="stable").tolist():
        ti = t[i]
        fits = room >= ti
        r = int(np.argmax(fits)) if fits.any() else int(np.argmax(room))  # most room = fewest tokens
        owner[i] = r
        room[r] -= ti
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owner, minlength=k))[:-1])
