"""Regrouping a look-ahead window: which documents share a step, before any rank assignment.

Every policy that sees the look-ahead (`LOOKAHEAD_POLICIES`) gets the same window: the next
`lookahead_steps` steps' documents of the epoch's shuffled order. It reorders them so each step
holds comparable documents, then the sampler cuts them into steps and shuffles the steps. This is
the one implementation of length regrouping (the idea behind transformers'
`get_length_grouped_indices`: sort a mega-batch by length, cut it into batches); policies differ
only in the sort key, and `verl` in forming steps by balanced bins instead of by sorting.
(transformers' function is not called: it sorts by length only, with its own torch generator and
mega-batch size, while `sparsebalance` sorts by predicted time and every rank must draw the same
order from numpy with the sampler's seed.)

- `length-grouped`: longest first;
- `sparsebalance`: by predicted time (the cost model at each document's known density), heaviest
  first, so a step holds documents of equal cost, not only of equal length (with one document per
  rank this *is* the partition);
- `verl`: Karmarkar-Karp of the whole window into (steps x ranks) equal-count bins on verl's
  proxy; the bins, heaviest first, are cut into steps of `world_size` bins.
"""
from __future__ import annotations

import math

import numpy as np

from .kk import karmarkar_karp_equal
from .policies import VERL_FLOPS_A, flops_proxy


def regroup_order(policy: str, lengths: np.ndarray, costs: np.ndarray | None) -> np.ndarray:
    """Positions of a look-ahead window in regrouped order (sort-based policies)."""
    lens = np.asarray(lengths, dtype=np.float64)
    if policy == "length-grouped":
        return np.argsort(-lens, kind="stable")
    if policy == "sparsebalance":
        return np.argsort(-(costs if costs is not None else lens), kind="stable")
    raise ValueError(f"policy {policy!r} does not regroup by sorting")


def regroup_windows(
    policy: str, lengths: np.ndarray, costs: np.ndarray | None, window: int, world_size: int
) -> list[np.ndarray]:
    """Split a look-ahead window (positions 0..n-1) into steps of comparable documents.

    Returns the steps as position arrays, in regrouped order (the caller shuffles them); every
    step but possibly one holds `window` documents for sort-based policies; `verl`'s steps hold
    `world_size` equal-count bins.
    """
    n = int(np.asarray(lengths).shape[0])
    n_windows = max(1, math.ceil(n / window))
    if policy == "verl":
        bins = karmarkar_karp_equal(flops_proxy(lengths, VERL_FLOPS_A), n_windows * world_size)
        w = flops_proxy(lengths, VERL_FLOPS_A)
        loads = np.array([w[b].sum() for b in bins])
        bins = [bins[i] for i in np.argsort(-loads, kind="stable")]
        steps = [np.concatenate(bins[s * world_size : (s + 1) * world_size]) for s in range(n_windows)]
        return [s for s in steps if s.size]
    order = regroup_order(policy, lengths, costs)
    return [order[s * window : (s + 1) * window] for s in range(n_windows)]
