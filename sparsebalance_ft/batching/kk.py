"""Karmarkar-Karp differencing (the largest differencing method) for k-way number partitioning.

`karmarkar_karp(weights, k)` splits items into `k` parts whose weight sums are close. Every item
starts as a k-tuple of subset sums (its weight and k-1 empty subsets); the two tuples with the
largest spread (max - min) are repeatedly combined by pairing the heaviest subset of one with the
lightest subset of the other, until one tuple is left.

Implementation notes (for speed at 100,000 items x 1,024 parts):
- a tuple keeps only its non-empty subsets, sorted heaviest first, so early merges are tiny;
- a union of two non-empty subsets becomes a new node of a forest (two child ids); item
  membership is recovered once at the end by pointer jumping, never by copying lists.
Ties are broken by item order and creation order only, so the result is a pure function of the
input (identical in every process).
"""
from __future__ import annotations

import heapq

import numpy as np


def _checked_weights(weights: np.ndarray, k: int) -> np.ndarray:
    """The weights as a flat float64 array, after the checks both partitioners need."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if w.size and (not np.all(np.isfinite(w)) or np.any(w < 0)):
        raise ValueError("weights must be finite and non-negative")
    return w


def karmarkar_karp(weights: np.ndarray, k: int) -> list[np.ndarray]:
    """Partition positions 0..n-1 of `weights` into `k` parts; returns `k` index arrays.

    Parts are returned heaviest first; parts may be empty when n < k. Weights must be finite
    and non-negative.
    """
    w = _checked_weights(weights, k)
    n = int(w.shape[0])
    if n == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(k)]
    if k == 1:
        return [np.arange(n, dtype=np.int64)]

    # forest of subsets: nodes 0..n-1 are items, later nodes are unions of two nodes
    parent = np.full(2 * n, -1, dtype=np.int64)
    next_node = n
    sums: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    heap: list[tuple[float, int]] = []
    # heaviest items first so that ties in spread resolve in a fixed, sensible order
    order = np.argsort(-w, kind="stable")
    for t, i in enumerate(order.tolist()):
        sums.append(np.array([w[i]]))
        ids.append(np.array([i], dtype=np.int64))
        heapq.heappush(heap, (-float(w[i]), t))

    while len(heap) > 1:
        _, tx = heapq.heappop(heap)
        _, ty = heapq.heappop(heap)
        xs, xi, ys, yi = sums[tx], ids[tx], sums[ty], ids[ty]
        sums[tx] = sums[ty] = None  # type: ignore[call-overload]
        ids[tx] = ids[ty] = None  # type: ignore[call-overload]
        a, b = xs.shape[0], ys.shape[0]
        # conceptually X heaviest-first padded with zeros, Y lightest-first with zeros in front:
        # position p in 0..k-1 pairs X[p] with Y_asc[p]; Y's subsets sit at p >= k-b.
        start = k - b
        keep = min(a, start)
        ys_rev, yi_rev = ys[::-1], yi[::-1]
        # positions start..k-1: X subset present only where p < a
        overlap = max(0, a - start)  # number of Y subsets that meet a non-empty X subset
        parts_s = [xs[:keep]]
        parts_i = [xi[:keep]]
        if overlap:
            merged_s = xs[start:a] + ys_rev[:overlap]
            new_ids = np.arange(next_node, next_node + overlap, dtype=np.int64)
            parent[xi[start:a]] = new_ids
            parent[yi_rev[:overlap]] = new_ids
            next_node += overlap
            parts_s.append(merged_s)
            parts_i.append(new_ids)
        if overlap < b:
            parts_s.append(ys_rev[overlap:])
            parts_i.append(yi_rev[overlap:])
        s = np.concatenate(parts_s)
        i_ = np.concatenate(parts_i)
        o = np.argsort(-s, kind="stable")
        s, i_ = s[o], i_[o]
        t = len(sums)
        sums.append(s)
        ids.append(i_)
        spread = float(s[0] - (s[-1] if s.shape[0] == k else 0.0))
        heapq.heappush(heap, (-spread, t))

    _, root_t = heap[0]
    roots = ids[root_t]
    # pointer jumping: every node's top ancestor
    top = np.arange(next_node, dtype=np.int64)
    par = parent[:next_node]
    has = par >= 0
    top[has] = par[has]
    while True:
        nxt = top[top]
        if np.array_equal(nxt, top):
            break
        top = nxt
    part_of_root = np.full(next_node, -1, dtype=np.int64)
    part_of_root[roots] = np.arange(roots.shape[0])
    item_part = part_of_root[top[:n]]
    order_items = np.argsort(item_part, kind="stable")
    counts = np.bincount(item_part, minlength=k)
    splits = np.split(order_items, np.cumsum(counts)[:-1])
    return [np.asarray(p, dtype=np.int64) for p in splits]


def lpt(weights: np.ndarray, k: int) -> list[np.ndarray]:
    """Greedy longest-processing-time-first: each item, heaviest first, to the lightest part."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    loads = [(0.0, p) for p in range(k)]
    heapq.heapify(loads)
    owner = np.empty(w.shape[0], dtype=np.int64)
    for i in np.argsort(-w, kind="stable").tolist():
        load, p = heapq.heappop(loads)
        owner[i] = p
        heapq.heappush(loads, (load + float(w[i]), p))
    return [np.flatnonzero(owner == p) for p in range(k)]


def karmarkar_karp_equal(weights: np.ndarray, k: int) -> list[np.ndarray]:
    """Karmarkar-Karp into `k` parts of equal item count (counts differ by at most one when k does not divide n).

    The items, heaviest first, are cut into consecutive groups of `k`; each group starts as a k-tuple
    holding one item per subset (the last group's missing items as empty subsets). The two tuples
    with the largest spread are combined by pairing the heaviest subset of one with the lightest
    of the other, until one tuple is left. Pairing one subset of each tuple with one of the other
    keeps the counts equal. Deterministic (ties by creation order). Returns `k` index arrays.
    """
    w = _checked_weights(weights, k)
    n = int(w.shape[0])
    if n == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(k)]
    order = np.argsort(-w, kind="stable")
    # a tuple: (subset sums [k], subset member lists [k]) with sums sorted heaviest first
    tuples: list[tuple[np.ndarray, list[list[int]]]] = []
    heap: list[tuple[float, int]] = []
    for start in range(0, n, k):
        items = order[start : start + k].tolist()
        members = [[i] for i in items] + [[] for _ in range(k - len(items))]
        sums = np.array([w[i] for i in items] + [0.0] * (k - len(items)))
        tuples.append((sums, members))
        heapq.heappush(heap, (-float(sums[0] - sums[-1]), len(tuples) - 1))
    while len(heap) > 1:
        _, tx = heapq.heappop(heap)
        _, ty = heapq.heappop(heap)
        (xs, xm), (ys, ym) = tuples[tx], tuples[ty]
        sums = xs + ys[::-1]
        members = [a + b for a, b in zip(xm, ym[::-1])]
        o = np.argsort(-sums, kind="stable")
        tuples.append((sums[o], [members[i] for i in o]))
        heapq.heappush(heap, (-float(sums[o[0]] - sums[o[-1]]), len(tuples) - 1))
    _, root = heap[0]
    return [np.asarray(sorted(m), dtype=np.int64) for m in tuples[root][1]]
